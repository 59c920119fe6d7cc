"""Spec-on vs spec-off, measured side by side on the same runtime.

Every prompt is generated twice by the same target model, once by plain decoding and once with
speculation, in alternating order (plain first for even prompts, speculative first for odd ones)
so that drift in the machine's speed hits both alike. Speed is the decode rate, output tokens after
the first divided by the time after the first (prefill is the same in both modes). Per set we
report the speedup (ratio of total decode rates, and the median of per-prompt ratios), the
acceptance rate and length, the acceptance per position, the measured draft cost ratio c, and the
single-request model's prediction S(alpha, K, c) next to the measurement
(Leviathan et al. 2023; :mod:`verispec.analysis`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verispec.analysis import speedup
from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.metrics import SpecStats


@dataclass
class Run:
    """One generation of one prompt in one mode."""

    mode: str  # "plain" | "spec"
    tokens: list[int]
    decode_seconds: float
    ttft_seconds: float
    stats: SpecStats
    draft_pass_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)

    @property
    def decode_rate(self) -> float | None:
        n = len(self.tokens) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else None


def run_once(engine: Engine, prompt: str, params: SamplingParams, mode: str) -> Run:
    before = len(engine.steps)
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    end = time.perf_counter()
    ttft = out.timings.get("ttft_s") or 0.0
    steps = list(engine.steps)[before:]
    return Run(
        mode=mode,
        tokens=out.token_ids,
        decode_seconds=max(end - start - ttft, 0.0),
        ttft_seconds=ttft,
        stats=out.stats,
        draft_pass_seconds=[s.draft_seconds / s.passes for s in steps if s.passes > 0],
        verify_seconds=[s.verify_seconds for s in steps if s.num_passes > 0],
    )


@dataclass
class SetReport:
    name: str
    num_prompts: int
    speedup: float | None  # total decode rate, spec / plain
    median_speedup: float | None
    plain_tokens_per_s: float | None
    spec_tokens_per_s: float | None
    stats: SpecStats
    measured_c: float | None
    alpha: float | None
    mean_k: float
    predicted_speedup: float | None
    greedy_equal: float | None  # fraction of prompts with identical plain/spec tokens (greedy only)

    def as_dict(self) -> dict[str, Any]:
        return {
            "set": self.name,
            "num_prompts": self.num_prompts,
            "speedup": self.speedup,
            "median_speedup": self.median_speedup,
            "plain_tokens_per_s": self.plain_tokens_per_s,
            "spec_tokens_per_s": self.spec_tokens_per_s,
            "acceptance_rate": self.stats.acceptance_rate,
            "mean_acceptance_length": self.stats.mean_acceptance_length,
            "acceptance_per_position": self.stats.acceptance_per_position,
            "draft_tokens_per_step": self.stats.num_draft_tokens / self.stats.num_drafts
            if self.stats.num_drafts
            else 0.0,
            "positional_acceptance": self.stats.positional_acceptance,
            # drafts that cost no model pass (a composite's lookup): their share and their acceptance rate
            "free_draft_share": self.stats.num_free_drafts / self.stats.num_drafts if self.stats.num_drafts else 0.0,
            "free_acceptance_rate": (
                self.stats.num_free_accepted_tokens / self.stats.num_free_draft_tokens
                if self.stats.num_free_draft_tokens
                else None
            ),
            "measured_c": self.measured_c,
            "alpha": self.alpha,
            "mean_k": self.mean_k,
            "predicted_speedup": self.predicted_speedup,
            "measured_over_predicted": (
                self.speedup / self.predicted_speedup if self.speedup and self.predicted_speedup else None
            ),
            "greedy_equal": self.greedy_equal,
        }


def bench_set(
    name: str,
    prompts: Sequence[str],
    plain: Engine,
    spec: Engine,
    params: SamplingParams,
    on_prompt: Callable[[int], None] | None = None,
) -> tuple[SetReport, list[tuple[Run, Run]]]:
    """Run every prompt in both modes, alternating the order; return the set's report and runs."""
    pairs: list[tuple[Run, Run]] = []
    for i, prompt in enumerate(prompts):
        if i % 2 == 0:
            p = run_once(plain, prompt, params, "plain")
            s = run_once(spec, prompt, params, "spec")
        else:
            s = run_once(spec, prompt, params, "spec")
            p = run_once(plain, prompt, params, "plain")
        pairs.append((p, s))
        if on_prompt is not None:
            on_prompt(i)
    return summarize_set(name, pairs, params), pairs


def summarize_set(name: str, pairs: Sequence[tuple[Run, Run]], params: SamplingParams) -> SetReport:
    stats = SpecStats()
    for _, s in pairs:
        stats = stats.merge(s.stats)
    plain_tokens = sum(len(p.tokens) - 1 for p, _ in pairs)
    spec_tokens = sum(len(s.tokens) - 1 for _, s in pairs)
    plain_time = sum(p.decode_seconds for p, _ in pairs)
    spec_time = sum(s.decode_seconds for _, s in pairs)
    plain_rate = plain_tokens / plain_time if plain_time > 0 else None
    spec_rate = spec_tokens / spec_time if spec_time > 0 else None
    ratios = [s.decode_rate / p.decode_rate for p, s in pairs if p.decode_rate and s.decode_rate]
    draft_pass = [x for _, s in pairs for x in s.draft_pass_seconds]
    verify = [x for _, s in pairs for x in s.verify_seconds]
    c = statistics.median(draft_pass) / statistics.median(verify) if draft_pass and verify else None
    alpha = stats.alpha
    mean_k = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    k = round(mean_k)
    predicted = speedup(min(alpha, 1.0), k, c) if alpha is not None and c is not None and k >= 1 else None
    equal = None
    if params.greedy and pairs:
        equal = sum(p.tokens == s.tokens for p, s in pairs) / len(pairs)
    return SetReport(
        name=name,
        num_prompts=len(pairs),
        speedup=spec_rate / plain_rate if spec_rate and plain_rate else None,
        median_speedup=statistics.median(ratios) if ratios else None,
        plain_tokens_per_s=plain_rate,
        spec_tokens_per_s=spec_rate,
        stats=stats,
        measured_c=c,
        alpha=alpha,
        mean_k=mean_k,
        predicted_speedup=predicted,
        greedy_equal=equal,
    )


def plot_acceptance(reports: Sequence[SetReport], path: Path) -> Path:
    """A PNG of the acceptance per position of each set (written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verispec.formats.files import atomic_path

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(reports), 1)
    for j, report in enumerate(reports):
        per_pos = report.stats.acceptance_per_position
        xs = [i + 1 + (j - (len(reports) - 1) / 2) * width for i in range(len(per_pos))]
        label = f"{report.name} (AL {report.stats.mean_acceptance_length:.2f})"
        ax.bar(xs, per_pos, width=width, label=label)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of steps accepting it")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance per position (vLLM definition)")
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
    return path
