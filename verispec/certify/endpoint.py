"""An arm of the two-sample test that samples an OpenAI-compatible server (``/v1/completions``):
vLLM, SGLang, llama.cpp's ``llama-server``, ``verispec serve``.

Each request asks for ``n`` continuations of the prompt text with the run's sampling parameters
and its own ``seed``. The test needs independent draws, and llama.cpp's ``llama-server`` draws
the ``n`` continuations of one request from one seed (runs of identical continuations, counts in
multiples of n): ``verispec certify`` therefore asks one continuation per request
(``per_request = 1``); a larger ``n`` is for servers known to draw them independently. The API returns
text, so the outcome of a continuation is the first ``tokens`` ids of its text under a tokenizer
named explicitly (the model's own, loaded locally): the same function of the text in both arms,
so equal laws of text give equal laws of outcomes and the test stays exact. Responses are checked
(a server that returns fewer choices, or no text, is an error, not a sample), 429 and 503 are
retried with exponential backoff, every request has a timeout, and the number of requests is
bounded in advance.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from verispec.config import SamplingParams
from verispec.errors import VerispecError

RETRY_STATUS = (429, 503)


class EndpointError(VerispecError):
    """The endpoint failed in a way retries do not mend (bad status, malformed body, timeout)."""


def endpoint_arm(
    url: str,
    model: str,
    decode: Callable[[str], list[int]],
    *,
    per_request: int = 16,
    api_key: str | None = None,
    timeout: float = 120.0,
    retries: int = 5,
    backoff: float = 0.5,
    max_requests: int = 10_000,
    client: Any = None,
) -> Callable[[str, Sequence[int], SamplingParams, int, int], list[tuple[int, ...]]]:
    """An arm sampling ``url`` (``http(s)://HOST:PORT[/v1]``) for ``model``; ``decode`` turns a
    continuation's text into token ids (the named tokenizer's ``encode``, without special tokens).
    The arm sends the prompt's text and returns each continuation's ids, uncut."""
    import httpx

    from verispec.bench.loadgen import parse_endpoint

    root = parse_endpoint(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = client or httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
    sent = [0]

    def post(body: dict[str, Any]) -> dict[str, Any]:
        delay = backoff
        for attempt in range(retries + 1):
            if sent[0] >= max_requests:
                raise EndpointError(f"the run needs more than {max_requests} requests; lower --samples")
            sent[0] += 1
            try:
                response = http.post(f"{root}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                if attempt == retries:
                    raise EndpointError(f"{root}: {type(exc).__name__}: {exc}") from exc
                time.sleep(delay)
                delay *= 2
                continue
            if response.status_code in RETRY_STATUS and attempt < retries:
                time.sleep(delay)
                delay *= 2
                continue
            if response.status_code != 200:
                raise EndpointError(f"{root}/v1/completions answered {response.status_code}: {response.text[:200]}")
            try:
                data = response.json()
            except ValueError as exc:
                raise EndpointError(f"{root}/v1/completions answered a body that is not JSON") from exc
            if not isinstance(data, dict):
                raise EndpointError(f"{root}/v1/completions answered {type(data).__name__}, not an object")
            return data
        raise EndpointError(f"{root}: still busy after {retries} retries")  # pragma: no cover

    def sample(prompt: str, ids: Sequence[int], params: SamplingParams, n: int, seed: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        request = 0
        while len(out) < n:
            count = min(per_request, n - len(out))
            body: dict[str, Any] = {
                "model": model, "prompt": prompt, "n": count, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "seed": seed + request, "stream": False,
            }  # fmt: skip
            if params.top_k:
                body["top_k"] = params.top_k
            if params.min_p:
                body["min_p"] = params.min_p
            data = post(body)
            choices = data.get("choices")
            if not isinstance(choices, list) or len(choices) != count:
                got = len(choices) if isinstance(choices, list) else "no"
                raise EndpointError(f"asked {url} for {count} continuations and got {got}; does it support n?")
            for choice in choices:
                text = choice.get("text") if isinstance(choice, dict) else None
                if not isinstance(text, str):
                    raise EndpointError(f"{url} returned a choice without text")
                out.append(tuple(decode(text)))
            request += 1
        return out

    return sample
