"""Prometheus metrics of the server, with vLLM's names and meanings under a ``verispec:`` prefix.

Each app has its own :class:`CollectorRegistry` (several servers, or tests, in one process never
share counters). prometheus-client appends ``_total`` to counters. Every series carries a
``model_name`` label (the first served model name), as vLLM's do. The mapping to vLLM's names, so
that a load generator can scrape either server with one table::

    verispec:spec_decode_num_drafts_total                        vllm:spec_decode_num_drafts_total
    verispec:spec_decode_num_draft_tokens_total                  vllm:spec_decode_num_draft_tokens_total
    verispec:spec_decode_num_accepted_tokens_total               vllm:spec_decode_num_accepted_tokens_total
    verispec:spec_decode_num_accepted_tokens_per_pos_total{position}
                                                   vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
    verispec:prompt_tokens_total                                 vllm:prompt_tokens_total
    verispec:generation_tokens_total                             vllm:generation_tokens_total
    verispec:request_success_total{finished_reason}              vllm:request_success_total{finished_reason}
    verispec:time_to_first_token_seconds (histogram)             vllm:time_to_first_token_seconds
    verispec:inter_token_latency_seconds (histogram)             vllm:inter_token_latency_seconds
    verispec:e2e_request_latency_seconds (histogram)             vllm:e2e_request_latency_seconds
    verispec:num_requests_running (gauge)                        vllm:num_requests_running
    verispec:num_requests_waiting (gauge)                        vllm:num_requests_waiting
    verispec:spec_decode_nodes_per_step (histogram)              (none: draft tokens a step checked: K, or tree nodes)
    verispec:spec_decode_accepted_depth (histogram)              (none: draft tokens a step accepted: a path's depth)
    verispec:requests_rejected_total{reason}                     (none: 429 queue_full / 503 shutting_down)
    verispec:spec_decode_info{target,draft,drafter,lossless}     (none: a constant 1 describing the pair)
    verispec:spec_decode_num_free_drafts_total                   (none: drafts that cost no model pass,
    verispec:spec_decode_num_free_draft_tokens_total               a composite's lookup; counted in the
    verispec:spec_decode_num_free_accepted_tokens_total            three totals above as well)
    process_resident_memory_bytes, process_cpu_seconds_total...  the same (prometheus-client's process collector)

Definitions (:mod:`verispec.metrics`): a *draft* is one verification step that checked at least one
draft token; ``position`` counts from 0 and a step adds 1 at position ``i`` when its first ``i + 1``
draft tokens were all accepted. So acceptance rate = accepted / draft tokens and mean acceptance
length = 1 + accepted / drafts, computed from counter increases over any window. For token trees
the draft tokens are the tree's nodes, the accepted tokens its accepted path, and ``position`` the
depth along that path. The counters move
step by step, for every request, aborted ones included: over finished requests their increases
equal the sums of the ``spec`` objects of the answers.

Latencies are measured from the request's arrival at the server: time to first token; inter-token
latency, one observation per engine step that delivered tokens to a request (a speculative step may
deliver several tokens at once; that is the gap a streaming client sees); end-to-end latency at
the finish. ``finished_reason`` is ``stop``, ``length``, ``abort`` (client gone, or shutdown) or
``error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from verispec.engine.request import RequestOutput

__all__ = ["CONTENT_TYPE", "MetricsRecorder", "ServerMetrics"]

PREFIX = "verispec:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
STEP_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class ServerMetrics:
    """The metric objects of one app, in their own registry (thread-safe: the engine thread
    records, the event loop serves ``/metrics``)."""

    def __init__(
        self,
        model_name: str,
        *,
        target: str = "",
        draft: str = "",
        drafter: str = "none",
        lossless: bool = True,
        num_positions: int = 0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)  # process_resident_memory_bytes, CPU seconds, open fds
        self.registry = registry
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.num_drafts = Counter(
            f"{PREFIX}spec_decode_num_drafts", "Verification steps that checked at least one draft token.", m,
            registry=r,
        )  # fmt: skip
        self.num_draft_tokens = Counter(
            f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens proposed.", m, registry=r
        )
        self.num_accepted_tokens = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=r
        )
        self.accepted_per_pos = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Verification steps whose first position+1 draft tokens were all accepted.",
            [*m, "position"],
            registry=r,
        )
        self.num_free_drafts = Counter(
            f"{PREFIX}spec_decode_num_free_drafts", "Drafts that cost no model pass (a composite's lookup).", m,
            registry=r,
        )  # fmt: skip
        self.num_free_draft_tokens = Counter(
            f"{PREFIX}spec_decode_num_free_draft_tokens", "Draft tokens of the free drafts.", m, registry=r
        )
        self.num_free_accepted_tokens = Counter(
            f"{PREFIX}spec_decode_num_free_accepted_tokens", "Draft tokens of the free drafts accepted.", m,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Output tokens generated.", m, registry=r)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Finished requests by finish reason (stop, length, abort, error).",
            [*m, "finished_reason"], registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            f"{PREFIX}requests_rejected", "Requests refused before they ran (queue_full: 429, shutting_down: 503).",
            [*m, "reason"], registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Arrival to first output token.", m, buckets=TTFT_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Gap between successive token deliveries to one request.", m,
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Arrival to finish.", m, buckets=E2E_BUCKETS, registry=r
        )
        self.nodes_per_step = Histogram(
            f"{PREFIX}spec_decode_nodes_per_step", "Draft tokens (tree nodes) one verification step checked.", m,
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.accepted_depth = Histogram(
            f"{PREFIX}spec_decode_accepted_depth", "Draft tokens one verification step accepted (path depth).", m,
            buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests admitted, waiting for a slot.", m, registry=r)
        info = Gauge(
            f"{PREFIX}spec_decode_info", "The served pair (constant 1).",
            [*m, "target", "draft", "drafter", "lossless"], registry=r,
        )  # fmt: skip
        info.labels(model_name, target, draft, drafter, str(lossless).lower()).set(1)
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.num_free_drafts,
                       self.num_free_draft_tokens, self.num_free_accepted_tokens, self.prompt_tokens,
                       self.generation_tokens, self.running, self.waiting):  # fmt: skip
            metric.labels(model_name)  # exported at 0 from the start, so that rates work from the first scrape
        for pos in range(num_positions):
            self.accepted_per_pos.labels(model_name, str(pos))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()


@dataclass
class _Seen:
    """What the metrics already hold of one request."""

    arrival: float
    first: float | None = None
    last: float | None = None
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    free_drafts: int = 0  # (the drafts that cost no model pass, their tokens, their accepted tokens)
    free_draft_tokens: int = 0
    free_accepted: int = 0


class MetricsRecorder:
    """Turns the engine's outputs into metric updates (used by the engine thread only)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.name = metrics.model_name
        self._seen: dict[str, _Seen] = {}

    def added(self, request_id: str, arrival: float, prompt_tokens: int) -> None:
        self._seen[request_id] = _Seen(arrival)
        self.metrics.prompt_tokens.labels(self.name).inc(prompt_tokens)

    def output(self, out: RequestOutput, now: float) -> None:
        """One engine output (streamed or final) produced at ``now`` (``time.perf_counter``)."""
        seen = self._seen.get(out.request_id)
        if seen is None:
            return
        m, name = self.metrics, self.name
        if seen.first is None:
            seen.first = now
            m.ttft.labels(name).observe(now - seen.arrival)
        elif out.new_token_ids and seen.last is not None:
            m.itl.labels(name).observe(now - seen.last)
        if out.new_token_ids:
            seen.last = now
            m.generation_tokens.labels(name).inc(len(out.new_token_ids))
        self._spec(seen, out)
        if out.finished:
            self.finished(out.request_id, out.finish_reason or "stop", now)

    def _spec(self, seen: _Seen, out: RequestOutput) -> None:
        stats, m, name = out.stats, self.metrics, self.name
        if stats.num_drafts != seen.drafts:
            if stats.num_drafts == seen.drafts + 1:  # one step (an output per step per request)
                m.nodes_per_step.labels(name).observe(stats.num_draft_tokens - seen.draft_tokens)
                m.accepted_depth.labels(name).observe(stats.num_accepted_tokens - seen.accepted)
            m.num_drafts.labels(name).inc(stats.num_drafts - seen.drafts)
            m.num_draft_tokens.labels(name).inc(stats.num_draft_tokens - seen.draft_tokens)
            m.num_accepted_tokens.labels(name).inc(stats.num_accepted_tokens - seen.accepted)
            for pos, count in enumerate(stats.accepted_per_pos):
                before = seen.per_pos[pos] if pos < len(seen.per_pos) else 0
                if count != before:
                    m.accepted_per_pos.labels(name, str(pos)).inc(count - before)
            m.num_free_drafts.labels(name).inc(stats.num_free_drafts - seen.free_drafts)
            m.num_free_draft_tokens.labels(name).inc(stats.num_free_draft_tokens - seen.free_draft_tokens)
            m.num_free_accepted_tokens.labels(name).inc(stats.num_free_accepted_tokens - seen.free_accepted)
            seen.drafts, seen.draft_tokens = stats.num_drafts, stats.num_draft_tokens
            seen.accepted, seen.per_pos = stats.num_accepted_tokens, list(stats.accepted_per_pos)
            seen.free_drafts, seen.free_draft_tokens = stats.num_free_drafts, stats.num_free_draft_tokens
            seen.free_accepted = stats.num_free_accepted_tokens

    def finished(self, request_id: str, reason: str, now: float) -> None:
        """A request left the engine (finished, aborted or failed)."""
        seen = self._seen.pop(request_id, None)
        if seen is None:
            return
        self.metrics.e2e.labels(self.name).observe(now - seen.arrival)
        self.metrics.request_success.labels(self.name, reason).inc()

    def queue(self, running: int, waiting: int) -> None:
        self.metrics.running.labels(self.name).set(running)
        self.metrics.waiting.labels(self.name).set(waiting)
