"""Two-sample tests of output laws: were two samplers' outputs drawn from one law?

Where the exact law cannot be enumerated (a real model, an engine behind an API), losslessness is
tested by sampling: N continuations of a prompt from plain decoding (arm A) and N from speculative
decoding (arm B), same sampling parameters, independent seeds, and a test of whether the two
empirical laws of the first n tokens differ.

- :func:`two_sample_test`: Pearson's chi-square test of homogeneity on the 2 x K table of outcome
  counts, outcomes whose expected count under the null is below 5 in either arm pooled into one
  cell (merged into the smallest other cell if the pool stays below it); when the pooled table is
  still too sparse for the chi-square approximation (fewer than 2 cells with 5 expected, or under
  100 samples), a permutation test of the same statistic (``rounds`` relabellings, seeded).
- The estimated total variation distance between the arms over the test's pooled outcomes (a
  lower bound of the TV over all outcomes; over sparse outcomes a plug-in estimate mostly measures
  sampling noise), with a basic (bias-corrected) bootstrap interval, and the **detectable TV**
  (:func:`detectable_tv`): the smallest TV the test would detect with power 0.8 at its level and
  N, for a shift of mass between the two likeliest outcomes (noncentral chi-square power). A pass
  bounds the difference at that level; it says nothing about differences smaller.
- :func:`independence_p`: whether one arm's samples, in the order drawn, look independent (runs
  of identical outcomes void the test's assumption).
- :func:`combine`: one decision over prompts, by Holm's step-down adjustment (the family-wise
  p-value: controls the chance of any false alarm) or Fisher's method (more power when every
  prompt differs a little).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from verispec.errors import ConfigError

MIN_EXPECTED = 5.0
#: Below this many samples in all, the permutation test replaces the chi-square approximation.
MIN_ASYMPTOTIC = 100
POWER = 0.8


@dataclass(frozen=True)
class TwoSampleResult:
    statistic: float
    dof: int
    p_value: float
    method: str  # "chi-square" or "permutation"
    n_a: int
    n_b: int
    cells: int  # after pooling
    tv: float  # plug-in TV between the arms' empirical laws over the pooled outcomes
    tv_interval: tuple[float, float]  # basic bootstrap 95% interval of it
    detectable_tv: float  # smallest TV detected with POWER at ``alpha`` (see detectable_tv)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__) | {"tv_interval": list(self.tv_interval)}


def table(a: Sequence[Hashable], b: Sequence[Hashable]) -> tuple[list[Hashable], np.ndarray]:
    """Outcomes (most frequent first) and their counts ``[2, K]`` in arms ``a`` and ``b``."""
    ca, cb = Counter(a), Counter(b)
    outcomes = sorted(set(ca) | set(cb), key=lambda o: (-(ca[o] + cb[o]), repr(o)))
    return outcomes, np.array([[ca[o] for o in outcomes], [cb[o] for o in outcomes]], dtype=np.float64)


def pool(counts: np.ndarray, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """``[2, K]`` counts with the sparse outcomes pooled (see the module docstring) -> ``[2, K']``."""
    totals = counts.sum(axis=1, keepdims=True)  # [2, 1]
    share = counts.sum(axis=0) / counts.sum()  # [K]
    expected = totals * share  # [2, K] under the null
    small = (expected < min_expected).any(axis=0)
    kept = counts[:, ~small]
    rest = counts[:, small].sum(axis=1, keepdims=True)
    if rest.sum() == 0:
        return kept
    rest_expected = totals * (rest.sum() / counts.sum())
    if (rest_expected < min_expected).any() and kept.shape[1] > 0:
        j = int(np.argmin(kept.sum(axis=0)))
        kept = kept.copy()
        kept[:, j : j + 1] += rest
        return kept
    return np.concatenate([kept, rest], axis=1)


def _chi_square(counts: np.ndarray) -> float:
    """Pearson's statistic of homogeneity of a ``[2, K]`` table (0 for K < 2)."""
    if counts.shape[1] < 2:
        return 0.0
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, (counts - expected) ** 2 / expected, 0.0)
    return float(terms.sum())


def _tv(counts: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts[0] / counts[0].sum() - counts[1] / counts[1].sum()).sum())


def detectable_tv(share: np.ndarray, n_a: int, n_b: int, dof: int, alpha: float, power: float = POWER) -> float:
    """The smallest TV ``d`` that the chi-square test (``dof``, level ``alpha``) detects with
    ``power`` when arm B moves mass ``d`` from the likeliest outcome to the second likeliest of
    the pooled law ``share`` (``[K]``, summing to 1): the most favourable single shift, so the bound
    the run can honestly claim is at least this. Noncentrality ``n_a n_b / (n_a + n_b) x
    sum (p - q)^2 / m``, ``m`` the mixture the null estimates. Returns 1.0 when even the largest
    possible shift is not detected (or there is one outcome)."""
    p = np.sort(np.asarray(share, dtype=np.float64))[::-1]
    if len(p) < 2 or dof < 1:
        return 1.0
    scale = n_a * n_b / (n_a + n_b)

    def noncentrality(d: float) -> float:
        q = p.copy()
        q[0] -= d
        q[1] += d
        m = (n_a * p + n_b * q) / (n_a + n_b)
        return scale * float(((p - q) ** 2 / np.where(m > 0, m, 1.0)).sum())

    return smallest_detected(noncentrality, float(p[0]), dof, alpha, power)


