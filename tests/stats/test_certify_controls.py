"""Negative controls: deliberately broken rules and a misreporting drafter must FAIL the very same
test that the real rules pass. A certification that cannot fail certifies nothing."""

from __future__ import annotations

import pytest

from verispec.certify.core import CertificationCase, certify_case, negative_controls
from verispec.config import SamplingParams
from verispec.verify.broken import BROKEN_RULES, BonusFromDraftRule

N = 40_000


@pytest.mark.parametrize("k", [2, 4])
def test_every_negative_control_fails(k: int) -> None:
    cases = negative_controls(k)
    assert len(cases) >= 5
    assert {c.rule for c in cases} >= {cls.name for cls in BROKEN_RULES}
    for case in cases:
        result = certify_case(case, num_sequences=N, seed=300 + k)
        assert not case.claims_lossless
        assert not result.passed, f"negative control not caught: {result.as_dict()}"


@pytest.mark.parametrize("name", ["top_p", "penalties"])
def test_negative_controls_fail_under_other_sampling_params(name: str) -> None:
    params = {
        "top_p": SamplingParams(temperature=0.8, top_p=0.85),
        "penalties": SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4),
    }[name]
    for case in negative_controls(3, params):
        result = certify_case(case, num_sequences=N // 2, seed=17)
        assert not result.passed, result.as_dict()


def test_bonus_bug_is_invisible_unless_the_prefix_is_longer_than_k() -> None:
    """Why the tested prefix must be longer than K: a wrong bonus token only shows after K tokens."""
    params = SamplingParams(temperature=0.8)
    short = certify_case(CertificationCase(BonusFromDraftRule.name, "model", 3, params, 3), num_sequences=N, seed=5)
    long = certify_case(CertificationCase(BonusFromDraftRule.name, "model", 3, params, 4), num_sequences=N, seed=5)
    assert short.passed  # the defect is never observed...
    assert not long.passed  # ...until the bonus position is part of the test


def test_typical_acceptance_is_lossy_at_positive_temperature() -> None:
    case = CertificationCase("typical", "model", 2, SamplingParams(temperature=1.0), 3)
    result = certify_case(case, num_sequences=N, seed=9)
    assert not case.claims_lossless
    assert not result.passed
    assert result.as_expected
