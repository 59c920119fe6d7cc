"""Speculation statistics, as data (printing belongs to the CLI, server and benchmarks).

Definitions follow vLLM's spec-decode metrics (``vllm/v1/spec_decode/metrics.py``) and Spec-Bench:

- ``num_drafts``: verification steps that checked at least one draft token;
- ``num_draft_tokens`` / ``num_accepted_tokens``: draft tokens proposed / accepted;
- ``accepted_per_pos[i]``: steps whose first ``i + 1`` draft tokens were all accepted;
- ``drafted_per_pos[i]``: steps that drafted at least ``i + 1`` tokens (with a draft length chosen
  per step, position ``i + 1`` is not drafted in every step: ``accepted_per_pos[i] /
  drafted_per_pos[i]`` is its acceptance where it was drafted);
- ``num_rejected``: steps that ended at a rejected draft token (the others accepted every one);
  both count draft tokens, so for trees (every node counted) they describe chains only;
- acceptance rate AR = accepted / drafted;
- mean acceptance length AL = 1 + accepted / drafts: output tokens per step, the recovered or
  bonus token included.

Trees add Sequoia's positional acceptance (Chen et al. 2024): ``rank_reached[i]`` counts the
accepted nodes (and step roots) that had a child of rank ``i`` (the ``i``-th child in draft
order) verified, ``rank_accepted[i]`` how often that child was the one accepted; their ratio
estimates ``p_(i+1)``, the input of :func:`verispec.analysis.optimal_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SpecStats:
    """Counters of one request, or of many merged together."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    num_rejected: int = 0
    # accepted_histogram[n]: steps that accepted exactly n draft tokens.
    accepted_histogram: list[int] = field(default_factory=list)
    # trees: visits of a node with a child of rank i verified, and acceptances of that child
    rank_reached: list[int] = field(default_factory=list)
    rank_accepted: list[int] = field(default_factory=list)
    # drafts that cost no model pass (a composite's lookup), counted in the totals above as well
    num_free_drafts: int = 0
    num_free_draft_tokens: int = 0
    num_free_accepted_tokens: int = 0

    def observe_tree(self, parents: Sequence[int], path: Sequence[int]) -> None:
        """Record which child was accepted at each node of one tree step's accepted ``path``
        (node indices, root first) for a tree with these ``parents`` (-1: the root)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        node = -1
        for depth in range(len(path) + 1):
            kids = children.get(node, [])
            _grow(self.rank_reached, len(kids))
            _grow(self.rank_accepted, len(kids))
            for rank in range(len(kids)):
                self.rank_reached[rank] += 1
            if depth == len(path):
                break
            node = path[depth]
            if node not in kids:
                raise ValueError(f"accepted node {node} is not a child of node {path[depth - 1] if depth else -1}")
            self.rank_accepted[kids.index(node)] += 1

    def observe(self, num_draft_tokens: int, num_accepted: int, free: bool = False) -> None:
        """Record one verification step that drafted ``num_draft_tokens`` and accepted ``num_accepted``
        (``free``: a draft that cost no model pass, a composite's lookup)."""
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} draft tokens is impossible")
        if num_draft_tokens == 0:
            return
        if free:
            self.num_free_drafts += 1
            self.num_free_draft_tokens += num_draft_tokens
            self.num_free_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_rejected += int(num_accepted < num_draft_tokens)
        _grow(self.accepted_per_pos, num_draft_tokens)
        _grow(self.drafted_per_pos, num_draft_tokens)
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.drafted_per_pos[i] += 1
        _grow(self.accepted_histogram, num_accepted + 1)
        self.accepted_histogram[num_accepted] += 1

    def observe_batch(self, num_draft_tokens: Sequence[int], num_accepted: Sequence[int]) -> None:
        for drafted, accepted in zip(num_draft_tokens, num_accepted, strict=True):
            self.observe(drafted, accepted)

    def observe_tensors(self, num_draft_tokens: Tensor, num_accepted: Tensor) -> None:
        """Record one step of a batch at once: ``[B]`` int64 each (one host sync)."""
        drafted = num_draft_tokens > 0
        k = int(num_draft_tokens.max()) if num_draft_tokens.numel() else 0
        if k == 0:
            return
        accepted, lengths = num_accepted[drafted], num_draft_tokens[drafted]
        positions = torch.arange(k, device=accepted.device).unsqueeze(0)  # [1, k]
        per_pos = (positions < accepted.unsqueeze(1)).sum(0)
        reached = (positions < lengths.unsqueeze(1)).sum(0)
        hist = torch.bincount(accepted, minlength=k + 1)
        self.num_drafts += int(drafted.sum())
        self.num_draft_tokens += int(num_draft_tokens.sum())
        self.num_accepted_tokens += int(accepted.sum())
        self.num_rejected += int((accepted < lengths).sum())
        _grow(self.accepted_per_pos, k)
        _grow(self.drafted_per_pos, k)
        _grow(self.accepted_histogram, k + 1)
        for i, v in enumerate(per_pos.tolist()):
            self.accepted_per_pos[i] += v
        for i, v in enumerate(reached.tolist()):
            self.drafted_per_pos[i] += v
        for i, v in enumerate(hist.tolist()):
            self.accepted_histogram[i] += v

    def merge(self, other: SpecStats) -> SpecStats:
        """A new SpecStats holding both sets of counts."""
        out = SpecStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            num_rejected=self.num_rejected + other.num_rejected,
            num_free_drafts=self.num_free_drafts + other.num_free_drafts,
            num_free_draft_tokens=self.num_free_draft_tokens + other.num_free_draft_tokens,
            num_free_accepted_tokens=self.num_free_accepted_tokens + other.num_free_accepted_tokens,
        )
        for mine, theirs, target in (
            (self.accepted_per_pos, other.accepted_per_pos, out.accepted_per_pos),
            (self.drafted_per_pos, other.drafted_per_pos, out.drafted_per_pos),
            (self.accepted_histogram, other.accepted_histogram, out.accepted_histogram),
            (self.rank_reached, other.rank_reached, out.rank_reached),
            (self.rank_accepted, other.rank_accepted, out.rank_accepted),
        ):
            _grow(target, max(len(mine), len(theirs)))
            for i, v in enumerate(mine):
                target[i] += v
            for i, v in enumerate(theirs):
                target[i] += v
        return out

    @property
    def acceptance_rate(self) -> float:
        """AR = accepted / drafted (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """AL = 1 + accepted / drafts: output tokens per verification step, bonus counted."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of draft steps whose first ``i + 1`` tokens were all accepted."""
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    @property
    def acceptance_where_drafted(self) -> list[float]:
        """Fraction of the steps that drafted position ``i + 1`` whose first ``i + 1`` tokens were all
        accepted (equal to :attr:`acceptance_per_position` when every step drafts as many)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)]

    @property
    def alpha(self) -> float | None:
        """The per-token acceptance rate of the i.i.d. model of Leviathan et al. (2023), fitted by
        maximum likelihood to the chains verified: a step that drafted ``k`` tokens and accepted
        ``n`` saw ``n`` acceptances and, when ``n < k``, one rejection, so the estimate is accepted /
        (accepted + rejected steps), whatever draft length each step chose. None without drafts."""
        seen = self.num_accepted_tokens + self.num_rejected
        return self.num_accepted_tokens / seen if seen else None

    @property
    def positional_acceptance(self) -> list[float]:
        """Trees: the share of verified rank-``i`` children that were accepted (``p_(i+1)``)."""
        return [a / r if r else 0.0 for a, r in zip(self.rank_accepted, self.rank_reached, strict=True)]

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "drafted_per_pos": list(self.drafted_per_pos),
            "num_rejected": self.num_rejected,
            "accepted_histogram": list(self.accepted_histogram),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "rank_reached": list(self.rank_reached),
            "rank_accepted": list(self.rank_accepted),
            "positional_acceptance": self.positional_acceptance,
            "num_free_drafts": self.num_free_drafts,
            "num_free_draft_tokens": self.num_free_draft_tokens,
            "num_free_accepted_tokens": self.num_free_accepted_tokens,
        }


def _grow(values: list[int], size: int) -> None:
    if len(values) < size:
        values.extend([0] * (size - len(values)))
