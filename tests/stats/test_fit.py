"""The goodness-of-fit test of samples against scored probabilities is calibrated: under the null
its p-values are uniform (cells chosen by a separate pilot), a shift of its detectable TV is
caught at about the stated power, it detects less than the two-sample test needs at the same N,
and scores that are not one law are refused."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from verispec.certify.fit import detectable_tv_fit, fit_cells, fit_test
from verispec.certify.twosample import two_sample_test
from verispec.errors import ConfigError

LAW = np.array([0.45, 0.25, 0.12, 0.08, 0.05, 0.03, 0.01, 0.005, 0.005])


def draw(rng: np.random.Generator, law: np.ndarray, n: int) -> list[int]:
    return rng.choice(len(law), size=n, p=law).tolist()


def scored(pilot: list[int]) -> dict[int, float]:
    return {c: float(LAW[c]) for c in fit_cells(pilot)}  # type: ignore[index]


def test_p_values_are_uniform_under_the_null() -> None:
    rng = np.random.default_rng(1)
    ps = [fit_test(draw(rng, LAW, 400), scored(draw(rng, LAW, 60)), bootstrap=0).p_value for _ in range(300)]
    assert stats.kstest(ps, "uniform").pvalue > 1e-3
    assert np.mean(np.array(ps) < 0.05) <= 0.09


def test_a_shift_of_the_detectable_tv_is_caught_at_about_the_stated_power() -> None:
    rng = np.random.default_rng(2)
    n, alpha = 500, 0.01
    probe = fit_test(draw(rng, LAW, n), {c: float(LAW[c]) for c in range(len(LAW))}, alpha=alpha, bootstrap=0)
    d = probe.detectable_tv
    assert 0.01 < d < 0.15 and probe.method == "goodness-of-fit" and probe.n_a == 0
    shifted = LAW.copy()
    shifted[0] -= d
    shifted[1] += d
    hits = [fit_test(draw(rng, shifted, n), scored(draw(rng, LAW, 60)), alpha=alpha, bootstrap=0).p_value < alpha
            for _ in range(150)]  # fmt: skip
    assert 0.6 <= np.mean(hits) <= 0.95  # the stated power is 0.8 (the pilot's cells may pool a little)
    two = two_sample_test(draw(rng, LAW, n), draw(rng, LAW, n), alpha=alpha, bootstrap=0)
    assert d < 0.8 * two.detectable_tv  # no noise from a second sample
    assert detectable_tv_fit(LAW, 4 * n, probe.dof, alpha) == pytest.approx(d / 2, rel=0.25)


def test_outcomes_the_pilot_missed_fall_into_the_rest_and_bad_scores_are_refused() -> None:
    r = fit_test([0] * 50 + [5] * 50, {0: 0.5}, bootstrap=0)  # outcome 5 is in the rest, of probability 0.5
    assert r.p_value > 0.5 and r.cells == 2
    assert fit_test([0] * 60 + [1] * 40, {0: 0.9}, bootstrap=0).p_value < 1e-6
    with pytest.raises(ConfigError, match="sum to"):
        fit_test([0, 1], {0: 0.7, 1: 0.6})
    with pytest.raises(ConfigError, match="not probabilities"):
        fit_test([0], {0: float("nan")})
    with pytest.raises(ConfigError):
        fit_test([], {0: 0.5})
