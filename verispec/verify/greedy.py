"""Greedy verification: accept draft tokens while each equals the target's argmax (lowest id on
ties); the first mismatch, or the position after the last draft token, emits the target's argmax.

This is the rejection rule's limit for point-mass target laws (temperature 0) and needs no
randomness. It is lossless for greedy decoding: the output equals plain greedy decoding of the
target token for token. On a tree draft it takes the longest path whose every node is the
target's argmax after its parent. For temperature > 0 use :class:`~verispec.verify.RejectionRule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.sampling import mode
from verispec.verify.base import Draft, Verdict, assemble, check_inputs
from verispec.verify.tree import walk


class GreedyRule:
    """Accept while ``draft == argmax(target_probs)``; emit the target argmax at the first mismatch.

    Lossless for greedy decoding (temperature 0), where the target law is a point mass.
    Generators are accepted for interface compatibility and never used.
    """

    lossless: ClassVar[bool] = True
    name: ClassVar[str] = "greedy"

    def __init__(self, *, check_values: bool = True) -> None:
        self.check_values = check_values

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        if draft.is_tree:  # the longest path whose every node is the target's argmax after its parent
            check_inputs(draft, target_probs, generators, check_values=self.check_values, trees=True)
            return walk(draft, target_probs, [None] * draft.batch_size, "fixed")
        check_inputs(draft, target_probs, generators, check_values=self.check_values)
        k = draft.token_ids.shape[1]
        modes = mode(target_probs)  # [B, K + 1]
        valid = torch.arange(k, device=modes.device).unsqueeze(0) < draft.num_tokens.unsqueeze(1)
        accept = (draft.token_ids == modes[:, :k]) & valid  # [B, K]
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        final = modes.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
        return Verdict(assemble(draft.token_ids, num_accepted, final), num_accepted)
