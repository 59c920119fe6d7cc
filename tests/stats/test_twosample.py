"""The two-sample test of output laws is calibrated: under the null its p-values are uniform
(chi-square and permutation paths), it detects a shift of the detectable TV at about the stated
power, its TV interval covers the truth, and Holm / Fisher combine as they should."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from verispec.certify.twosample import combine, detectable_tv, independence_p, pool, table, two_sample_test
from verispec.errors import ConfigError

LAW = np.array([0.45, 0.25, 0.12, 0.08, 0.05, 0.03, 0.01, 0.005, 0.005])


def draw(rng: np.random.Generator, law: np.ndarray, n: int) -> list[int]:
    return rng.choice(len(law), size=n, p=law).tolist()


@pytest.mark.parametrize(("n", "method"), [(400, "chi-square"), (30, "permutation")])
def test_p_values_are_uniform_under_the_null(n: int, method: str) -> None:
    rng = np.random.default_rng(1)
    ps, methods = [], set()
    for i in range(200):
        r = two_sample_test(draw(rng, LAW, n), draw(rng, LAW, n), rounds=300, bootstrap=0, seed=i)
        ps.append(r.p_value)
        methods.add(r.method)
    assert methods == {method}
    # a permutation p-value is discrete and slightly conservative: test its upper tail only
    assert stats.kstest(ps, "uniform").pvalue > 1e-3 or method == "permutation"
    assert 0.0 <= np.mean(np.array(ps) < 0.05) <= 0.10
    assert np.mean(np.array(ps) < 0.2) > 0.08  # not degenerate


def test_a_shift_of_the_detectable_tv_is_detected_at_about_the_stated_power() -> None:
    rng = np.random.default_rng(2)
    n, alpha = 500, 0.01
    shares = LAW / LAW.sum()
    probe = two_sample_test(draw(rng, LAW, n), draw(rng, LAW, n), alpha=alpha, bootstrap=0)
    d = detectable_tv(pool(np.stack([shares * n, shares * n])).sum(0) / (2 * n), n, n, probe.dof, alpha)
    assert 0.02 < d < 0.2
    shifted = LAW.copy()
    shifted[0] -= d
    shifted[1] += d
    hits = [
        two_sample_test(draw(rng, LAW, n), draw(rng, shifted, n), alpha=alpha, bootstrap=0).p_value < alpha
        for _ in range(150)
    ]
    assert 0.65 <= np.mean(hits) <= 0.95  # the stated power is 0.8
    # and the detectable TV shrinks like 1 / sqrt(N)
    assert detectable_tv(shares, 4 * n, 4 * n, probe.dof, alpha) == pytest.approx(d / 2, rel=0.25)


def test_the_tv_interval_covers_the_truth_and_exact_outcomes_work() -> None:
    rng = np.random.default_rng(3)
    other = np.roll(LAW, 1)
    truth = 0.5 * np.abs(LAW - other).sum()
    r = two_sample_test(draw(rng, LAW, 3000), draw(rng, other, 3000), seed=1)
    assert r.tv_interval[0] <= truth + 0.02 and r.tv_interval[1] >= truth - 0.02 and r.p_value < 1e-10
    same = two_sample_test([(1, 2)] * 50, [(1, 2)] * 60)  # one outcome: nothing differs
    assert same.p_value == 1.0 and same.tv == 0.0 and same.detectable_tv == 1.0
    outcomes, counts = table(["x", "y", "x"], ["y", "z"])
    assert outcomes[0] in ("x", "y") and counts.sum() == 5 and counts.shape == (2, 3)


def test_holm_and_fisher_combine() -> None:
    assert combine([0.01, 0.5, 0.9], "holm") == pytest.approx(0.03)
    assert combine([0.4] * 3, "holm") == 1.0
    fisher = combine([0.04, 0.04, 0.04], "fisher")
    assert fisher < 0.04 and combine([0.9, 0.9], "fisher") > 0.5
    with pytest.raises(ConfigError):
        combine([], "holm")
    with pytest.raises(ConfigError):
        combine([0.1], "stouffer")
    with pytest.raises(ConfigError):
        two_sample_test([], [1])


def test_runs_of_identical_samples_are_flagged_as_not_independent() -> None:
    rng = np.random.default_rng(4)
    independent = [independence_p(draw(rng, LAW, 300), seed=i) for i in range(40)]
    assert min(independent) > 1e-3  # (500 reorderings: the smallest p-value is 1/501)
    clustered = [x for x in draw(rng, LAW, 75) for _ in range(4)]  # 4 continuations per seed, as llama-server's n
    assert independence_p(clustered) < 1e-6 and independence_p([1, 1]) == 1.0
