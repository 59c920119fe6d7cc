"""Goodness of fit of speculative samples against the baseline's own probabilities.

Where the baseline can *score* a continuation (a local target, teacher forced; an endpoint that
returns prompt logprobs with ``echo``), the speculative arm's samples can be tested against the
baseline's probabilities instead of against a second sample: the baseline adds no sampling noise,
so the same N detects a smaller difference (for a shift between two cells the noncentrality is
about twice the two-sample test's at equal N per arm) and the baseline draws nothing.

- The cells are chosen before the test sees its data: the distinct outcomes of a separate pilot
  sample from the speculative arm, each scored by the baseline (``P(outcome)`` exactly, the law of
  the first ``tokens`` tokens; an outcome cut short by the end of sequence has the probability of
  its tokens and then a stop), plus one cell for everything else (``1 - sum``, which also holds
  any outcome the baseline cannot score). Cells whose
  expected count is below 5 are pooled into the rest, which is merged into the smallest kept cell
  when it stays below 5 too.
- Pearson's chi-square goodness-of-fit statistic on the test sample's counts, ``cells - 1``
  degrees of freedom; the TV between the observed and the scored law over those cells with a basic
  bootstrap interval; and the detectable TV at ``alpha`` and power 0.8 (noncentrality
  ``N sum (q - p)^2 / p``), as in :mod:`verispec.certify.twosample`.

The scores must be those of the sampling law (temperature, truncation and penalties applied):
local scorers apply them; endpoints return the model's raw logprobs, so the endpoint scorer only
runs at temperature 1 without truncation or penalties.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from scipy import stats

from verispec.certify.twosample import MIN_EXPECTED, POWER, TwoSampleResult, basic_interval, smallest_detected
from verispec.errors import ConfigError

H = TypeVar("H", bound=Hashable)

#: Scores may exceed 1 in sum by this much (rounding of logprobs summed over a few tokens).
SUM_TOLERANCE = 1e-3


def fit_cells(pilot: Sequence[H]) -> list[H]:
    """The test's cells: the pilot's distinct outcomes, most frequent first."""
    counts = Counter(pilot)
    return sorted(counts, key=lambda o: (-counts[o], repr(o)))


def fit_test(
    sample: Sequence[Hashable],
    probability: Mapping[Hashable, float | None],
    *,
    alpha: float = 0.01,
    bootstrap: int = 500,
    seed: int = 0,
) -> TwoSampleResult:
    """Test whether ``sample`` follows the law that gives each cell of ``probability`` (outcome ->
    its probability under the baseline; outcomes not in it, or scored None because the baseline
    could not score them, fall into the rest). The result's ``n_a`` is 0: the baseline scored, it
    drew nothing."""
    if len(sample) == 0:
        raise ConfigError("a goodness-of-fit test needs samples")
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}")
    cells = [c for c, v in probability.items() if v is not None]
    p = np.array([float(probability[c]) for c in cells], dtype=np.float64)  # type: ignore[arg-type]  # [K]
    if (p < 0).any() or not np.isfinite(p).all():
        raise ConfigError("the baseline's scores are not probabilities (negative or not finite)")
    if p.sum() > 1.0 + SUM_TOLERANCE:
        raise ConfigError(f"the baseline's scores of distinct outcomes sum to {p.sum():.4f} > 1: not one law "
                          "(does the endpoint score the prompt as sent?)")  # fmt: skip
    n = len(sample)
    index = {c: i for i, c in enumerate(cells)}
    observed = np.zeros(len(cells) + 1)  # [K + 1]: the cells, then the rest
    for outcome in sample:
        observed[index.get(outcome, len(cells))] += 1
    law = np.append(p, max(0.0, 1.0 - p.sum()))  # [K + 1]
    observed, law = _pool(observed, law, n)
    dof = max(len(law) - 1, 0)
    expected = n * law
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, (observed - expected) ** 2 / expected, np.where(observed > 0, np.inf, 0.0))
    statistic = float(terms.sum())
    p_value = float(stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0
    rng = np.random.default_rng(seed)
    tv = 0.5 * float(np.abs(observed / n - law).sum())
    draws = [0.5 * float(np.abs(rng.multinomial(n, observed / n) / n - law).sum()) for _ in range(bootstrap)]
    return TwoSampleResult(statistic, dof, p_value, "goodness-of-fit", 0, n, len(law), tv, basic_interval(tv, draws),
                           detectable_tv_fit(law, n, dof, alpha))  # fmt: skip


def _pool(observed: np.ndarray, law: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Cells (the last one the rest) with expected counts below 5 pooled into the rest; the rest
    merged into the smallest kept cell when it stays below 5."""
    small = n * law[:-1] < MIN_EXPECTED
    kept_o, kept_p = observed[:-1][~small], law[:-1][~small]
    rest_o = observed[-1] + observed[:-1][small].sum()
    rest_p = law[-1] + law[:-1][small].sum()
    if n * rest_p < MIN_EXPECTED and len(kept_p) > 0:
        j = int(np.argmin(kept_p))
        kept_o, kept_p = kept_o.copy(), kept_p.copy()
        kept_o[j] += rest_o
        kept_p[j] += rest_p
        return kept_o, kept_p
    return np.append(kept_o, rest_o), np.append(kept_p, rest_p)


def detectable_tv_fit(law: np.ndarray, n: int, dof: int, alpha: float, power: float = POWER) -> float:
    """The smallest TV ``d`` the goodness-of-fit test detects with ``power``: mass ``d`` moved from
    the likeliest cell to the second likeliest (noncentrality ``n d^2 (1/p1 + 1/p2)``)."""
    p = np.sort(np.asarray(law, dtype=np.float64))[::-1]
    if len(p) < 2 or dof < 1 or p[1] <= 0:
        return 1.0
    return smallest_detected(lambda d: n * d * d * (1 / p[0] + 1 / p[1]), float(p[0]), dof, alpha, power)
