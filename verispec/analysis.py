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

Trees (Chen et al. 2024, "Sequoia: Scalable, Robust, and Hardware-aware Speculative Decoding", §3:
the positional acceptance assumption). A tree draft's node is the ``i``-th child of its parent
(children in the order the drafter ranks them: top-k order, or draw order); it is accepted with
probability ``p_i`` given that its parent was, whatever its depth, and at most one child of a node
is accepted (so ``sum p_i <= 1``). A step then emits

    E(tree) = 1 + sum over nodes v of prod over the edges of v's path of p_(rank of the edge)

tokens on average, and Sequoia's dynamic programme finds the tree of at most ``n`` nodes (and
depth ``d``) with the largest ``E`` (:func:`optimal_tree`). A chain is the tree whose nodes are all
first children: ``E`` is then ``expected_tokens(p_1, K)``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from verispec.errors import ConfigError

__all__ = [
    "SimResult",
    "TreePlan",
    "alpha_min",
    "break_even_c",
    "expected_tokens",
    "optimal_k",
    "optimal_tree",
    "optimal_trees",
    "parents_from_paths",
    "simulate",
    "speedup",
    "speedup_grid",
    "tree_expected_tokens",
    "tree_paths",
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


# ---------------------------------------------------------------------------------------- trees
def _acceptance_vector(value: Any) -> tuple[float, ...]:
    """Positional acceptance ``p_1, p_2, ...``: each in [0, 1], summing to at most 1."""
    try:
        ps = tuple(_real(v) for v in value)
    except TypeError:
        ps = (math.nan,)
    if not ps or not all(0.0 <= p <= 1.0 for p in ps) or math.fsum(ps) > 1.0 + 1e-9:
        raise ConfigError(
            "tree acceptance must be a non-empty list of probabilities in [0, 1] (p_i: the i-th child of an "
            f"accepted node is accepted) summing to at most 1, got {value!r}"
        )
    return ps


def _parents(value: Any) -> tuple[int, ...]:
    """A tree's parents: node i's parent is -1 (the root: the last committed token) or a node < i."""
    try:
        parents = tuple(int(p) for p in value)
        ok = all(-1 <= p < i and p == v for i, (p, v) in enumerate(zip(parents, value, strict=True)))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"tree parents must list, for each node, -1 (the root) or an earlier node's index, got {value!r}"
        )
    return parents


