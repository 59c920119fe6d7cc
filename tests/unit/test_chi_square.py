from __future__ import annotations

import math

import numpy as np
import pytest

from verispec.certify.core import CertificationCase, chi_square_gof, grid
from verispec.config import SamplingParams
from verispec.errors import ConfigError


def test_exact_counts_give_zero_statistic() -> None:
    law = np.array([0.5, 0.25, 0.25])
    gof = chi_square_gof(np.array([500, 250, 250]), law)
    assert gof.statistic == 0.0
    assert gof.p_value == 1.0
    assert gof.dof == 2
    assert gof.tv_distance == 0.0


def test_statistic_matches_pearson_by_hand() -> None:
    law = np.array([0.5, 0.3, 0.2])
    counts = np.array([60, 25, 15])
    expected = 100 * law
    by_hand = float(((counts - expected) ** 2 / expected).sum())
    gof = chi_square_gof(counts, law)
    assert math.isclose(gof.statistic, by_hand)
    assert math.isclose(gof.tv_distance, 0.5 * (0.1 + 0.05 + 0.05))


def test_small_cells_are_pooled() -> None:
    law = np.array([0.9, 0.05, 0.03, 0.01, 0.01])
    gof = chi_square_gof(np.array([90, 5, 3, 1, 1]), law)  # expected 90, 5, 3, 1, 1
    assert gof.num_cells == 3  # 90 | 5 | (3 + 1 + 1) = 5


def test_pool_below_five_is_merged_into_smallest_cell() -> None:
    law = np.array([0.6, 0.38, 0.01, 0.01])
    gof = chi_square_gof(np.array([60, 38, 1, 1]), law)  # pool expected 2 < 5 -> merged with 38
    assert gof.num_cells == 2


def test_impossible_outcome_fails_outright() -> None:
    law = np.array([0.5, 0.5, 0.0])
    gof = chi_square_gof(np.array([500, 499, 1]), law)
    assert gof.p_value == 0.0
    assert gof.impossible == 1


def test_point_mass() -> None:
    assert chi_square_gof(np.array([0, 10]), np.array([0.0, 1.0])).p_value == 1.0
    assert chi_square_gof(np.array([1, 9]), np.array([0.0, 1.0])).p_value == 0.0


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        chi_square_gof(np.array([1, 2]), np.array([0.5, 0.2, 0.3]))
    with pytest.raises(ConfigError):
        chi_square_gof(np.array([0, 0]), np.array([0.5, 0.5]))
    with pytest.raises(ConfigError):
        chi_square_gof(np.array([1, 1]), np.array([0.7, 0.7]))
    with pytest.raises(ConfigError, match="longer than K"):
        grid(prefix_extra=0)
    with pytest.raises(ConfigError, match="unknown rule"):
        CertificationCase("nope", "model", 2, SamplingParams(), 3)
    with pytest.raises(ConfigError, match="K must be"):
        CertificationCase("rejection", "model", 0, SamplingParams(), 3)
