"""Certification of the tree rules and block verification on the toy pair: every rule with the
children it was made for, under every sampling setting, passes the chi-square test against the
target's exact law (alpha = 1e-6, fixed seeds, tested prefix at least the deepest path + 2, so a
fully accepted path and its bonus token are inside it); the negative controls fail the same test.
"""

from __future__ import annotations

import pytest

from tests.stats.test_certify_rules import SAMPLING as CHAIN_SAMPLING
from verispec.certify.core import CertificationCase, ToySetup, certify_case
from verispec.config import SamplingParams
from verispec.errors import ConfigError
from verispec.verify.broken import SiblingMassLeftRule

N = 20_000  # per case (the rules' one-step tests and the chain certification use 40,000)

# the chain rule's sampling settings, less its extra-hot one
SAMPLING = {name: params for name, params in CHAIN_SAMPLING.items() if name != "hot"}
# static shapes: three children at the root, two of them with children (depth 2); and a deeper
# one (depth 3) whose second root child has a child of its own
WIDE = (-1, -1, -1, 0, 1)
DEEP = (-1, -1, 0, 0, 2, 1)
RULE_FOR = {"model": "specinfer", "model-distinct": "sequoia", "point-mass": "point-mass"}


def _case(rule: str, drafter: str, tree: tuple[int, ...], params: SamplingParams) -> CertificationCase:
    probe = CertificationCase(rule, drafter, len(tree), params, 1, tree)
    return CertificationCase(rule, drafter, len(tree), params, probe.depth + 2, tree)


@pytest.mark.parametrize("drafter", list(RULE_FOR))
@pytest.mark.parametrize("name", list(SAMPLING))
def test_each_tree_rule_is_lossless_for_its_children(drafter: str, name: str) -> None:
    case = _case(RULE_FOR[drafter], drafter, WIDE, SAMPLING[name])
    result = certify_case(case, num_sequences=N, seed=400 + len(name))
    assert case.claims_lossless and case.observes_bonus
    assert result.passed, result.as_dict()
    assert 0.0 < result.acceptance_rate < 1.0


@pytest.mark.parametrize("drafter", list(RULE_FOR))
@pytest.mark.parametrize("name", ["temperature", "combined"])
def test_the_rejection_rule_picks_the_tree_rule_on_a_deeper_tree(drafter: str, name: str) -> None:
    case = _case("rejection", drafter, DEEP, SAMPLING[name])
    assert case.depth == 3
    result = certify_case(case, num_sequences=N, seed=500)
    assert result.passed, result.as_dict()
    assert result.mean_acceptance_length > 1.0


def test_trees_on_a_far_draft_and_a_second_order_model() -> None:
    setup = ToySetup(vocab_size=3, order=2, distance=2.5, seed=5, prompt=(0, 1))
    for drafter, rule in RULE_FOR.items():
        case = _case(rule, drafter, DEEP, SamplingParams(temperature=0.9, top_p=0.95))
        result = certify_case(case, setup, num_sequences=N, seed=8)
        assert result.passed, result.as_dict()


def test_greedy_trees_are_exact() -> None:
    for drafter in RULE_FOR:
        case = _case("greedy", drafter, DEEP, SamplingParams(temperature=0.0))
        result = certify_case(case, num_sequences=2_000, seed=3)
        assert result.passed and result.gof.tv_distance == 0.0


@pytest.mark.parametrize("drafter", ["model", "point-mass"])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", ["plain", "temperature", "top_p", "penalties"])
def test_block_verification_is_lossless(drafter: str, k: int, name: str) -> None:
    case = CertificationCase("block", drafter, k, SAMPLING[name], k + 2)
    result = certify_case(case, num_sequences=N, seed=600 + k)
    assert result.passed, result.as_dict()


def test_block_verification_accepts_at_least_as_much_as_token_wise() -> None:
    """The same draws-per-step budget, the same toy pair: block's acceptance length is not below
    the token-wise rule's (beyond sampling noise)."""
    params = SamplingParams(temperature=1.0)
    token = certify_case(CertificationCase("rejection", "model", 4, params, 6), num_sequences=N, seed=1)
    block = certify_case(CertificationCase("block", "model", 4, params, 6), num_sequences=N, seed=1)
    assert block.passed and token.passed
    assert block.mean_acceptance_length >= token.mean_acceptance_length - 0.02


# ---------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize("name", ["plain", "temperature", "top_p"])
def test_a_rejected_siblings_mass_left_in_the_residual_fails(name: str) -> None:
    case = _case(SiblingMassLeftRule.name, "model", WIDE, SAMPLING[name])
    assert not case.claims_lossless
    assert not certify_case(case, num_sequences=N, seed=700).passed


@pytest.mark.parametrize("name", ["plain", "temperature"])
def test_the_iid_rule_on_deterministic_children_fails(name: str) -> None:
    """Top-k children labelled as i.i.d. samples: the rule subtracts a law they were not drawn from."""
    case = _case("specinfer", "broken-topk-as-sampled", WIDE, SAMPLING[name])
    assert not case.claims_lossless
    assert not certify_case(case, num_sequences=N, seed=701).passed


def test_a_tree_rule_on_children_it_was_not_made_for_is_refused() -> None:
    for rule, drafter in (("specinfer", "point-mass"), ("sequoia", "model"), ("point-mass", "model-distinct")):
        case = _case(rule, drafter, WIDE, SAMPLING["temperature"])
        assert not case.claims_lossless
        with pytest.raises(ConfigError, match="children"):
            certify_case(case, num_sequences=100, seed=0)


def test_chain_only_rules_refuse_tree_cases() -> None:
    with pytest.raises(ConfigError, match="verifies chains"):
        CertificationCase("block", "model", 3, SAMPLING["plain"], 5, (-1, -1, 0))
