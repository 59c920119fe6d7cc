"""The single-request speedup model of speculative decoding: closed forms and a Monte Carlo check.

Model (Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
ICML 2023, §3: expected number of generated tokens and walltime improvement). Each step the drafter
proposes ``K`` draft tokens; each is accepted independently with probability ``alpha`` until the
first rejection; the step then emits one more token (recovered at a rejection, bonus after full
acceptance). The output tokens per step are ``1 + min(G, K)``, ``G`` ~ Geometric (leading acceptances):

    E(alpha, K)    = 1 + alpha + ... + alpha^K = (1 - alpha^(K+1)) / (1 - alpha)   (K + 1 at alpha = 1)
    S(alpha, K, c) = E / (K c + 1)                     speedup over plain decoding
    c_break        = (E - 1) / K                       largest draft cost with S >= 1

where ``c`` = draft cost per token / target verification cost per step (one step = one target pass).
``S`` increases in ``alpha`` and decreases in ``c``; at ``alpha = 1`` it is ``(K + 1) / (K c + 1)``
(``c_p (K + 1) / (K c_q + c_p)`` with per-token costs ``c_q`` of the drafter and ``c_p`` of the target).

Note that ``(E - 1) / K`` is also the *expected* acceptance rate AR = accepted / drafted that vLLM
reports, which is not ``alpha``: under the model, ``S > 1`` exactly when the expected AR exceeds ``c``.

The model ignores batching, KV-cache pressure, longer verification passes for large K and
position-dependent acceptance: it bounds what one request can gain; it does not predict throughput
under load. Every function validates its input and raises :class:`~verispec.errors.ConfigError`
with the allowed range.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from verispec.errors import ConfigError

__all__ = [
    "SimResult",
    "alpha_min",
    "break_even_c",
    "expected_tokens",
    "optimal_k",
    "simulate",
    "speedup",
    "speedup_grid",
]

# Relative tolerance under which two speedups count as equal (optimal_k prefers the smaller K) and a
# speedup counts as no gain over plain decoding: rounding must not buy a longer draft.
_REL_TOL = 1e-12
# alpha_min's bisection stops when its bracket is this narrow (absolute, in acceptance rate).
_ALPHA_XTOL = 1e-15


# ---------------------------------------------------------------------------------------- validation
def _real(value: Any) -> float:
    """``value`` as a float, NaN for anything that is not a real number (so every range check fails)."""
    return math.nan if isinstance(value, bool) or not isinstance(value, numbers.Real) else float(value)


def _alpha(value: Any) -> float:
    a = _real(value)
    if not 0.0 <= a <= 1.0:
        raise ConfigError(f"alpha (per-token acceptance probability) must be a number in [0, 1], got {value!r}")
    return a


def _c(value: Any) -> float:
    c = _real(value)
    if not 0.0 <= c < math.inf:
        raise ConfigError(
            "c (draft cost per token / target cost per verification step, e.g. 8 ms / 40 ms = 0.2) "
            f"must be a finite number >= 0, got {value!r}"
        )
    return c


def _k(value: Any, minimum: int, name: str = "k (draft tokens per step)") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------- closed forms
# Both evaluate E as -expm1((K+1) log a) / (1 - a), accurate next to a = 1 where 1 - a^(K+1)
# cancels, and clip to the exact bounds [1, K + 1] so that rounding never leaves them. The scalar
# version is plain ``math`` (the bisection of alpha_min calls it often); the array one is for grids.
def _expected_tokens_array(alpha: NDArray[np.float64], k: NDArray[np.int64]) -> NDArray[np.float64]:
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) = -inf is fine; a = 1 is fixed below
        e = -np.expm1((k + 1) * np.log(alpha)) / (1.0 - alpha)
    e = np.where(alpha == 1.0, k + 1.0, e)
    out: NDArray[np.float64] = np.clip(e, 1.0, k + 1.0)
    return out


def expected_tokens(alpha: float, k: int) -> float:
    """Expected output tokens per step, ``(1 - alpha^(K+1)) / (1 - alpha)``: K + 1 at alpha = 1, 1 at K = 0.

    This is the model's mean acceptance length AL (accepted draft tokens + 1 per step).
    """
    a, kk = _alpha(alpha), _k(k, 0)
    if a == 0.0 or kk == 0:
        return 1.0
    if a == 1.0:
        return kk + 1.0
    return min(max(-math.expm1((kk + 1) * math.log(a)) / (1.0 - a), 1.0), kk + 1.0)


def speedup(alpha: float, k: int, c: float) -> float:
    """Modeled speedup over plain decoding, ``S = E(alpha, K) / (K c + 1)``; exactly 1 at K = 0."""
    return expected_tokens(alpha, k) / (_k(k, 0) * _c(c) + 1.0)


def break_even_c(alpha: float, k: int) -> float:
    """Largest draft cost ratio ``c`` with ``S >= 1``: ``c_break = (E - 1) / K`` (K >= 1)."""
    kk = _k(k, 1)
    return (expected_tokens(alpha, kk) - 1.0) / kk


def alpha_min(k: int, c: float) -> float | None:
    """Smallest acceptance probability with ``S(alpha, K, c) >= 1``, or None when none in [0, 1] suffices.

    ``S`` increases in alpha from ``1 / (K c + 1)`` to ``(K + 1) / (K c + 1)``, so a solution exists
    iff ``c <= 1``. Bisection to within 1e-15; the value returned always satisfies ``S >= 1`` as
    computed by :func:`speedup`. ``c = 0`` gives 0 (a free drafter never loses).
    """
    kk, cc = _k(k, 1), _c(c)
    if cc > 1.0 or speedup(1.0, kk, cc) < 1.0:  # exact test first: S(1) rounds to 1 for c = 1 + ulp
        return None
    if speedup(0.0, kk, cc) >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0  # invariant: S(lo) < 1 <= S(hi)
    while hi - lo > _ALPHA_XTOL:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if speedup(mid, kk, cc) >= 1.0:
            hi = mid
        else:
            lo = mid
    return hi


def speedup_grid(alphas: ArrayLike, ks: ArrayLike, c: float) -> NDArray[np.float64]:
    """Speedups over a grid: ``out[i, j] = speedup(alphas[i], ks[j], c)``, in one vectorised pass.

    ``alphas``: 1-D acceptance probabilities in [0, 1]; ``ks``: 1-D integer draft lengths >= 0.
    Returns a float64 array of shape ``(len(alphas), len(ks))``.
    """
    cc = _c(c)
    a = np.atleast_1d(np.asarray(alphas))
    kk = np.atleast_1d(np.asarray(ks))
    if a.ndim != 1 or a.dtype.kind not in "iuf" or not np.all((a >= 0.0) & (a <= 1.0)):
        raise ConfigError("alphas must be a 1-D sequence of acceptance probabilities in [0, 1]")
    if kk.ndim != 1 or kk.dtype.kind not in "iu" or np.any(kk < 0):
        raise ConfigError("ks must be a 1-D sequence of integer draft lengths >= 0")
    a64, k64 = a.astype(np.float64)[:, None], kk.astype(np.int64)[None, :]
    out: NDArray[np.float64] = _expected_tokens_array(a64, k64) / (k64 * cc + 1.0)
    return out


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """Draft length in ``1..k_max`` with the largest speedup, or 0 (do not speculate) if none beats 1.

    Speedups within a relative 1e-12 of each other count as ties and go to the smallest K; a K must
    beat plain decoding by more than that to be chosen.
    """
    a, cc, km = _alpha(alpha), _c(c), _k(k_max, 1, "k_max (longest draft length considered)")
    s = speedup_grid([a], np.arange(1, km + 1), cc)[0]
    best = float(s.max())
    if best <= 1.0 + _REL_TOL:
        return 0
    return int(np.argmax(s >= best * (1.0 - _REL_TOL))) + 1


# ---------------------------------------------------------------------------------------- Monte Carlo
@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`: ``n`` simulated steps at ``(alpha, k, c)``.

    ``tokens_per_step`` estimates E (the mean acceptance length AL); ``std_error`` is its standard
    error (sample standard deviation / sqrt(n); NaN when n = 1). ``speedup`` and
    ``speedup_std_error`` are the same divided by ``K c + 1``. ``acceptance_rate`` is accepted /
    drafted (vLLM's AR; its expectation is ``(E - 1) / K``, not alpha; NaN when K = 0).
    """

    alpha: float
    k: int
    c: float
    n: int
    seed: int
    tokens_per_step: float
    std_error: float
    speedup: float
    speedup_std_error: float
    acceptance_rate: float


