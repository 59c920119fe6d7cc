"""Acceptance rules: given a draft and the target's laws, which tokens to keep.

- :class:`RejectionRule` — lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).
- :class:`GreedyRule` — argmax matching, lossless for greedy decoding.
- :class:`TypicalRule` — Medusa typical acceptance (Cai et al. 2024), LOSSY, opt-in only.

:mod:`verispec.verify.reference` holds slow obvious versions for tests; :mod:`verispec.verify.broken`
holds deliberately wrong rules, the negative controls of certification.
"""

from verispec.config import SpecConfig
from verispec.verify.base import PAD_ID, AcceptanceRule, Draft, Verdict, check_inputs
from verispec.verify.greedy import GreedyRule
from verispec.verify.rejection import RejectionRule
from verispec.verify.typical import TypicalRule

__all__ = [
    "PAD_ID",
    "AcceptanceRule",
    "Draft",
    "GreedyRule",
    "RejectionRule",
    "TypicalRule",
    "Verdict",
    "check_inputs",
    "make_rule",
]


def make_rule(config: SpecConfig, *, check_values: bool = True) -> AcceptanceRule:
    """The acceptance rule a :class:`~verispec.config.SpecConfig` names (typical needs allow_lossy)."""
    if config.rule == "greedy":
        return GreedyRule(check_values=check_values)
    if config.rule == "typical":
        return TypicalRule(config.typical_epsilon, config.typical_delta, check_values=check_values)
    return RejectionRule(check_values=check_values)
