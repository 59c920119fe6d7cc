"""Acceptance rules: given a draft and the target's laws, which tokens to keep.

- :class:`RejectionRule` — lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023);
  tree drafts go to the tree rule matching their children (:mod:`verispec.verify.tree`).
- :class:`BlockRule` — block verification of chains (Sun et al. 2025): lossless, never fewer
  accepted tokens in expectation.
- :class:`MultiRoundRule`, :class:`WithoutReplacementRule`, :class:`PointMassTreeRule` — trees of
  i.i.d. (SpecInfer), without-replacement (Sequoia) and deterministic children.
- :class:`GreedyRule` — argmax matching (the longest argmax path of a tree), lossless for greedy decoding.
- :class:`TypicalRule` — Medusa typical acceptance (Cai et al. 2024), LOSSY, opt-in only.

:mod:`verispec.verify.reference` holds slow obvious versions for tests; :mod:`verispec.verify.broken`
holds deliberately wrong rules, the negative controls of certification.
"""

from verispec.config import SpecConfig
from verispec.verify.base import PAD_ID, AcceptanceRule, Draft, Verdict, check_inputs
from verispec.verify.block import BlockRule
from verispec.verify.greedy import GreedyRule
from verispec.verify.rejection import RejectionRule
from verispec.verify.tree import TREE_RULES, MultiRoundRule, PointMassTreeRule, WithoutReplacementRule
from verispec.verify.typical import TypicalRule

__all__ = [
    "PAD_ID",
    "AcceptanceRule",
    "BlockRule",
    "Draft",
    "GreedyRule",
    "MultiRoundRule",
    "PointMassTreeRule",
    "RejectionRule",
    "TypicalRule",
    "Verdict",
    "WithoutReplacementRule",
    "check_inputs",
    "make_rule",
]


def make_rule(config: SpecConfig, *, check_values: bool = True) -> AcceptanceRule:
    """The acceptance rule a :class:`~verispec.config.SpecConfig` names (typical needs allow_lossy)."""
    if config.rule == "greedy":
        return GreedyRule(check_values=check_values)
    if config.rule == "typical":
        return TypicalRule(config.typical_epsilon, config.typical_delta, check_values=check_values)
    if config.rule == "block":
        return BlockRule(check_values=check_values)
    if config.rule in TREE_RULES:
        return TREE_RULES[config.rule](check_values=check_values)
    return RejectionRule(check_values=check_values)
