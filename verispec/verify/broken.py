"""Deliberately WRONG acceptance rules: the negative controls of certification.

A certification that never fails proves nothing. Each class here is :class:`RejectionRule` with
exactly one step broken, in a way seen in real implementations; :mod:`verispec.certify.core` must reject
every one of them with the same test (same sample sizes, same significance level) that the real
rules pass. Never use them to generate text. (The fourth classic bug, a drafter whose reported
``draft_probs`` are not the law it sampled from, lives on the drafter side:
:class:`verispec.certify.toy.MisreportingToyDrafter`.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.verify.base import Draft, Verdict, check_inputs
from verispec.verify.rejection import RejectionRule
from verispec.verify.tree import MultiRoundRule, walk


class AlwaysAcceptRule(RejectionRule):
    """Accepts every draft token: the output follows the DRAFT's law."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "broken-always-accept"

    def _accept(self, u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
        return torch.ones_like(u, dtype=torch.bool)


class ResidualIsTargetRule(RejectionRule):
    """Draws the recovered token from the target law instead of the residual max(0, p - q)."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "broken-residual-is-target"

    def _recovered_law(self, p_n: Tensor, q_n: Tensor) -> Tensor:
        return p_n


class BonusFromDraftRule(RejectionRule):
    """Draws the bonus token from the drafter's (last) law instead of the target's."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "broken-bonus-from-draft"

    def _bonus_law(self, p_n: Tensor, last_draft_law: Tensor) -> Tensor:
        return last_draft_law


class OffByOneRule(RejectionRule):
    """Judges draft token i against the target's law for position i + 1 (a shifted logits slice)."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "broken-off-by-one"

    def _target_at_draft(self, target_probs: Tensor) -> Tensor:
        return target_probs[:, 1:]


class SiblingMassLeftRule(MultiRoundRule):
    """A tree rule that, after rejecting a child, tries its siblings against the unchanged
    residual: the rejected child's draft mass is never taken off, so the siblings are accepted
    too often."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "broken-sibling-mass-left"

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        check_inputs(draft, target_probs, generators, check_values=self.check_values, trees=True)
        return walk(draft, target_probs, generators, draft.children, keep_rejected_mass=True)


BROKEN_RULES: tuple[type[RejectionRule], ...] = (
    AlwaysAcceptRule,
    ResidualIsTargetRule,
    BonusFromDraftRule,
    OffByOneRule,
)