def simulate(alpha: float, k: int, c: float, n: int, seed: int) -> SimResult:
    """Simulate ``n`` speculative steps with i.i.d. acceptance and return the measured speedup.

    Each step draws K uniforms from ``numpy.random.default_rng(seed)`` (all steps at once, as one
    ``[n, K]`` array: memory ~9 n K bytes) and accepts the leading run of draws below ``alpha``,
    then emits one more token, exactly as the seed's pure-Python exercise does token by token.
    K = 0 draws nothing.
    """
    a, kk, cc = _alpha(alpha), _k(k, 0), _c(c)
    nn, sd = _k(n, 1, "n (number of simulated steps)"), _k(seed, 0, "seed")
    rng = np.random.default_rng(sd)
    accepted_each = rng.random((nn, kk)) < a  # [n, K] bool
    accepted = np.logical_and.accumulate(accepted_each, axis=1).sum(axis=1)  # [n] leading run
    tokens = accepted + 1.0
    mean = float(tokens.mean())
    se = float(tokens.std(ddof=1) / math.sqrt(nn)) if nn > 1 else math.nan
    cost = kk * cc + 1.0
    return SimResult(
        alpha=a,
        k=kk,
        c=cc,
        n=nn,
        seed=sd,
        tokens_per_step=mean,
        std_error=se,
        speedup=mean / cost,
        speedup_std_error=se / cost,
        acceptance_rate=float(accepted.sum()) / (nn * kk) if kk else math.nan,
    )
