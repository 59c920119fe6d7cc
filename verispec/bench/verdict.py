"""GO / NO-GO per load level: the seed's deployment rule, applied to measurements.

Speculation is worth deploying at a level when all three hold:

1. acceptance pays for the draft: the measured per-token acceptance ``alpha`` (the maximum-likelihood
   fit to the acceptance per position, :mod:`verispec.bench.stats`) exceeds ``a_min``, the alpha at
   which the single-request model breaks even, ``S(a_min, K, c) = 1`` (Leviathan et al. 2023;
   :func:`verispec.analysis.alpha_min`), with K the draft length used and c the measured draft cost
   ratio at that level. Equivalently ``c < c_break(alpha, K)``. (The seed writes "AR > a_min"; AR =
   accepted / drafted is not alpha, see :mod:`verispec.analysis`, so alpha is compared.) When
   ``c > 1`` no acceptance pays for the draft.
2. no throughput regression beyond noise: the speculative/baseline output-token throughput ratio
   fails when its whole confidence interval lies below 1; a ratio below 1 whose interval still
   reaches 1 shows no gain, which cannot justify a GO (INCONCLUSIVE).
3. quality within noise: HumanEval pass@1 fails only when the interval of the paired difference lies
   wholly below 0; perplexity fails only when the interval of the mean NLL delta lies wholly above 0
   AND the perplexity ratio exceeds the practical margin (numerics may shift it by a hair, reliably).

Any failed criterion gives NO-GO. With none failed, a criterion that could not be evaluated
(no drafts at that level, c unknown, no quality measurement) gives INCONCLUSIVE, never GO.
Latency changes (TTFT, ITL) are reported as notes: the seed asks for ITL improvement at the target
concurrency and no TTFT regression, which the reader weighs against their SLA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from verispec.analysis import alpha_min, break_even_c, speedup
from verispec.bench.stats import Interval

Status = Literal["pass", "fail", "unknown"]
GO, NO_GO, INCONCLUSIVE = "GO", "NO-GO", "INCONCLUSIVE"


@dataclass
class LevelMeasurement:
    """What the verdict of one level needs (all optional: missing = not measured)."""

    label: str
    alpha: float | None = None
    k: int | None = None
    c: float | None = None
    c_source: str = "unknown"
    throughput_ratio: Interval | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class QualityMeasurement:
    pass_at_1_diff: Interval | None = None
    pass_at_1_problems: int = 0
    delta_nll: Interval | None = None  # mean NLL, spec - baseline (nats per token)
    ppl_margin: float = 0.01
    lossless: bool | None = True
    law: dict[str, Any] | None = None  # the output-law test's report (DeploymentReport.to_dict)
    skipped: list[str] = field(default_factory=list)


@dataclass
class Criterion:
    name: str
    status: Status
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "reason": self.reason}


@dataclass
class Verdict:
    label: str
    verdict: str
    criteria: list[Criterion]
    notes: list[str]

    @property
    def reasons(self) -> list[str]:
        """The reasons that decided the verdict (the failures; else the unknowns; else all)."""
        for status in ("fail", "unknown"):
            picked = [c.reason for c in self.criteria if c.status == status]
            if picked:
                return picked
        return [c.reason for c in self.criteria]

    def as_dict(self) -> dict[str, Any]:
        return {"level": self.label, "verdict": self.verdict, "reasons": self.reasons,
                "criteria": [c.as_dict() for c in self.criteria], "notes": self.notes}  # fmt: skip


def acceptance_criterion(m: LevelMeasurement) -> Criterion:
    name = "acceptance"
    if m.k is None or m.k < 1 or m.alpha is None:
        return Criterion(name, "unknown", "no draft tokens were verified at this level: acceptance not measured")
    if m.c is None:
        why = f"alpha = {m.alpha:.3f} but c is unknown ({m.c_source}): a_min cannot be computed"
        return Criterion(name, "unknown", why)
    a_min = alpha_min(m.k, m.c)
    c_text = f"K = {m.k}, c = {m.c:.3f} ({m.c_source})"
    if a_min is None:
        return Criterion(name, "fail", f"draft too slow: {c_text}; with c > 1 no acceptance rate breaks even")
    s = speedup(min(max(m.alpha, 0.0), 1.0), m.k, m.c)
    c_break = break_even_c(min(max(m.alpha, 0.0), 1.0), m.k)
    detail = f"{c_text}; model speedup S(alpha, K, c) = {s:.2f}, c_break = {c_break:.3f}"
    if m.alpha > a_min:
        return Criterion(name, "pass", f"alpha = {m.alpha:.3f} > a_min = {a_min:.3f} ({detail})")
    return Criterion(name, "fail", f"acceptance below a_min: alpha = {m.alpha:.3f} <= a_min = {a_min:.3f} ({detail})")


def throughput_criterion(m: LevelMeasurement) -> Criterion:
    name = "throughput"
    r = m.throughput_ratio
    if r is None:
        return Criterion(name, "unknown", "throughput ratio not measured (no completed request pairs)")
    ci = f"{100 * r.confidence:.0f}% CI {r.low:.2f}-{r.high:.2f}"
    if r.high < 1.0:
        return Criterion(name, "fail", f"throughput regression beyond noise: {r.value:.2f}x baseline ({ci})")
    if r.value < 1.0:  # neither a regression nor a gain: nothing says that speculation pays here
        return Criterion(name, "unknown", f"no measured gain: throughput {r.value:.2f}x baseline, within noise ({ci})")
    return Criterion(name, "pass", f"throughput {r.value:.2f}x baseline ({ci})")


def quality_criterion(q: QualityMeasurement) -> Criterion:
    name = "quality"
    fails: list[str] = []
    passes: list[str] = []
    if q.pass_at_1_diff is not None:
        d = q.pass_at_1_diff
        text = (f"HumanEval pass@1 delta {d.value:+.2f} over {q.pass_at_1_problems} problems "
                f"({100 * d.confidence:.0f}% CI {d.low:+.2f} to {d.high:+.2f})")  # fmt: skip
        (fails if d.high < 0.0 else passes).append(text + (", below zero" if d.high < 0.0 else ", within noise"))
    if q.delta_nll is not None:
        d = q.delta_nll
        ratio = math.exp(d.value)
        text = (f"perplexity ratio {ratio:.4f} (delta NLL {d.value:+.2e} nats/token, "
                f"{100 * d.confidence:.0f}% CI {d.low:+.2e} to {d.high:+.2e})")  # fmt: skip
        worse = d.low > 0.0 and ratio - 1.0 > q.ppl_margin
        margin = f", worse beyond noise and beyond the {100 * q.ppl_margin:g}% margin"
        (fails if worse else passes).append(text + (margin if worse else ", within noise"))
    if q.law is not None:
        law = q.law
        text = (f"output law p = {law['p_value']:.3g} over {len(law['prompts'])} prompts "
                f"({law['samples_per_arm']} samples per arm, first {law['tokens']} tokens; "
                f"detectable TV {law['detectable_tv']:.3f})")  # fmt: skip
        changed = law["p_value"] < law["alpha"]
        (fails if changed else passes).append(
            text + (", the laws differ" if changed else ", unchanged at that resolution")
        )
    if fails:
        return Criterion(name, "fail", "quality regression: " + "; ".join(fails))
    if not passes:
        why = "; ".join(q.skipped) if q.skipped else "no quality measurement"
        return Criterion(name, "unknown", f"quality not measured ({why})")
    return Criterion(name, "pass", "; ".join(passes))


def decide(m: LevelMeasurement, q: QualityMeasurement) -> Verdict:
    """The verdict of one level with the criterion that decided it."""
    criteria = [acceptance_criterion(m), throughput_criterion(m), quality_criterion(q)]
    notes = list(m.notes)
    if q.lossless is False:
        notes.append("LOSSY acceptance rule: outputs do not follow the target's distribution")
    if any(c.status == "fail" for c in criteria):
        verdict = NO_GO
    elif any(c.status == "unknown" for c in criteria):
        verdict = INCONCLUSIVE
    else:
        verdict = GO
    return Verdict(m.label, verdict, criteria, notes)
