"""Statistics of the measurement gate: percentiles, bootstrap and paired intervals, acceptance fits.

Acceptance (Leviathan et al. 2023, §3; vLLM's spec-decode counters, :mod:`verispec.metrics`): a
draft position ``i`` (from 0) is *reached* when the draft has a token there and positions
``0..i-1`` were accepted; it *passes* when it is accepted too. Under the i.i.d. model every reached
position passes with probability alpha, so the maximum-likelihood estimate is

    alpha = sum passed / sum reached = accepted / (accepted + rejections),

which uses the acceptance per position and nothing else. With engine step records (local runs)
reach counts are exact for any draft length; from counters (``accepted_per_pos``, ``drafts``)
they need a constant draft length K: reached[0] = drafts, reached[i] = accepted_per_pos[i - 1].

Intervals: a percentile bootstrap (Efron & Tibshirani 1993) over paired units (prompts, tokens)
for ratios and means; for the paired difference of two proportions (HumanEval pass@1 of the same
problems under two configurations) the Agresti–Min (2005) adjusted Wald interval, which stays
informative with few problems and no discordant pair (a bootstrap would collapse to [0, 0]).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation) or None for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else None


def describe(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99 (None for no values)."""
    return {
        "mean": float(np.mean(values)) if len(values) else None,
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
    }


def _z(confidence: float) -> float:
    return NormalDist().inv_cdf(0.5 + confidence / 2.0)


@dataclass(frozen=True)
class Interval:
    """A point estimate and its confidence interval."""

    value: float
    low: float
    high: float
    confidence: float
    method: str

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "low": self.low, "high": self.high, "confidence": self.confidence,
                "method": self.method}  # fmt: skip


def per_unit_ratios(values: Sequence[float], base: Sequence[float]) -> dict[str, float]:
    """``values[j] / base[j]`` unit by unit (one prompt under two configurations), summarised as
    their median and geometric mean (the mean on a ratio's own scale: 2x and 0.5x cancel). Every
    value must be positive."""
    ratios = [a / b for a, b in zip(values, base, strict=True)]
    return {"median_ratio": statistics.median(ratios), "geomean_ratio": statistics.geometric_mean(ratios)}


