"""Lossless verification of token trees, one rule per way the children were produced.

A tree draft (``Draft.parents``) proposes several continuations at once; the target scores every
node in one pass (row ``1 + i`` of ``target_probs`` is its law after node ``i``'s path). The walk
starts at the root (the last committed token) with the residual law ``r = p`` (the target's law
there) and tries the node's children in index order:

- a child ``x`` is accepted with probability ``min(1, r(x) / q(x))``, ``r`` and ``q`` normalised;
  the walk moves to it with ``r`` = the target's law after it;
- a rejected child takes its draft law off the residual: ``r <- norm(max(0, r - q))``;
- when a node has no child left, the walk stops and emits one token drawn from ``r`` (a
  recovered token if some child was rejected there, else the bonus token: ``r`` is then the
  target's law).

``q`` is what makes each rule lossless for its children (``Draft.children``):

- ``"sampled"`` (i.i.d. from the draft law ``q``): ``q`` stays the draft law for every sibling —
  the multi-round speculative sampling of SpecInfer (Miao et al. 2024, "SpecInfer: Accelerating
  Large Language Model Serving with Tree-based Speculative Inference and Verification");
- ``"distinct"`` (drawn without replacement): after a rejection the rejected token also leaves
  ``q`` (``q <- norm(q`` without ``x)``), the rule of Sequoia (Chen et al. 2024, "Sequoia:
  Scalable, Robust, and Hardware-aware Speculative Decoding") for sampling without replacement; a
  later sibling that ``q`` no longer holds (a repeat, once a filtered law's support ran out) is
  skipped, as if it were not there;
- ``"fixed"`` (deterministic candidates): ``q`` is the point mass on ``x``, so a candidate is
  accepted with its probability under the current residual, and a rejection removes it from the
  residual and renormalises (recursive point-mass acceptance).

Greedy rows (generator None) move to the child equal to the target's argmax and emit the argmax.
A rule used with children it was not made for is a :class:`~verispec.errors.ConfigError`: the
i.i.d. rule on fixed top-k children, for one, is biased (it subtracts a law the candidates were
never drawn from).

Numerics and randomness: the residual is kept unnormalised with its mass ``Z`` (``Z = 1`` for a
target law as given), so the test ``u * q(x) * Z < r(x) * Z_q`` divides nothing and, on a chain,
is exactly :class:`~verispec.verify.RejectionRule`'s ``u * q < p``: a chain through this walk gives
the chain rule's verdict bit for bit. Node ``i`` uses acceptance uniform ``i`` of its row
(:func:`verispec.sampling.uniform_draws`: ``num_tokens`` per row, then one for the final token),
whether or not the walk reaches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from verispec.errors import ConfigError
from verispec.sampling import greedy_mask, mode, pick, uniform_draws
from verispec.verify.base import PAD_ID, Draft, Verdict, check_inputs


def chain_parents(num_tokens: Tensor, k: int) -> Tensor:
    """``[B, K]`` int64: the parents of a chain (node i's parent is i - 1), ``PAD_ID`` past each
    row's ``num_tokens``."""
    pos = torch.arange(k, device=num_tokens.device).unsqueeze(0)
    return torch.where(pos < num_tokens.unsqueeze(1), pos - 1, PAD_ID).expand(num_tokens.shape[0], k).contiguous()


def path_matrix(parents: Tensor, num_tokens: Tensor) -> Tensor:
    """``[B, K + 1, K]`` bool: entry ``[b, 1 + i, j]`` is True when node ``j`` lies on the path to
    node ``i`` (itself included); row 0 (the root) and the rows past ``num_tokens`` are empty. The
    runtime's ancestor mask (:func:`~verispec.models.transformer.tree_attention_mask`) with the
    root's row on top."""
    from verispec.models.transformer import tree_attention_mask  # (the models import sampling)

    batch, k = parents.shape
    used = torch.arange(k, device=parents.device).unsqueeze(0) < num_tokens.unsqueeze(1)  # [B, K]
    on_path = tree_attention_mask(torch.where(used, parents, -1)) & used.unsqueeze(2)  # [B, K, K]
    root = torch.zeros((batch, 1, k), dtype=torch.bool, device=parents.device)
    return torch.cat([root, on_path], dim=1)


def depths(parents: Tensor, num_tokens: Tensor) -> Tensor:
    """``[B, K]`` int64: each node's depth (a child of the root is at depth 1; 0 past
    ``num_tokens``)."""
    return path_matrix(parents, num_tokens)[:, 1:].sum(dim=2)


def walk(
    draft: Draft,
    target_probs: Tensor,
    generators: Sequence[torch.Generator | None],
    kind: str,
    *,
    keep_rejected_mass: bool = False,
) -> Verdict:
    """The tree walk of this module for children of ``kind`` (inputs already checked).
    ``keep_rejected_mass`` leaves a rejected child's draft mass in the residual: WRONG, for the
    negative control of :mod:`verispec.verify.broken` only."""
    batch, k = draft.token_ids.shape
    device = target_probs.device
    ids = draft.token_ids
    num = draft.num_tokens
    parents = draft.parents if draft.parents is not None else chain_parents(num, k)
    u, u_final = uniform_draws(generators, num.tolist(), k, device)  # [B, K] f64, [B] f64
    greedy = greedy_mask(generators, device)  # [B] bool or None
    sampled = ~greedy if greedy is not None else torch.ones(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)

    cur = torch.full((batch,), -1, dtype=torch.long, device=device)  # the node the walk is at
    # [B, V] the unnormalised residual at cur, in the target laws' dtype (a chain's residual is then
    # the chain rule's max(0, p - q) bit for bit); its mass Z is 1 for a target law as given
    resid = target_probs[:, 0]
    mass = torch.ones(batch, dtype=torch.float64, device=device)
    modes = mode(target_probs[:, 0])  # [B] the target's argmax at cur (greedy rows)
    q_cur: Tensor | None = None  # [B, V] f64, "distinct": the draft law at cur less the rejected
    q_mass = torch.ones(batch, dtype=torch.float64, device=device)
    fresh = torch.ones(batch, dtype=torch.bool, device=device)  # no child of cur tried yet
    path = torch.full((batch, k), PAD_ID, dtype=torch.long, device=device)
    depth = torch.zeros(batch, dtype=torch.long, device=device)

    for j in range(k):
        tried = (j < num) & (parents[:, j] == cur)  # [B]: node j is a child of where the walk is
        x = ids[:, j].clamp_min(0)  # [B]
        r_x = resid.gather(1, x.unsqueeze(1)).squeeze(1).to(torch.float64)  # [B]
        if kind == "fixed":
            q_x = torch.ones_like(r_x)
            q_z = torch.ones_like(r_x)
        else:
            assert draft.probs is not None
            law = draft.probs[:, j]  # [B, V] the draft law node j was drawn from
            if kind == "distinct":
                q_cur = law.clone() if q_cur is None else torch.where(fresh.unsqueeze(1), law, q_cur)
                q_mass = torch.where(fresh, 1.0, q_mass)
                law = q_cur
            q_x = law.gather(1, x.unsqueeze(1)).squeeze(1).to(torch.float64)
            q_z = q_mass
            if kind == "distinct":  # a later sibling the draft law no longer holds (its support ran
                tried = tried & (fresh | (q_x > 0) | ~sampled)  # out): not a draw without replacement, skipped
        accept_s = (q_x > 0) & (u[:, j] * q_x * mass < r_x * q_z)
        accept = torch.where(sampled, accept_s, x == modes) & tried  # [B]
        reject = tried & ~accept & sampled
        fresh = fresh & ~tried
        if bool(reject.any()) and not keep_rejected_mass:
            z = mass.to(resid.dtype).unsqueeze(1)
            if kind == "fixed":
                resid_new = (resid - torch.nn.functional.one_hot(x, resid.shape[1]).to(resid.dtype) * z).clamp_min(0.0)
            else:
                # r / Z - q / Z_q, times Z Z_q (any positive scale will do: mass tracks it)
                resid_new = (resid * q_z.to(resid.dtype).unsqueeze(1) - law.to(resid.dtype) * z).clamp_min(0.0)
            resid = torch.where(reject.unsqueeze(1), resid_new, resid)
            mass = torch.where(reject, resid_new.sum(dim=1, dtype=torch.float64), mass)
            if kind == "distinct" and q_cur is not None:
                q_cur = torch.where(reject.unsqueeze(1), q_cur.scatter(1, x.unsqueeze(1), 0.0), q_cur)
                q_mass = torch.where(reject, (q_mass - q_x).clamp_min(0.0), q_mass)
        if bool(accept.any()):
            at = target_probs[:, j + 1]
            resid = torch.where(accept.unsqueeze(1), at, resid)
            mass = torch.where(accept, 1.0, mass)
            modes = torch.where(accept, mode(at), modes)
            path[rows, depth.clamp_max(k - 1)] = torch.where(accept, j, path[rows, depth.clamp_max(k - 1)])
            depth = depth + accept.to(torch.long)
            cur = torch.where(accept, j, cur)
            fresh = fresh | accept

    # A residual that rounding emptied falls back to the target's law at the node.
    at_cur = target_probs[rows, cur + 1]
    law = torch.where((resid.sum(dim=1) > 0).unsqueeze(1), resid, at_cur)
    final = pick(law, u_final, greedy)  # [B]
    tokens = torch.where(path >= 0, ids.gather(1, path.clamp_min(0)), PAD_ID)  # [B, K]
    out = torch.cat([tokens, torch.full((batch, 1), PAD_ID, dtype=torch.long, device=device)], dim=1)
    out = out.scatter(1, depth.unsqueeze(1), final.unsqueeze(1))
    return Verdict(out, depth, path)


class TreeRule:
    """Verifies tree (and chain) drafts whose children were produced as ``kind`` says."""

    lossless: ClassVar[bool] = True
    name: ClassVar[str] = "tree"
    kind: ClassVar[str] = ""

    def __init__(self, *, check_values: bool = True) -> None:
        self.check_values = check_values

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
        check_inputs(draft, target_probs, generators, check_values=self.check_values, trees=True)
        if draft.children != self.kind:
            raise ConfigError(
                f"the {self.name} rule verifies {self.kind} children, but this draft's children are "
                f"{draft.children}: use {RULE_FOR[draft.children]} (or the rejection rule, which picks it)"
            )
        return walk(draft, target_probs, generators, self.kind)


class MultiRoundRule(TreeRule):
    """Children drawn i.i.d. from the draft: SpecInfer's multi-round speculative sampling."""

    name: ClassVar[str] = "specinfer"
    kind: ClassVar[str] = "sampled"


class WithoutReplacementRule(TreeRule):
    """Siblings drawn without replacement: Sequoia's rule."""

    name: ClassVar[str] = "sequoia"
    kind: ClassVar[str] = "distinct"


class PointMassTreeRule(TreeRule):
    """Deterministic candidates (top-k, n-gram, suffix, retrieval): recursive point-mass acceptance."""

    name: ClassVar[str] = "point-mass"
    kind: ClassVar[str] = "fixed"


TREE_RULES: dict[str, type[TreeRule]] = {
    cls.name: cls for cls in (MultiRoundRule, WithoutReplacementRule, PointMassTreeRule)
}
RULE_FOR = {cls.kind: name for name, cls in TREE_RULES.items()}  # the rule made for each kind of children
