"""Typical acceptance (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", section 2.3.1). LOSSY: the output is NOT distributed as the target.

A draft token ``x`` is accepted iff ``target_probs(x) > min(epsilon, delta * exp(-H(target_probs)))``
where ``H`` is the entropy (nats) of the target's law at that position: a confident target sets a
high bar, an uncertain one a low bar. The first failing position, or the position after the last
draft token, emits a token sampled from the target's law there (no residual correction). At
temperature 0 it agrees with greedy verification; above it, it trades fidelity for acceptance.

Anything that uses this rule must be opted into explicitly (``SpecConfig(allow_lossy=True)``,
``--allow-lossy``) and label its results lossy: the class attribute ``lossless`` is False.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.errors import ConfigError
from verispec.sampling import greedy_mask, pick, uniform_draws
from verispec.verify.base import Draft, Verdict, assemble, check_inputs, gather_at


def typical_threshold(target_probs: Tensor, epsilon: float, delta: float) -> Tensor:
    """``min(epsilon, delta * exp(-H))`` for each law in ``target_probs`` ``[..., V]`` (float64)."""
    entropy = torch.special.entr(target_probs).sum(dim=-1).to(torch.float64)  # [...]
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


class TypicalRule:
    """Medusa typical acceptance (lossy). Defaults ``epsilon = 0.09``, ``delta = 0.3`` (Medusa's)."""

    lossless: ClassVar[bool] = False
    name: ClassVar[str] = "typical"

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3, *, check_values: bool = True) -> None:
        if not 0.0 < epsilon <= 1.0:
            raise ConfigError(f"typical acceptance epsilon must be in (0, 1], got {epsilon}")
        if not 0.0 < delta < float("inf"):  # also rejects NaN, which compares False to everything
            raise ConfigError(f"typical acceptance delta must be finite and > 0, got {delta}")
        self.epsilon = epsilon
        self.delta = delta
        self.check_values = check_values

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        check_inputs(draft, target_probs, generators, check_values=self.check_values)
        batch, k = draft.token_ids.shape
        device = target_probs.device
        _, u_final = uniform_draws(generators, [0] * batch, 0, device)  # [B] f64: no acceptance uniforms
        valid = torch.arange(k, device=device).unsqueeze(0) < draft.num_tokens.unsqueeze(1)
        p_x = gather_at(target_probs[:, :k], draft.token_ids)  # [B, K] f64
        accept = (p_x > typical_threshold(target_probs[:, :k], self.epsilon, self.delta)) & valid
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
        p_n = target_probs[torch.arange(batch, device=device), num_accepted]  # [B, V]
        final = pick(p_n, u_final, greedy_mask(generators, device))
        return Verdict(assemble(draft.token_ids, num_accepted, final), num_accepted)
