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
retried with exponential backoff, every request has a timeout, the number of requests is
bounded in advance, and no answer is read past 8 MiB.

The goodness-of-fit mode needs exact ids on both sides: the speculative arm asks for its sampled
ids (``token_ids``: vLLM's ``return_tokens_as_token_ids``), and :func:`endpoint_scorer` asks the
baseline to score the prompt's ids followed by each outcome's (``echo`` + ``logprobs``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from verispec.config import SamplingParams
from verispec.errors import VerispecError

RETRY_STATUS = (429, 503)
#: The largest answer read from an endpoint (a few-token completion, or a prompt echoed with its
#: logprobs, is a few KiB).
MAX_RESPONSE_BYTES = 8 << 20


class EndpointError(VerispecError):
    """The endpoint failed in a way retries do not mend (bad status, malformed body, timeout)."""


def _poster(
    url: str, *, api_key: str | None, timeout: float, retries: int, backoff: float, max_requests: int, client: Any
) -> tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    """(the server's root, a function POSTing a body to its ``/v1/completions``): retries 429/503
    and transport errors with exponential backoff, never more than ``max_requests`` requests."""
    import httpx

    from verispec.bench.loadgen import parse_endpoint

    root = parse_endpoint(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = client or httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
    sent = [0]
    lock = threading.Lock()  # (the arm may post from several threads)

    def post(body: dict[str, Any]) -> dict[str, Any]:
        delay = backoff
        for attempt in range(retries + 1):
            with lock:
                if sent[0] >= max_requests:
                    raise EndpointError(f"the run needs more than {max_requests} requests; lower --samples")
                sent[0] += 1
            try:
                with http.stream("POST", f"{root}/v1/completions", json=body) as response:
                    status, content = response.status_code, _read_bounded(response, root)
            except httpx.HTTPError as exc:
                if attempt == retries:
                    raise EndpointError(f"{root}: {type(exc).__name__}: {exc}") from exc
                time.sleep(delay)
                delay *= 2
                continue
            if status in RETRY_STATUS and attempt < retries:
                time.sleep(delay)
                delay *= 2
                continue
            if status != 200:
                text = content[:200].decode("utf-8", errors="replace")
                raise EndpointError(f"{root}/v1/completions answered {status}: {text}")
            try:
                data = json.loads(content)
            except ValueError as exc:
                raise EndpointError(f"{root}/v1/completions answered a body that is not JSON") from exc
            if not isinstance(data, dict):
                raise EndpointError(f"{root}/v1/completions answered {type(data).__name__}, not an object")
            return data
        raise EndpointError(f"{root}: still busy after {retries} retries")  # pragma: no cover

    return root, post


def _read_bounded(response: Any, root: str) -> bytes:
    """The body of ``response``, refused past :data:`MAX_RESPONSE_BYTES` (a server, or whoever
    answers in its place, must not be able to fill this process's memory)."""
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise EndpointError(f"{root}/v1/completions answered more than {MAX_RESPONSE_BYTES >> 20} MiB; "
                                "a completion of a few tokens is a few KiB: is this the right server?")  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


def endpoint_arm(
    url: str,
    model: str,
    decode: Callable[[str], list[int]] | None,
    *,
    per_request: int = 16,
    token_ids: bool = False,
    concurrency: int = 1,
    api_key: str | None = None,
    timeout: float = 120.0,
    retries: int = 5,
    backoff: float = 0.5,
    max_requests: int = 10_000,
    client: Any = None,
) -> Callable[[str, Sequence[int], SamplingParams, int, int], list[tuple[int, ...]]]:
    """An arm sampling ``url`` (``http(s)://HOST:PORT[/v1]``) for ``model``; ``decode`` turns a
    continuation's text into token ids (the named tokenizer's ``encode``, without special tokens).
    With ``token_ids`` the arm asks for the sampled ids themselves (``logprobs`` with
    ``return_tokens_as_token_ids``, as vLLM answers) and needs no ``decode``. Up to
    ``concurrency`` requests are in flight at once (request ``i`` has seed ``seed + i`` whatever the
    order they finish in). The arm sends the prompt's text and returns each continuation's ids, uncut."""
    if decode is None and not token_ids:
        raise EndpointError("an endpoint arm needs a tokenizer to turn text into ids, or token_ids=True")
    if per_request < 1 or concurrency < 1:
        raise EndpointError("per_request and concurrency must be >= 1")
    _, post = _poster(url, api_key=api_key, timeout=timeout, retries=retries, backoff=backoff,
                      max_requests=max_requests, client=client)  # fmt: skip

    def one(prompt: str, params: SamplingParams, count: int, seed: int) -> list[tuple[int, ...]]:
        body: dict[str, Any] = {
            "model": model, "prompt": prompt, "n": count, "max_tokens": params.max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "seed": seed, "stream": False,
        }  # fmt: skip
        if params.top_k:
            body["top_k"] = params.top_k
        if params.min_p:
            body["min_p"] = params.min_p
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(params, name):
                body[name] = getattr(params, name)
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty  # (vLLM's and verispec's name for it)
        if token_ids:
            body |= {"logprobs": 1, "return_tokens_as_token_ids": True}
        data = post(body)
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != count:
            got = len(choices) if isinstance(choices, list) else "no"
            raise EndpointError(f"asked {url} for {count} continuations and got {got}; does it support n?")
        out: list[tuple[int, ...]] = []
        for choice in choices:
            if token_ids:
                out.append(tuple(_ids_of(choice, url)))
                continue
            text = choice.get("text") if isinstance(choice, dict) else None
            if not isinstance(text, str):
                raise EndpointError(f"{url} returned a choice without text")
            assert decode is not None
            out.append(tuple(decode(text)))
        return out

    def sample(prompt: str, ids: Sequence[int], params: SamplingParams, n: int, seed: int) -> list[tuple[int, ...]]:
        counts = [min(per_request, n - start) for start in range(0, n, per_request)]
        if concurrency == 1:
            batches = [one(prompt, params, count, seed + i) for i, count in enumerate(counts)]
        else:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                batches = list(pool.map(lambda ic: one(prompt, params, ic[1], seed + ic[0]), enumerate(counts)))
        return [c for batch in batches for c in batch]

    return sample


def _logprobs_of(choice: Any) -> dict[str, Any] | None:
    """A choice's ``logprobs`` object, None when it has none."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    return logprobs if isinstance(logprobs, dict) else None


def _ids_of(choice: Any, url: str) -> list[int]:
    """The token ids of a choice answered with ``return_tokens_as_token_ids``."""
    tokens = (_logprobs_of(choice) or {}).get("tokens")
    if not isinstance(tokens, list):
        raise EndpointError(f"{url} returned no token ids (logprobs.tokens); the goodness-of-fit mode needs them "
                            "(vLLM: return_tokens_as_token_ids): use the two-sample test")  # fmt: skip
    return _token_ids(tokens, url)


def _token_ids(tokens: list[Any], url: str) -> list[int]:
    """Ids from tokens written "token_id:N"."""
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token.startswith("token_id:") or not token[9:].isdigit():
            raise EndpointError(f"{url} returned a token that is not 'token_id:N' ({str(token)[:40]!r}); "
                                "the goodness-of-fit mode needs the sampled ids: use the two-sample test")  # fmt: skip
        ids.append(int(token[9:]))
    return ids


def endpoint_scorer(
    url: str,
    model: str,
    *,
    api_key: str | None = None,
    timeout: float = 120.0,
    retries: int = 5,
    backoff: float = 0.5,
    max_requests: int = 10_000,
    client: Any = None,
) -> Callable[[str, Sequence[int], Sequence[tuple[int, ...]], SamplingParams, int], list[float | None]]:
    """A scorer asking ``url`` for prompt logprobs (``echo`` with ``logprobs``, as vLLM answers):
    first the prompt text echoed with its token ids (the server's own tokenization, special tokens
    included), then each outcome's ids appended to those and scored. Servers return the model's raw
    logprobs, so only temperature 1 without truncation or penalties can be scored; an outcome cut
    short by an end of sequence is not scored (the server's stop ids are unknown here): it is tested
    within the rest."""
    _, post = _poster(url, api_key=api_key, timeout=timeout, retries=retries, backoff=backoff,
                      max_requests=max_requests, client=client)  # fmt: skip

    def echo(prompt: str | list[int]) -> tuple[list[Any], list[Any], int | None]:
        """(tokens, their logprobs, the prompt's token count when the server says it)."""
        data = post({"model": model, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                     "temperature": 1.0, "return_tokens_as_token_ids": True})  # fmt: skip
        choices = data.get("choices")
        logprobs = _logprobs_of(choices[0]) if isinstance(choices, list) and choices else None
        tokens = logprobs.get("tokens") if logprobs is not None else None
        values = logprobs.get("token_logprobs") if logprobs is not None else None
        if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
            raise EndpointError(f"{url} did not return prompt logprobs with echo (vLLM does; llama-server does "
                                "not): it cannot score; use the two-sample test")  # fmt: skip
        usage = data.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return tokens, values, counted if isinstance(counted, int) and 0 < counted <= len(tokens) else None

    def score(
        text: str, ids: Sequence[int], outcomes: Sequence[tuple[int, ...]], params: SamplingParams, length: int
    ) -> list[float | None]:
        if params.temperature != 1.0 or params.top_k or params.top_p < 1.0 or params.min_p or params.uses_history:
            raise EndpointError(
                "an endpoint scores with the model's raw logprobs: the goodness-of-fit mode runs at temperature 1 "
                "without top-k, top-p, min-p or penalties; use the two-sample test"
            )
        tokens, _, counted = echo(text)
        echoed = _token_ids(tokens, url)
        prompt_ids = echoed[:counted] if counted is not None else echoed[:-1]  # (else: one generated token follows)
        out: list[float | None] = []
        for outcome in outcomes:
            if len(outcome) < length:
                out.append(None)
                continue
            _, values, _ = echo(prompt_ids + list(outcome))
            picked = values[len(prompt_ids) : len(prompt_ids) + len(outcome)]
            if len(picked) != len(outcome) or not all(isinstance(v, (int, float)) for v in picked):
                raise EndpointError(f"{url} scored {len(picked)} of the {len(outcome)} tokens it was sent")
            out.append(math.exp(sum(picked)))
        return out

    return score
