"""Speculation figures from a server's Prometheus ``/metrics``, for verispec, vLLM and SGLang.

Three naming schemes are read (counters with or without the ``_total`` suffix, every label set
summed):

- verispec: ``verispec:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``,
  ``..._num_accepted_tokens_per_pos{position}`` (vLLM's definitions, :mod:`verispec.metrics`), and
  ``..._num_free_drafts``: the drafts that cost no model pass (a composite's lookup);
- vLLM (v1 engine): the same names under ``vllm:``;
- SGLang: the gauges ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate``, which SGLang
  computes over a recent window (not counters: the value *after* a run is reported as it is).

Counters are compared before and after a run: acceptance rate = delta accepted / delta draft
tokens, mean acceptance length = 1 + delta accepted / delta drafts, acceptance per position =
delta per-position / delta drafts. The deltas hold every request the server ran in between,
other clients' included. Memory and preemption figures come along when a server exports them
(``process_resident_memory_bytes``, ``vllm:num_preemptions``, ``vllm:kv_cache_usage_perc``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SCHEMES = ("verispec", "vllm")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition; lines that do not parse are skipped (a scrape is a
    best-effort side channel: one odd line must not lose the others)."""
    out: list[Sample] = []
    for raw_line in text.splitlines():
        line = raw_line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        out.append(Sample(name, dict(_LABEL.findall(labels or "")), value))
    return out


@dataclass
class MetricsSnapshot:
    """One scrape: counter sums by metric name (``_total`` stripped) and per position."""

    values: dict[str, float] = field(default_factory=dict)
    per_pos: dict[str, dict[int, float]] = field(default_factory=dict)  # name -> position -> value

    @classmethod
    def from_text(cls, text: str) -> MetricsSnapshot:
        snap = cls()
        for s in parse_prometheus(text):
            if s.name.endswith("_created") or math.isnan(s.value):
                continue
            name = s.name.removesuffix("_total")
            if "position" in s.labels:
                try:
                    pos = int(s.labels["position"])
                except ValueError:
                    continue
                table = snap.per_pos.setdefault(name, {})
                table[pos] = table.get(pos, 0.0) + s.value
            else:
                snap.values[name] = snap.values.get(name, 0.0) + s.value
        return snap

    def get(self, name: str) -> float | None:
        return self.values.get(name)


def _delta(before: MetricsSnapshot | None, after: MetricsSnapshot, name: str) -> float | None:
    end = after.get(name)
    if end is None:
        return None
    start = before.get(name) if before is not None else None
    return end - (start or 0.0)


def spec_from_metrics(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, Any] | None:
    """Speculation over the window between two scrapes, or None when the server exports none.

    The result names its ``source`` ("verispec", "vllm" or "sglang") and holds ``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``, ``acceptance_rate``, ``mean_acceptance_length``
    and ``acceptance_per_position`` (counters), or ``accept_length_gauge`` / ``accept_rate_gauge``
    (SGLang's windowed gauges). Fields the server does not export are None.
    """
    if after is None:
        return None
    for scheme in SCHEMES:
        prefix = f"{scheme}:spec_decode_"
        drafts = _delta(before, after, prefix + "num_drafts")
        drafted = _delta(before, after, prefix + "num_draft_tokens")
        accepted = _delta(before, after, prefix + "num_accepted_tokens")
        free = _delta(before, after, prefix + "num_free_drafts")  # verispec's alone: drafts no model pass paid for
        if drafted is None or accepted is None:
            continue
        pos_after = after.per_pos.get(prefix + "num_accepted_tokens_per_pos", {})
        pos_before = before.per_pos.get(prefix + "num_accepted_tokens_per_pos", {}) if before else {}
        per_pos_counts = [pos_after[p] - pos_before.get(p, 0.0) for p in sorted(pos_after)]
        return {
            "source": scheme,
            "num_drafts": drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos_counts,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "acceptance_per_position": [c / drafts for c in per_pos_counts] if drafts else [],
            "mean_draft_length": drafted / drafts if drafts else None,
            "num_free_drafts": free,
            "free_draft_share": free / drafts if drafts and free is not None else None,
        }
    length, rate = after.get("sglang:spec_accept_length"), after.get("sglang:spec_accept_rate")
    if length is not None or rate is not None:
        return {
            "source": "sglang",
            "num_drafts": None,
            "num_draft_tokens": None,
            "num_accepted_tokens": None,
            "accepted_per_pos": [],
            "acceptance_rate": None,
            "mean_acceptance_length": None,
            "acceptance_per_position": [],
            "mean_draft_length": None,
            "accept_length_gauge": length,
            "accept_rate_gauge": rate,
            "note": "SGLang's gauges are averages over its own recent window, read after the run",
        }
    return None


def server_from_metrics(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict[str, Any]:
    """Memory and scheduling figures a server may export: resident memory after the run, vLLM's
    preemptions during it and its KV-cache usage after it (None where not exported)."""
    if after is None:
        return {}
    preempt = _delta(before, after, "vllm:num_preemptions")
    kv = after.get("vllm:kv_cache_usage_perc")
    if kv is None:
        kv = after.get("vllm:gpu_cache_usage_perc")
    return {
        "process_resident_memory_bytes": after.get("process_resident_memory_bytes"),
        "preemptions": preempt,
        "kv_cache_usage": kv,
        "sglang_token_usage": after.get("sglang:token_usage"),
    }