def tree_paths(parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's path as the ranks of its edges (Medusa's "choices": ``(0,)`` is the root's first
    child, ``(0, 1)`` that child's second child); a node's rank is its order among its siblings."""
    ps = _parents(parents)
    paths: list[tuple[int, ...]] = []
    children: dict[int, int] = {}
    for p in ps:
        rank = children.get(p, 0)
        children[p] = rank + 1
        paths.append((paths[p] if p >= 0 else ()) + (rank,))
    return paths


def parents_from_paths(paths: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The parents of the tree whose nodes have these rank paths (any order in; out: the nodes
    level by level, each level in path order). Every path's prefix must be a path too, and a node
    of rank ``r > 0`` needs its sibling of rank ``r - 1``."""
    try:
        keys = sorted({tuple(int(r) for r in path) for path in paths}, key=lambda t: (len(t), t))
    except (TypeError, ValueError):
        keys = [()]
    index = {path: i for i, path in enumerate(keys)}
    if (
        not keys
        or len(keys) != len(paths)
        or any(
            not path
            or min(path) < 0
            or (len(path) > 1 and path[:-1] not in index)
            or (path[-1] and (*path[:-1], path[-1] - 1) not in index)
            for path in keys
        )
    ):
        raise ConfigError(
            "a tree's paths must be distinct, non-empty lists of ranks >= 0 whose prefixes are paths too, "
            f"with every rank r > 0 beside its rank r - 1 sibling (e.g. [[0], [1], [0, 0]]), got {list(paths)!r}"
        )
    return tuple(index[path[:-1]] if len(path) > 1 else -1 for path in keys)


def tree_expected_tokens(parents: Sequence[int], acceptance: Sequence[float]) -> float:
    """Expected output tokens per step (AL) of the tree with these ``parents`` (node i's parent:
    -1 for the root, else an earlier node; siblings ranked by index) under positional acceptance
    ``acceptance`` (``p_1, p_2, ...``; ranks beyond its length are never accepted)."""
    ps, par = _acceptance_vector(acceptance), _parents(parents)
    reach: list[float] = []
    for path, p in zip(tree_paths(par), par, strict=True):
        reach.append((reach[p] if p >= 0 else 1.0) * (ps[path[-1]] if path[-1] < len(ps) else 0.0))
    return 1.0 + math.fsum(reach)


@dataclass(frozen=True, slots=True)
class TreePlan:
    """A tree chosen by :func:`optimal_tree`: its ``parents`` (level by level, siblings in rank
    order) and its expected output tokens per step ``expected_tokens``."""

    parents: tuple[int, ...]
    expected_tokens: float

    @property
    def depth(self) -> int:
        return max((len(p) for p in tree_paths(self.parents)), default=0)


def optimal_tree(acceptance: Sequence[float], max_nodes: int, max_depth: int | None = None) -> TreePlan:
    """The tree of at most ``max_nodes`` nodes and ``max_depth`` levels (default: no limit) with
    the largest expected output tokens per step under positional acceptance (Sequoia's dynamic
    programme, Chen et al. 2024, §3.1). A smaller tree is returned when more nodes add nothing
    (ties go to fewer nodes); a chain is optimal when only ``p_1`` is positive."""
    return optimal_trees(acceptance, max_nodes, max_depth)[-1]


def optimal_trees(acceptance: Sequence[float], max_nodes: int, max_depth: int | None = None) -> list[TreePlan]:
    """:func:`optimal_tree` for every budget ``0 .. max_nodes`` nodes, from one dynamic programme.

    ``best[d][n]``: the most expected accepted nodes below an accepted node from at most ``n``
    nodes within ``d`` levels; its children are ranks 1, 2, ... (a prefix), child ``i`` taking
    ``j`` nodes for its own subtree, worth ``p_i (1 + best[d - 1][j - 1])``: a knapsack over ranks
    per depth, ``O(depth x ranks x n^2)``.
    """
    ps = _acceptance_vector(acceptance)
    n_max = _k(max_nodes, 0, "max_nodes (nodes of the tree)")
    if n_max > 4096:
        raise ConfigError(
            f"max_nodes must be at most 4096 (a verification pass over more rows is no draft), got {max_nodes!r}"
        )
    d_max = n_max if max_depth is None else min(_k(max_depth, 0, "max_depth (levels of the tree)"), n_max)
    ranks = list(ps[:n_max])
    while ranks and ranks[-1] == 0.0:
        ranks.pop()
    if not ranks or d_max == 0:
        return [TreePlan((), 1.0)] * (n_max + 1)
    # best[d]: [n_max + 1]; take[d][i][m]: nodes child rank i + 1 takes when ranks >= i + 1 share m (0: none)
    best = [np.zeros(n_max + 1)]
    take: list[list[NDArray[np.int64]]] = [[]]
    spare = np.arange(n_max + 1)[:, None] - np.arange(1, n_max + 1)[None, :]  # [n_max + 1, n_max]: m - j
    for _ in range(d_max):
        below = best[-1]
        subtree = np.concatenate(([-np.inf], 1.0 + below[:-1]))  # [n_max + 1]: j nodes -> 1 + best(j - 1)
        g = np.zeros(n_max + 1)  # ranks beyond the last: nothing
        level_take: list[NDArray[np.int64]] = []
        for p in reversed(ranks):
            # values[m, j - 1]: the child takes j of m nodes, later ranks the rest (-inf: j > m)
            rest = np.where(spare >= 0, g[np.clip(spare, 0, None)], -np.inf)  # [n_max + 1, n_max]
            values = p * subtree[1:][None, :] + rest
            top = np.argmax(values, axis=1)  # the fewest nodes among equals
            gain = values[np.arange(n_max + 1), top]
            useful = gain > _REL_TOL  # a child must add something (no child: 0, and no later ranks)
            g = np.where(useful, gain, 0.0)
            level_take.append(np.where(useful, top + 1, 0))
        best.append(np.maximum.accumulate(g))  # at most n nodes
        take.append(level_take[::-1])

    def grow(paths: list[tuple[int, ...]], prefix: tuple[int, ...], d: int, n: int) -> None:
        n = int(np.argmax(best[d][: n + 1] >= best[d][n] * (1.0 - _REL_TOL))) if n else 0  # fewest nodes to the best
        for i, choice in enumerate(take[d]):
            j = int(choice[n]) if n > 0 else 0
            if j == 0:
                return
            paths.append((*prefix, i))
            grow(paths, (*prefix, i), d - 1, j - 1)
            n -= j

    plans = []
    for n in range(n_max + 1):
        paths: list[tuple[int, ...]] = []
        grow(paths, (), d_max, n)
        parents = parents_from_paths(paths) if paths else ()
        plans.append(TreePlan(parents, tree_expected_tokens(parents, ps) if parents else 1.0))
    return plans
