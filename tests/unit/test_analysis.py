"""The single-request speedup model: the seeds' worked examples to their printed digits, the limits,
the Monte Carlo against the closed form, validation, and properties (hypothesis)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.analysis import (
    SimResult,
    alpha_min,
    break_even_c,
    expected_tokens,
    optimal_k,
    optimal_tree,
    parents_from_paths,
    simulate,
    speedup,
    speedup_grid,
    tree_expected_tokens,
    tree_paths,
)
from verispec.errors import ConfigError

# Deterministic, and no deadline: tests never depend on timing.
PROPERTY = settings(deadline=None, derandomize=True, max_examples=100)
alphas = st.floats(0.0, 1.0, allow_nan=False)
costs = st.floats(0.0, 2.0, allow_nan=False)
lengths = st.integers(1, 64)


# ------------------------------------------------------------------------ worked examples of the seeds
def test_lesson_worked_example() -> None:
    e = expected_tokens(0.7, 4)
    s = speedup(0.7, 4, 0.10)
    assert round(e, 4) == 2.7731
    assert round(s, 4) == 1.9808
    assert round(e, 3) == 2.773
    assert round(s, 3) == 1.981
    assert math.isclose(e, (1 - 0.16807) / 0.3, rel_tol=1e-14)


@pytest.mark.parametrize(
    ("alpha", "k", "c", "printed"),
    [
        (0.7, 4, 0.20, 1.541),  # slower draft
        (0.5, 4, 0.20, 1.076),  # ... and lower acceptance
        (0.85, 4, 0.15, 2.318),  # interview question
        (0.75, 4, 8 / 40, 1.695),  # exercise: 8 ms draft, 40 ms verification
    ],
)
def test_lesson_speedups(alpha: float, k: int, c: float, printed: float) -> None:
    assert round(speedup(alpha, k, c), 3) == printed


def test_exercise_says_speculation_helps() -> None:
    assert speedup(0.75, 4, 8 / 40) > 1


def test_break_even_of_the_lesson() -> None:
    assert round(break_even_c(0.7, 4), 3) == 0.443
    assert speedup(0.7, 4, break_even_c(0.7, 4)) == pytest.approx(1.0, abs=1e-15)


def test_expected_tokens_is_the_notes_sum() -> None:
    # E = sum_{i<K} (i+1) a^i (1-a) + (K+1) a^K: the derivation in the notes, term by term.
    for alpha in (0.0, 0.1, 0.5, 0.7, 0.99, 0.999999):
        for k in (1, 2, 4, 9, 30):
            by_hand = sum((i + 1) * alpha**i * (1 - alpha) for i in range(k)) + (k + 1) * alpha**k
            assert expected_tokens(alpha, k) == pytest.approx(by_hand, rel=1e-10)


# ------------------------------------------------------------------------ limits and special values
@pytest.mark.parametrize("k", [0, 1, 4, 100])
def test_expected_tokens_at_the_ends(k: int) -> None:
    assert expected_tokens(0.0, k) == 1.0
    assert expected_tokens(1.0, k) == k + 1
    assert expected_tokens(0.7, 0) == 1.0


@pytest.mark.parametrize("k", [1, 4, 8])
def test_speedup_at_full_acceptance_is_the_notes_ceiling(k: int) -> None:
    draft_cost, target_cost = 8.0, 40.0  # c_q, c_p per token
    ceiling = target_cost * (k + 1) / (k * draft_cost + target_cost)
    assert speedup(1.0, k, draft_cost / target_cost) == pytest.approx(ceiling, rel=1e-15)
    assert speedup(1.0 - 1e-12, k, draft_cost / target_cost) == pytest.approx(ceiling, rel=1e-9)
    assert speedup(0.0, k, draft_cost / target_cost) == pytest.approx(1 / (k * 0.2 + 1), rel=1e-15)


def test_no_speculation_is_plain_decoding() -> None:
    assert speedup(0.3, 0, 0.5) == 1.0


def test_expected_tokens_is_accurate_next_to_one() -> None:
    # 1 - a^(K+1) cancels catastrophically here; E = (K+1) - K(K+1)/2 * eps + O(eps^2).
    eps = 1e-10
    assert expected_tokens(1 - eps, 4) == pytest.approx(5 - 10 * eps, rel=1e-15)


def test_alpha_min_of_the_lesson() -> None:
    a = alpha_min(4, 0.1)
    assert a is not None
    assert round(a, 4) == 0.2871
    assert speedup(a, 4, 0.1) >= 1.0
    assert speedup(a - 1e-9, 4, 0.1) < 1.0


def test_alpha_min_special_cases() -> None:
    assert alpha_min(1, 0.3) == pytest.approx(0.3, abs=1e-12)  # K = 1: S = (1 + a) / (1 + c)
    assert alpha_min(4, 0.0) == 0.0  # a free drafter never loses
    assert alpha_min(4, 1.0) == 1.0  # only perfect acceptance breaks even
    assert alpha_min(4, 1.0001) is None
    assert alpha_min(16, 5.0) is None


def test_alpha_min_and_break_even_are_dual() -> None:
    for k in (1, 4, 9):
        for c in (0.05, 0.2, 0.6):
            a = alpha_min(k, c)
            assert a is not None
            assert break_even_c(a, k) == pytest.approx(c, rel=1e-9)


def test_optimal_k_of_the_lesson() -> None:
    assert optimal_k(0.7, 0.1) == 4
    assert speedup(0.7, 4, 0.1) > max(speedup(0.7, 3, 0.1), speedup(0.7, 5, 0.1))


def test_optimal_k_ties_go_to_the_shorter_draft() -> None:
    # alpha = 0.5, c = 0.2: S(1) = 1.5 / 1.2 = 1.25 = 1.75 / 1.4 = S(2) exactly.
    assert speedup(0.5, 1, 0.2) == pytest.approx(speedup(0.5, 2, 0.2), rel=1e-15)
    assert optimal_k(0.5, 0.2) == 1


def test_optimal_k_zero_means_do_not_speculate() -> None:
    assert optimal_k(0.9, 1.2) == 0
    assert optimal_k(0.0, 0.1) == 0
    assert optimal_k(0.31, 0.3) == 1  # K = 1 pays iff alpha > c
    assert optimal_k(0.3, 0.3) == 0
    assert optimal_k(0.3, 0.31) == 0
    assert optimal_k(1.0, 1.0) == 0  # S = 1 for every K: no gain
    assert optimal_k(0.5, 0.0, k_max=7) == 7  # a free drafter: the longer the better


def test_speedup_grid_matches_the_scalar_function() -> None:
    a = np.linspace(0.0, 1.0, 11)
    ks = np.arange(0, 9)
    grid = speedup_grid(a, ks, 0.15)
    assert grid.shape == (11, 9)
    assert grid.dtype == np.float64
    for i, alpha in enumerate(a):
        for j, k in enumerate(ks):
            assert grid[i, j] == pytest.approx(speedup(float(alpha), int(k), 0.15), rel=1e-14)


# ------------------------------------------------------------------------ Monte Carlo
def test_monte_carlo_reproduces_the_worked_example() -> None:
    sim = simulate(0.7, 4, 0.1, n=100_000, seed=42)
    assert isinstance(sim, SimResult)
    assert sim.n == 100_000
    assert 0.003 < sim.std_error < 0.007  # sqrt(Var / n) with Var ~ 2.4
    assert abs(sim.tokens_per_step - 2.7731) < 4 * sim.std_error
    assert round(sim.tokens_per_step, 1) == 2.8
    assert sim.speedup == pytest.approx(sim.tokens_per_step / 1.4, rel=1e-15)
    assert sim.speedup_std_error == pytest.approx(sim.std_error / 1.4, rel=1e-15)
    # accepted / drafted is (AL - 1) / K: it estimates (E - 1) / K = 0.443, not alpha = 0.7.
    assert sim.acceptance_rate == pytest.approx((sim.tokens_per_step - 1) / 4, rel=1e-12)


def test_monte_carlo_is_reproducible_and_seeded() -> None:
    first = simulate(0.6, 5, 0.2, n=5000, seed=7)
    assert first == simulate(0.6, 5, 0.2, n=5000, seed=7)
    assert first.tokens_per_step != simulate(0.6, 5, 0.2, n=5000, seed=8).tokens_per_step
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.n = 3  # type: ignore[misc]


@pytest.mark.parametrize(("alpha", "k", "tokens"), [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.6, 0, 1.0)])
def test_monte_carlo_degenerate_cases_are_exact(alpha: float, k: int, tokens: float) -> None:
    sim = simulate(alpha, k, 0.1, n=1000, seed=0)
    assert sim.tokens_per_step == tokens
    assert sim.std_error == 0.0


def test_monte_carlo_single_step_has_no_standard_error() -> None:
    assert math.isnan(simulate(0.5, 3, 0.1, n=1, seed=0).std_error)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("alpha", "k"), [(0.3, 2), (0.8, 6), (0.95, 12)])
def test_monte_carlo_agrees_with_closed_form(alpha: float, k: int, seed: int) -> None:
    sim = simulate(alpha, k, 0.05, n=20_000, seed=seed)
    # 5 standard errors: a false alarm has probability ~6e-7 per case, and the seeds are fixed anyway.
    assert abs(sim.tokens_per_step - expected_tokens(alpha, k)) < 5 * sim.std_error


# ------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    ("call", "allowed"),
    [
        (lambda: expected_tokens(-0.1, 4), "[0, 1]"),
        (lambda: expected_tokens(1.1, 4), "[0, 1]"),
        (lambda: expected_tokens(math.nan, 4), "[0, 1]"),
        (lambda: expected_tokens(math.inf, 4), "[0, 1]"),
        (lambda: expected_tokens("0.5", 4), "[0, 1]"),
        (lambda: expected_tokens(True, 4), "[0, 1]"),
        (lambda: expected_tokens(0.5, -1), ">= 0"),
        (lambda: expected_tokens(0.5, 2.5), ">= 0"),
        (lambda: speedup(0.5, 4, -0.1), ">= 0"),
        (lambda: speedup(0.5, 4, math.nan), ">= 0"),
        (lambda: speedup(0.5, 4, math.inf), ">= 0"),
        (lambda: break_even_c(0.5, 0), ">= 1"),
        (lambda: alpha_min(0, 0.1), ">= 1"),
        (lambda: alpha_min(4, -1.0), ">= 0"),
        (lambda: optimal_k(0.5, 0.1, k_max=0), ">= 1"),
        (lambda: optimal_k(1.5, 0.1), "[0, 1]"),
        (lambda: simulate(0.5, 4, 0.1, n=0, seed=0), ">= 1"),
        (lambda: simulate(0.5, 4, 0.1, n=10, seed=-1), ">= 0"),
        (lambda: simulate(0.5, 4, 0.1, n=10, seed=1.5), ">= 0"),
        (lambda: speedup_grid([0.5, 2.0], [1, 2], 0.1), "[0, 1]"),
        (lambda: speedup_grid([0.5, math.nan], [1, 2], 0.1), "[0, 1]"),
        (lambda: speedup_grid([0.5], [1.5], 0.1), ">= 0"),
        (lambda: speedup_grid([0.5], [-1], 0.1), ">= 0"),
        (lambda: speedup_grid([[0.5]], [1], 0.1), "1-D"),
        (lambda: speedup_grid([0.5], [1], -0.5), ">= 0"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_range(call, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert allowed in str(info.value)
    assert isinstance(info.value, ValueError)


def test_numpy_scalars_are_accepted() -> None:
    assert speedup(np.float64(0.7), np.int64(4), np.float32(0.1)) == pytest.approx(1.9808, abs=1e-4)


# ------------------------------------------------------------------------ properties
@PROPERTY
@given(alphas, alphas, st.integers(0, 64), costs)
def test_speedup_increases_with_alpha(a1: float, a2: float, k: int, c: float) -> None:
    lo, hi = sorted((a1, a2))
    assert speedup(lo, k, c) <= speedup(hi, k, c) * (1 + 1e-12)


@PROPERTY
@given(alphas, st.integers(0, 200))
def test_expected_tokens_between_one_and_k_plus_one(alpha: float, k: int) -> None:
    assert 1.0 <= expected_tokens(alpha, k) <= k + 1


@PROPERTY
@given(lengths, st.floats(0.0, 1.0, allow_nan=False, exclude_min=True))
def test_speedup_at_alpha_min_is_one(k: int, c: float) -> None:
    a = alpha_min(k, c)
    assert a is not None
    assert 0.0 <= a <= 1.0
    s = speedup(a, k, c)
    assert 1.0 <= s <= 1.0 + 1e-9
    if a > 1e-9:
        assert speedup(a - 1e-9, k, c) < 1.0  # the smallest such alpha


@PROPERTY
@given(lengths, st.floats(1.0, 100.0, allow_nan=False, exclude_min=True))
def test_no_alpha_min_when_the_draft_costs_more_than_the_target(k: int, c: float) -> None:
    assert alpha_min(k, c) is None


@PROPERTY
@given(alphas, costs, st.integers(1, 32))
def test_optimal_k_maximises_speedup(alpha: float, c: float, k_max: int) -> None:
    best = optimal_k(alpha, c, k_max)
    s = [speedup(alpha, k, c) for k in range(1, k_max + 1)]
    top = max(s)
    if best == 0:
        assert top <= 1.0 + 1e-12
    else:
        assert 1 <= best <= k_max
        assert s[best - 1] >= top * (1 - 1e-12)
        assert s[best - 1] > 1.0
        assert all(v < top * (1 - 1e-12) for v in s[: best - 1])  # ties go to the smallest K


# ------------------------------------------------------------------------ trees (Sequoia's model)
def _all_trees(n: int):
    """Every tree of n nodes as a parents tuple (node i's parent -1 or < i; siblings ranked by index)."""
    if n == 0:
        yield ()
        return
    for head in _all_trees(n - 1):
        for p in range(-1, n - 1):
            yield (*head, p)


def _depth(parents) -> int:
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


def test_a_chain_is_the_single_request_model() -> None:
    for k in range(6):
        chain = tuple(range(-1, k - 1))
        assert tree_expected_tokens(chain, [0.7]) == pytest.approx(expected_tokens(0.7, k), rel=1e-12)
        assert tree_expected_tokens(chain, [0.7, 0.2]) == pytest.approx(expected_tokens(0.7, k), rel=1e-12)


def test_tree_expected_tokens_by_hand() -> None:
    # root -> a (rank 0), b (rank 1); a -> c (rank 0): 1 + 0.5 + 0.3 + 0.5 * 0.5
    assert tree_expected_tokens((-1, -1, 0), [0.5, 0.3]) == pytest.approx(2.05)
    assert tree_expected_tokens((-1, -1, -1), [0.5, 0.3]) == pytest.approx(1.8)  # rank 2 never accepted


def test_tree_expected_tokens_matches_a_simulation_of_the_model() -> None:
    parents, acceptance = (-1, -1, 0, 0, 1, 2, 2, 5), [0.55, 0.25, 0.1]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    rng = np.random.default_rng(0)
    steps, total = 40_000, 0
    for _ in range(steps):
        node, tokens = -1, 1
        while True:
            u, acc, nxt = rng.random(), 0.0, None
            for rank, child in enumerate(children.get(node, [])):
                acc += acceptance[rank] if rank < len(acceptance) else 0.0
                if u < acc:
                    nxt = child
                    break
            if nxt is None:
                break
            node, tokens = nxt, tokens + 1
        total += tokens
    assert total / steps == pytest.approx(tree_expected_tokens(parents, acceptance), abs=0.02)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_tree_is_the_best_of_every_tree(seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = rng.dirichlet(np.ones(4)) * rng.uniform(0.5, 1.0)
    acceptance = sorted(raw.tolist(), reverse=True)[:3] if seed % 2 else raw.tolist()[:3]  # also unsorted
    for n in range(0, 7):
        for depth in (None, 1, 2, 3):
            trees = [t for t in _all_trees(n) if depth is None or _depth(t) <= depth]
            smaller = [t for m in range(n) for t in _all_trees(m) if depth is None or _depth(t) <= depth]
            best = max(tree_expected_tokens(t, acceptance) if t else 1.0 for t in trees + smaller)
            plan = optimal_tree(acceptance, n, depth)
            assert plan.expected_tokens == pytest.approx(best, rel=1e-12), (n, depth)
            assert len(plan.parents) <= n and (depth is None or plan.depth <= depth)
            assert plan.expected_tokens == pytest.approx(
                tree_expected_tokens(plan.parents, acceptance) if plan.parents else 1.0
            )


def test_optimal_tree_shapes() -> None:
    assert optimal_tree([0.8], 4).parents == (-1, 0, 1, 2)  # only first children accepted: a chain
    assert optimal_tree([0.4, 0.3, 0.2], 3, max_depth=1).parents == (-1, -1, -1)  # one level: the top 3
    assert optimal_tree([0.0, 0.0], 4).parents == ()  # nothing is ever accepted: no node pays
    assert optimal_tree([0.0, 0.5], 2).parents == (-1, -1)  # a useless first child makes room for the second
    assert optimal_tree([0.9, 0.05], 40).expected_tokens > optimal_tree([0.9, 0.05], 20).expected_tokens
    plan = optimal_tree([0.6, 0.2, 0.1], 64, max_depth=6)
    assert plan.depth == 6 and len(plan.parents) == 64
    assert optimal_tree([0.9], 50).parents == tuple(range(-1, 49))
    chain = optimal_tree([0.5], 100).parents  # 0.5^40 is below rounding: such nodes add nothing
    assert chain == tuple(range(-1, len(chain) - 1)) and len(chain) < 50


def test_paths_and_parents_round_trip() -> None:
    medusa = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    parents = parents_from_paths(medusa)
    assert parents == (-1, -1, -1, 0, 0, 1, 3)
    assert tree_paths(parents) == [tuple(p) for p in medusa]
    assert parents_from_paths(list(reversed(medusa))) == parents  # order in does not matter


@pytest.mark.parametrize(
    "paths",
    [[], [[0], [0]], [[1]], [[0], [0, 1]], [[0, 0]], [[0], []], [[0], [-1]], [["a"]], [[0], 3]],
)
def test_bad_paths_are_config_errors(paths) -> None:
    with pytest.raises(ConfigError, match="paths"):
        parents_from_paths(paths)


@pytest.mark.parametrize(
    "call",
    [
        lambda: tree_expected_tokens((-1,), []),
        lambda: tree_expected_tokens((-1,), [0.7, 0.5]),
        lambda: tree_expected_tokens((-1,), [1.5]),
        lambda: tree_expected_tokens((-1,), [math.nan]),
        lambda: tree_expected_tokens((0,), [0.5]),
        lambda: tree_expected_tokens((-1, 2, 0), [0.5]),
        lambda: tree_expected_tokens((-1, 0.5), [0.5]),
        lambda: optimal_tree([0.5], -1),
        lambda: optimal_tree([0.5], 10_000),
        lambda: optimal_tree([0.5], 4, max_depth=-1),
    ],
)
def test_bad_tree_input_is_a_config_error(call) -> None:
    with pytest.raises(ConfigError):
        call()
