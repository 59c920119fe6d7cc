"""Lossless speculative sampling: the rejection rule of Leviathan et al. (2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1) and Chen et al. (2023, "Accelerating Large
Language Model Decoding with Speculative Sampling").

For draft token ``x`` drawn from ``draft_probs``: accept with probability
``min(1, target_probs(x) / draft_probs(x))``; at the first rejection emit a recovered token drawn
from ``norm(max(0, target_probs - draft_probs))`` and stop; if every draft token is accepted emit a
bonus token drawn from the target's law after the last draft token. Each emitted token is then
distributed exactly as ``target_probs``, whatever the drafter (the residual restores the mass the
drafter under-proposed; the drafter need not cover the target's support).

Tree drafts go to the tree rule that matches how their children were produced
(:mod:`verispec.verify.tree`), which on a chain is this rule.

Point-mass drafts (``Draft.probs is None``: n-gram lookup, greedy heads) are the case
``draft_probs = one_hot(x)``: accept with probability ``target_probs(x)``; the recovered token comes
from ``target_probs`` with ``x`` removed.

Numerics: the test is ``u * draft_probs(x) < target_probs(x)`` with ``u ~ U[0, 1)`` in float64, so
nothing is ever divided; ``draft_probs(x) = 0`` (a drafter that proposed a token it gave no mass)
is a rejection; an all-zero residual (possible only through rounding) falls back to
``target_probs``. Randomness follows the protocol in :mod:`verispec.verify.base`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.sampling import greedy_mask, mode, pick, uniform_draws
from verispec.verify.base import Draft, Verdict, assemble, check_inputs, gather_at
from verispec.verify.tree import walk


def greedy_verdict(draft: Draft, modes: Tensor) -> Verdict:
    """:meth:`RejectionRule.verify`'s verdict on a chain when every row is greedy, read off the
    target's modes ``[B, K + 1]`` (each position's largest logit, the lowest id on ties) instead of
    its one-hot laws: a draft token stands iff it is its position's mode, and the final token is
    the mode where the chain stops (the engine's greedy steps: no law of V ids built per position)."""
    ids, num = draft.token_ids, draft.num_tokens  # [B, K], [B]
    k = ids.shape[1]
    valid = torch.arange(k, device=ids.device).unsqueeze(0) < num.unsqueeze(1)  # [B, K]
    num_accepted = ((ids == modes[:, :k]) & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    final = modes.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B]
    return Verdict(assemble(ids, num_accepted, final), num_accepted)


class RejectionRule:
    """Lossless chain verification (Leviathan et al. 2023; Chen et al. 2023).

    ``check_values=False`` skips the content checks of the inputs (one host sync per call); the
    shape checks always run.
    """

    lossless: ClassVar[bool] = True
    name: ClassVar[str] = "rejection"

    def __init__(self, *, check_values: bool = True) -> None:
        self.check_values = check_values

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        if draft.is_tree:  # the tree rule made for how its children were produced
            check_inputs(draft, target_probs, generators, check_values=self.check_values, trees=True)
            return walk(draft, target_probs, generators, draft.children)
        check_inputs(draft, target_probs, generators, check_values=self.check_values)
        batch, k = draft.token_ids.shape
        vocab = target_probs.shape[2]
        device = target_probs.device
        ids = draft.token_ids  # [B, K]
        num = draft.num_tokens  # [B]
        # One host sync: each request draws exactly num_tokens[b] uniforms (randomness protocol).
        counts = num.tolist()
        u, u_final = uniform_draws(generators, counts, k, device)  # [B, K] f64, [B] f64
        greedy = greedy_mask(generators, device)  # [B] bool, or None: no greedy row

        valid = torch.arange(k, device=device).unsqueeze(0) < num.unsqueeze(1)  # [B, K]
        target_at_draft = self._target_at_draft(target_probs)  # [B, K, V]
        rows = torch.arange(batch, device=device)
        if greedy is not None and greedy.device.type == "cpu" and bool(greedy.all()):
            # Every row greedy (known without a device sync): the verdict is the target's modes
            # alone, as below (a draft token stands iff it is its position's mode; the final token
            # is the mode where the chain stops), without the residual and bonus laws of V ids.
            accept = (ids == mode(target_at_draft)) & valid  # [B, K]
            num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
            final = mode(target_probs[rows, num_accepted])  # [B]
            return Verdict(assemble(ids, num_accepted, final), num_accepted)
        p_x = gather_at(target_at_draft, ids)  # [B, K] f64
        q_x = gather_at(draft.probs, ids) if draft.probs is not None else torch.ones_like(p_x)
        accept = self._accept(u, p_x, q_x)  # [B, K] bool
        if greedy is not None:
            mode_match = ids == mode(target_at_draft)
            accept = torch.where(greedy.unsqueeze(1), mode_match, accept)
        accept = accept & valid
        num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

        p_n = target_probs[rows, num_accepted]  # [B, V]: target law at the first unaccepted position
        law = p_n
        if k > 0:
            sampled = ~greedy if greedy is not None else torch.ones_like(num, dtype=torch.bool)
            rejected = (num_accepted < num) & sampled  # [B]
            at = num_accepted.clamp_max(k - 1)
            q_n = self._draft_law(draft, rows, at, vocab)  # [B, V]
            last = self._draft_law(draft, rows, (num - 1).clamp_min(0), vocab)  # [B, V]
            bonus = torch.where(((num > 0) & sampled).unsqueeze(1), self._bonus_law(p_n, last), p_n)
            law = torch.where(rejected.unsqueeze(1), self._recovered_law(p_n, q_n), bonus)
        final = pick(law, u_final, greedy)  # [B]
        return Verdict(assemble(ids, num_accepted, final), num_accepted)

    @staticmethod
    def _draft_law(draft: Draft, rows: Tensor, at: Tensor, vocab: int) -> Tensor:
        """``[B, V]`` the law draft token ``at[b]`` of row ``b`` was drawn from."""
        if draft.probs is not None:
            return draft.probs[rows, at]
        token = draft.token_ids[rows, at].clamp_min(0)
        return torch.nn.functional.one_hot(token, vocab).to(torch.float32)

    # The steps below are separate methods only so that the deliberately broken rules of
    # verispec.verify.broken can change exactly one of them; nothing else overrides them.

    def _target_at_draft(self, target_probs: Tensor) -> Tensor:
        """``[B, K, V]``: the target law each draft token is judged against."""
        return target_probs[:, :-1]

    def _accept(self, u: Tensor, p_x: Tensor, q_x: Tensor) -> Tensor:
        """Accept with probability min(1, p/q): ``u * q < p``; ``q = 0`` rejects."""
        return (q_x > 0) & (u * q_x < p_x)

    def _recovered_law(self, p_n: Tensor, q_n: Tensor) -> Tensor:
        """Unnormalised ``max(0, p - q)`` (inverse-CDF sampling does not need the normaliser)."""
        residual = (p_n - q_n).clamp_min(0.0)
        has_mass = residual.sum(dim=1, keepdim=True) > 0
        return torch.where(has_mass, residual, p_n)

    def _bonus_law(self, p_n: Tensor, last_draft_law: Tensor) -> Tensor:
        """After full acceptance the bonus token comes from the target."""
        return p_n
