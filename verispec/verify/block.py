"""Block verification of a chain draft (Sun et al., "Block Verification Accelerates Speculative
Decoding", ICLR 2025): lossless, and never fewer accepted tokens in expectation than the
token-wise rule (it is optimal among rules that see only the draft's path).

Token-wise verification stops at the first rejected token; block verification decides how much
of the block to keep from the whole block. With ``b_i`` the target's law after ``i`` draft
tokens, ``s_i`` the draft's law the token after them was drawn from (a point mass for point-mass
drafts) and ``X_1 .. X_γ`` the draft:

    w_0 = 1,  w_i = min(1, w_{i-1} * b_{i-1}(X_i) / s_{i-1}(X_i))
    R_i = sum_x max(0, w_i * b_i(x) - s_i(x))            (i < γ)
    h_i = R_i / (R_i + 1 - w_i)  (0 when R_i = 0),  h_γ = w_γ
    τ = the largest i with u_i < h_i (0 if none)

and the step emits ``X_1 .. X_τ`` and one token from ``b_γ`` (τ = γ: the bonus token) or from the
residual ``norm(max(0, w_τ * b_τ - s_τ))``. With one draft token it is the token-wise rule. The
uniforms ``u_1 .. u_γ`` and the final token's uniform follow the randomness protocol of
:mod:`verispec.verify.base`; greedy rows keep the longest prefix equal to the target's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.sampling import greedy_mask, mode, pick, uniform_draws
from verispec.verify.base import Draft, Verdict, assemble, check_inputs, gather_at


def draft_laws_of(draft: Draft, vocab: int, dtype: torch.dtype) -> Tensor:
    """``[B, K, V]``: the law each draft token was drawn from (point masses for point-mass drafts)."""
    if draft.probs is not None:
        return draft.probs
    return torch.nn.functional.one_hot(draft.token_ids.clamp_min(0), vocab).to(dtype)


def block_terms(draft: Draft, target_probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The draft laws ``s`` ``[B, K, V]``, the weights ``w`` ``[B, K + 1]`` (``w[:, i]`` = w_i,
    float64) and the stopping probabilities ``h`` ``[B, K]`` float64 (``h[:, i - 1]`` = h_i, 0
    past each row's draft) of the module docstring."""
    batch, k = draft.token_ids.shape
    device = target_probs.device
    ids, num = draft.token_ids, draft.num_tokens
    pos = torch.arange(k, device=device).unsqueeze(0)  # [1, K]
    s = draft_laws_of(draft, target_probs.shape[2], target_probs.dtype)
    b_x = gather_at(target_probs[:, :-1], ids)  # [B, K] f64: b_{i}(X_{i+1})
    s_x = gather_at(s, ids)  # [B, K] f64
    weights = [torch.ones(batch, dtype=torch.float64, device=device)]  # w_0 .. w_K
    for i in range(k):
        ratio = torch.where(s_x[:, i] > 0, b_x[:, i] / s_x[:, i].clamp_min(1e-300), 0.0)
        weights.append(torch.minimum(weights[-1] * ratio, torch.ones_like(ratio)))
    w = torch.stack(weights, dim=1)  # [B, K + 1]
    h = torch.zeros((batch, k), dtype=torch.float64, device=device)
    if k > 1:  # h_i = R_i / (R_i + 1 - w_i) for i < K
        excess = w[:, 1:k].unsqueeze(2) * target_probs[:, 1:k].to(torch.float64) - s[:, 1:k].to(torch.float64)
        resid_mass = excess.clamp_min(0.0).sum(dim=2)  # [B, K - 1]: R_1 .. R_{K-1}
        denom = resid_mass + (1.0 - w[:, 1:k])
        h[:, : k - 1] = torch.where(resid_mass > 0, resid_mass / denom.clamp_min(1e-300), 0.0)
    h = torch.where(pos == (num - 1).unsqueeze(1), w[:, 1:], h)  # h_γ = w_γ
    return s, w, torch.where(pos < num.unsqueeze(1), h, 0.0)


class BlockRule:
    """Lossless chain verification that judges the draft as a block (Sun et al. 2025)."""

    lossless: ClassVar[bool] = True
    name: ClassVar[str] = "block"

    def __init__(self, *, check_values: bool = True) -> None:
        self.check_values = check_values

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        check_inputs(draft, target_probs, generators, check_values=self.check_values)
        batch, k = draft.token_ids.shape
        device = target_probs.device
        ids, num = draft.token_ids, draft.num_tokens
        u, u_final = uniform_draws(generators, num.tolist(), k, device)  # [B, K] f64, [B] f64
        greedy = greedy_mask(generators, device)
        rows = torch.arange(batch, device=device)
        pos = torch.arange(k, device=device).unsqueeze(0)  # [1, K]
        valid = pos < num.unsqueeze(1)  # [B, K]

        draft_laws, w, h = block_terms(draft, target_probs)
        hit = u < h  # [B, K] (h = 0 past the draft)
        tau = torch.where(hit, pos + 1, 0).amax(dim=1) if k > 0 else torch.zeros(batch, dtype=torch.long, device=device)

        if greedy is not None:  # greedy rows: the longest prefix equal to the target's argmax
            match = (ids == mode(target_probs[:, :-1])) & valid
            tau = torch.where(greedy, match.to(torch.int64).cumprod(dim=1).sum(dim=1), tau)

        b_tau = target_probs[rows, tau]  # [B, V]
        law = b_tau
        if k > 0:
            s_tau = draft_laws[rows, tau.clamp_max(k - 1)]
            w_tau = w[rows, tau].to(target_probs.dtype).unsqueeze(1)
            residual = (w_tau * b_tau - s_tau).clamp_min(0.0)
            residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, b_tau)
            law = torch.where((tau < num).unsqueeze(1), residual, b_tau)
        if greedy is not None:
            law = torch.where(greedy.unsqueeze(1), b_tau, law)
        final = pick(law, u_final, greedy)
        return Verdict(assemble(ids, tau, final), tau)
