"""Certification of the lossless rules: every configuration must pass the chi-square test against
the target's exact law (alpha = 1e-6, fixed seeds, tested prefix K + 2: a fully accepted draft, its
bonus token and the next step's first token are inside it)."""

from __future__ import annotations

import pytest

from verispec.certify.core import (
    DEFAULT_ALPHA,
    CertificationCase,
    ToySetup,
    certify_case,
    certify_sampler,
    grid,
)
from verispec.certify.toy import exact_prefix_law, generate
from verispec.config import SamplingParams
from verispec.verify import RejectionRule

N = 40_000

SAMPLING = {
    "plain": SamplingParams(),
    "temperature": SamplingParams(temperature=0.6),
    "hot": SamplingParams(temperature=1.6),
    "top_k": SamplingParams(top_k=2),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.3),
    "combined": SamplingParams(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05),
    "penalties": SamplingParams(repetition_penalty=1.4, presence_penalty=0.4, frequency_penalty=0.3),
    "logit_bias": SamplingParams(logit_bias={1: 1.5, 3: float("-inf")}),
}


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name", list(SAMPLING))
def test_rejection_rule_with_model_drafter_is_lossless(k: int, name: str) -> None:
    case = CertificationCase("rejection", "model", k, SAMPLING[name], k + 2)
    result = certify_case(case, num_sequences=N, seed=100 + k)
    assert case.observes_bonus
    assert result.passed, result.as_dict()
    assert 0.0 < result.acceptance_rate < 1.0  # both the accept and the reject paths were taken


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["plain", "temperature", "top_p", "penalties"])
def test_rejection_rule_with_point_mass_drafts_is_lossless(k: int, name: str) -> None:
    case = CertificationCase("rejection", "point-mass", k, SAMPLING[name], k + 2)
    result = certify_case(case, num_sequences=N, seed=200 + k)
    assert result.passed, result.as_dict()


def test_far_draft_and_second_order_model() -> None:
    setup = ToySetup(vocab_size=3, order=2, distance=2.5, seed=5, prompt=(0, 1))
    case = CertificationCase("rejection", "model", 3, SamplingParams(temperature=0.9, top_p=0.95), 5)
    result = certify_case(case, setup, num_sequences=N, seed=7)
    assert result.passed, result.as_dict()
    assert result.acceptance_rate < 0.7


@pytest.mark.parametrize("rule", ["greedy", "rejection", "typical"])
def test_greedy_decoding_is_exact_for_every_rule(rule: str) -> None:
    case = CertificationCase(rule, "model", 3, SamplingParams(temperature=0.0), 5)
    result = certify_case(case, num_sequences=2_000, seed=3)
    assert case.claims_lossless
    assert result.passed
    assert result.gof.tv_distance == 0.0  # a point mass, hit every time


def test_plain_sampling_through_the_rule_matches_the_exact_law() -> None:
    """K = 0 (no drafter) is plain sampling: the positive control of the harness itself."""
    setup = ToySetup()
    target, _ = setup.pair()
    params = SamplingParams(temperature=0.8, top_k=3)
    law = exact_prefix_law(target, params, 4, setup.prompt)

    def sampler(n: int, seed: int):  # type: ignore[no-untyped-def]
        return generate(target, None, RejectionRule(), params, k=0, num_sequences=n, prefix_len=4, seed=seed).tokens

    gof = certify_sampler(sampler, law, target.vocab_size, num_sequences=N, seed=11)
    assert gof.p_value >= DEFAULT_ALPHA


def test_default_grid_observes_bonus_tokens() -> None:
    cases = grid()
    assert cases and all(c.prefix_len > c.k for c in cases)