def paired_ratio_ci(
    num_a: Sequence[float],
    den_a: Sequence[float],
    num_b: Sequence[float],
    den_b: Sequence[float],
    *,
    resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """``(sum num_b / sum den_b) / (sum num_a / sum den_a)`` with a paired percentile bootstrap
    over the units (index ``j`` of every sequence belongs to one unit, e.g. one prompt). None when
    a sum is 0 or there are no units."""
    arrays = [np.asarray(x, dtype=np.float64) for x in (num_a, den_a, num_b, den_b)]
    n = len(arrays[0])
    if n == 0 or any(len(a) != n for a in arrays) or any(a.sum() <= 0 for a in arrays):
        return None
    na, da, nb, db = arrays
    point = float((nb.sum() / db.sum()) / (na.sum() / da.sum()))
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (nb[idx].sum(1) / db[idx].sum(1)) / (na[idx].sum(1) / da[idx].sum(1))
    ratios = ratios[np.isfinite(ratios)]
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    method = f"paired bootstrap over {n} units, {resamples} resamples"
    return Interval(point, float(low), float(high), confidence, method)


def mean_ci(
    values: Sequence[float], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> Interval | None:
    """The mean of ``values`` with a percentile bootstrap interval (None for no values)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    idx = np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(1)
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return Interval(float(x.mean()), float(low), float(high), confidence,
                    f"bootstrap over {x.size} units, {resamples} resamples")  # fmt: skip


def paired_proportion_diff(a: Sequence[bool], b: Sequence[bool], *, confidence: float = 0.95) -> Interval | None:
    """``mean(b) - mean(a)`` for paired binary outcomes, with the Agresti–Min adjusted Wald interval
    (add 0.5 to each cell of the 2x2 table), clipped to [-1, 1]. None for no pairs."""
    if not a or len(a) != len(b):
        return None
    n = len(a)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y and not x) + 0.5
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x and not y) + 0.5
    m = n + 2.0
    diff = (only_b - only_a) / m
    var = ((only_b + only_a) - (only_b - only_a) ** 2 / m) / m**2
    half = _z(confidence) * math.sqrt(max(var, 0.0))
    point = (sum(map(bool, b)) - sum(map(bool, a))) / n
    return Interval(point, max(-1.0, diff - half), min(1.0, diff + half), confidence, f"Agresti-Min, {n} pairs")


# ------------------------------------------------------------------------------------ acceptance
@dataclass(frozen=True)
class Acceptance:
    """Acceptance measured over some steps: the per-position conditional acceptance, the fitted
    alpha, and the draft length the fit assumes."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    reached: list[int]  # per position
    passed: list[int]  # per position (= accepted_per_pos)
    exact_reach: bool  # True: reach counted from step records; False: assumes a constant K
    num_free_drafts: int | None = None  # drafts that cost no model pass (a composite's lookup); None: not told

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def mean_k(self) -> float | None:
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else None

    @property
    def free_draft_share(self) -> float | None:
        """The share of drafts that cost no model pass (None when the source does not say)."""
        return self.num_free_drafts / self.num_drafts if self.num_drafts and self.num_free_drafts is not None else None

    @property
    def per_position(self) -> list[float]:
        """vLLM's acceptance per position: steps accepting the first i+1 tokens / steps."""
        return [p / self.num_drafts for p in self.passed] if self.num_drafts else []

    @property
    def conditional(self) -> list[float | None]:
        """P(position i accepted | reached)."""
        return [p / r if r else None for p, r in zip(self.passed, self.reached, strict=True)]

    @property
    def alpha(self) -> float | None:
        """Maximum-likelihood per-token acceptance of the i.i.d. model (see the module docstring)."""
        reached = sum(self.reached)
        return sum(self.passed) / reached if reached else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "mean_k": self.mean_k,
            "acceptance_per_position": self.per_position,
            "conditional_acceptance": self.conditional,
            "alpha": self.alpha,
            "reach_counted_exactly": self.exact_reach,
            "num_free_drafts": self.num_free_drafts,
            "free_draft_share": self.free_draft_share,
        }


def acceptance_from_steps(entries: Iterable[tuple[int, int] | tuple[int, int, bool]]) -> Acceptance:
    """From ``(draft tokens, accepted)`` pairs, one per request per engine step (exact reach), or
    ``(draft tokens, accepted, free)`` triples that also say which drafts cost no model pass."""
    drafts = drafted = accepted = free = 0
    told = False
    reached: list[int] = []
    passed: list[int] = []
    for d, a, *rest in entries:
        told = told or bool(rest)
        if d <= 0:
            continue
        drafts, drafted, accepted, free = drafts + 1, drafted + d, accepted + a, free + bool(rest and rest[0])
        if len(reached) < d:
            reached.extend([0] * (d - len(reached)))
            passed.extend([0] * (d - len(passed)))
        for i in range(min(a + 1, d)):
            reached[i] += 1
        for i in range(a):
            passed[i] += 1
    return Acceptance(drafts, drafted, accepted, reached, passed, True, free if told else None)


def acceptance_from_counts(
    num_drafts: float,
    num_draft_tokens: float,
    num_accepted: float,
    accepted_per_pos: Sequence[float],
    num_free_drafts: float | None = None,
) -> Acceptance:
    """From vLLM-style counters; reach assumes every draft had ``len(accepted_per_pos)`` tokens
    (exact for a fixed K). Trailing positions no draft reached are dropped when the mean draft
    length shows they were never drafted. ``num_free_drafts``: verispec's count of drafts that cost
    no model pass, where the source has it."""
    per_pos = [round(x) for x in accepted_per_pos]
    drafts = round(num_drafts)
    if drafts and num_draft_tokens:
        k = max(1, math.ceil(num_draft_tokens / drafts - 1e-9))
        per_pos = per_pos[:k] if len(per_pos) > k and not any(per_pos[k:]) else per_pos
    reached = [drafts, *per_pos[:-1]] if per_pos else []
    free = round(num_free_drafts) if num_free_drafts is not None else None
    return Acceptance(drafts, round(num_draft_tokens), round(num_accepted), reached, per_pos, False, free)


def acceptance_from_spec_objects(specs: Iterable[dict[str, Any]]) -> tuple[Acceptance, dict[str, Any]]:
    """Token-weighted acceptance (pooled counts) from per-response ``spec`` objects, and the
    per-request view (means over requests that drafted of their own AR, AL and per-position)."""
    drafts = drafted = accepted = free = 0.0
    told = False  # a spec object said how many of its drafts were free (verispec's)
    per_pos: list[float] = []
    rates, lengths, positions = [], [], []
    for s in specs:
        d, t, a = float(s.get("drafts", 0) or 0), float(s.get("drafted", 0) or 0), float(s.get("accepted", 0) or 0)
        free += float(s.get("free_drafts", 0) or 0)  # verispec's composite: drafts that cost no model pass
        told = told or "free_drafts" in s
        pp = [float(x) for x in s.get("accepted_per_pos", []) or []]
        drafts, drafted, accepted = drafts + d, drafted + t, accepted + a
        if len(per_pos) < len(pp):
            per_pos.extend([0.0] * (len(pp) - len(per_pos)))
        for i, x in enumerate(pp):
            per_pos[i] += x
        if t > 0 and d > 0:
            rates.append(a / t)
            lengths.append(1.0 + a / d)
            positions.append([x / d for x in pp])
    width = max((len(p) for p in positions), default=0)
    per_request = {
        "num_requests": len(rates),
        "acceptance_rate": float(np.mean(rates)) if rates else None,
        "mean_acceptance_length": float(np.mean(lengths)) if lengths else None,
        "acceptance_per_position": [
            float(np.mean([p[i] if i < len(p) else 0.0 for p in positions])) for i in range(width)
        ],
        "free_draft_share": free / drafts if drafts else None,
    }
    return acceptance_from_counts(drafts, drafted, accepted, per_pos, free if told else None), per_request