def smallest_detected(
    noncentrality: Callable[[float], float], high: float, dof: int, alpha: float, power: float = POWER
) -> float:
    """The smallest shift ``d`` in ``(0, high]`` whose chi-square noncentrality makes a ``dof``
    test at level ``alpha`` reject with ``power`` (bisection; power grows with ``d``); 1.0 when
    even ``high`` is not detected."""
    critical = float(stats.chi2.isf(alpha, dof))

    def detected(d: float) -> bool:
        return float(stats.ncx2.sf(critical, dof, noncentrality(d))) >= power

    if not detected(high):
        return 1.0
    low = 0.0
    for _ in range(40):
        mid = 0.5 * (low + high)
        low, high = (low, mid) if detected(mid) else (mid, high)
    return high


def two_sample_test(
    a: Sequence[Hashable],
    b: Sequence[Hashable],
    *,
    alpha: float = 0.01,
    rounds: int = 2000,
    bootstrap: int = 500,
    seed: int = 0,
) -> TwoSampleResult:
    """Test whether outcomes ``a`` and ``b`` (any hashable: token-id tuples, texts) come from one
    law (see the module docstring); ``alpha`` sizes the detectable TV."""
    if len(a) == 0 or len(b) == 0:
        raise ConfigError("a two-sample test needs outcomes in both arms")
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}")
    rng = np.random.default_rng(seed)
    _, counts = table(a, b)
    pooled = pool(counts)
    statistic = _chi_square(pooled)
    dof = max(pooled.shape[1] - 1, 0)
    n_a, n_b = len(a), len(b)
    if dof == 0:
        p_value, method = 1.0, "chi-square"
    elif (pooled.sum(axis=0) >= MIN_EXPECTED).sum() >= 2 and n_a + n_b >= MIN_ASYMPTOTIC:
        p_value, method = float(stats.chi2.sf(statistic, dof)), "chi-square"
    else:
        p_value, method = _permutation(counts, statistic, rounds, rng), "permutation"
    tv = _tv(pooled)
    draws = [
        _tv(np.stack([rng.multinomial(n_a, pooled[0] / n_a), rng.multinomial(n_b, pooled[1] / n_b)]).astype(float))
        for _ in range(bootstrap)
    ]
    interval = basic_interval(tv, draws)
    share = pooled.sum(axis=0) / pooled.sum()
    return TwoSampleResult(
        statistic, dof, p_value, method, n_a, n_b, pooled.shape[1], tv, interval,
        detectable_tv(share, n_a, n_b, dof, alpha),
    )  # fmt: skip


def basic_interval(estimate: float, draws: Sequence[float]) -> tuple[float, float]:
    """The basic (bias-corrected) bootstrap 95% interval of a TV ``estimate`` from its bootstrap
    ``draws`` (``2 estimate - quantile``), clipped at 0; NaNs without draws."""
    if not draws:
        return (math.nan, math.nan)
    low, high = np.quantile(draws, [0.025, 0.975])
    return (max(0.0, 2 * estimate - float(high)), max(0.0, 2 * estimate - float(low)))


def _permutation(counts: np.ndarray, observed: float, rounds: int, rng: np.random.Generator) -> float:
    """Monte Carlo permutation p-value of the pooled chi-square statistic: arm labels reshuffled
    ``rounds`` times ((hits + 1) / (rounds + 1), never 0)."""
    labels = np.repeat(np.arange(counts.shape[1]), counts.sum(axis=0).astype(int))  # outcome per sample
    n_a = int(counts[0].sum())
    hits = 0
    for _ in range(rounds):
        rng.shuffle(labels)
        first = np.bincount(labels[:n_a], minlength=counts.shape[1])
        second = np.bincount(labels[n_a:], minlength=counts.shape[1])
        shuffled = pool(np.stack([first, second]).astype(np.float64))
        hits += _chi_square(shuffled) >= observed - 1e-12
    return (hits + 1) / (rounds + 1)


def combine(p_values: Sequence[float], method: str = "holm") -> float:
    """One p-value for the family: Holm's adjusted minimum (``holm``) or Fisher's method (``fisher``)."""
    ps = np.clip(np.asarray(p_values, dtype=np.float64), 0.0, 1.0)
    if len(ps) == 0:
        raise ConfigError("no p-values to combine")
    if method == "holm":
        order = np.sort(ps)
        adjusted = np.maximum.accumulate(order * (len(ps) - np.arange(len(ps))))
        return float(min(1.0, adjusted[0]))
    if method == "fisher":
        return float(stats.combine_pvalues(np.maximum(ps, 1e-300), method="fisher").pvalue)
    raise ConfigError(f"combine method must be holm or fisher, got {method!r}")


def independence_p(samples: Sequence[Hashable], rounds: int = 500, seed: int = 0) -> float:
    """Do the samples, in the order drawn, look independent? The number of neighbours that are the
    same outcome, against the same count after random reorderings (exact under independence,
    which makes the order exchangeable): a one-sided permutation p-value, small when identical
    outcomes come in runs, as when a server draws several continuations from one seed. Beyond
    every reordering, the normal tail of the reorderings' counts (so that p-values below
    ``1 / rounds`` can be told apart)."""
    index: dict[Hashable, int] = {}
    codes = np.array([index.setdefault(s, len(index)) for s in samples], dtype=np.int64)
    if len(codes) < 3:
        return 1.0
    observed = int((codes[1:] == codes[:-1]).sum())
    rng = np.random.default_rng(seed)
    draws = np.array([int((p[1:] == p[:-1]).sum()) for p in (rng.permutation(codes) for _ in range(rounds))])
    hits = int((draws >= observed).sum())
    if hits == 0 and draws.std() > 0:
        return float(min(1.0 / (rounds + 1), stats.norm.sf((observed - draws.mean()) / draws.std())))
    return (hits + 1) / (rounds + 1)
