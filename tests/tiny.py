"""Tiny models and tokenizers built in code, for tests (nothing is ever downloaded)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from verispec.certify.tiny import tiny_config, tiny_pair
from verispec.engine.policy import MeasuredPolicy
from verispec.engine.request import Request
from verispec.formats.tokenizer import Tokenizer

__all__ = ["ModelOffPolicy", "ThresholdStopPolicy", "byte_tokenizer", "tiny_config", "tiny_pair"]


class ModelOffPolicy(MeasuredPolicy):
    """A measured policy that schedules the draft model no token on any step (K = 0 everywhere),
    so that only a drafter's free drafts (a composite's lookup, within the policy's ceilings) run."""

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        return [0] * len(budgets)


class ThresholdStop:
    """A draft stop (``verispec.drafters.base.DraftStop``) that ends a row's draft after a token
    whose confidence is below ``threshold``, else at the row's ceiling; counts what it did."""

    def __init__(self, policy: ThresholdStopPolicy, lengths: Sequence[int]) -> None:
        self.policy = policy
        self.lengths = list(lengths)
        self.ended: set[int] = set()  # rows ended by a doubtful token before their ceiling

    def keep_drafting(self, row: int, drafted: int, confidence: float) -> bool:
        if drafted >= self.lengths[row]:
            return False
        if confidence < self.policy.threshold:
            self.ended.add(row)
            self.policy.ended += 1
            return False
        self.policy.continued += 1
        return True

    def settle(self, drafted: Sequence[int], accepted: Sequence[int], skip: Sequence[bool]) -> None:
        self.policy.settled += 1


class ThresholdStopPolicy(MeasuredPolicy):
    """Every row drafts up to ``k`` tokens, its draft ended after any token whose draft confidence
    is below ``threshold`` (:class:`ThresholdStop`): both ways of a draft stop, often, for the
    certification of the drafters that honour one."""

    def __init__(self, k: int, threshold: float) -> None:
        super().__init__(k)
        self.k, self.threshold = k, threshold
        self.ended = self.continued = self.settled = 0
        self.last: ThresholdStop | None = None

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        return [max(0, min(self.k, b)) for b in budgets]

    def draft_stop(self, batch: Sequence[Request], lengths: Sequence[int], budgets: Sequence[int]) -> ThresholdStop:  # type: ignore[override]
        self.last = ThresholdStop(self, lengths)
        return self.last


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with 256 byte tokens and no merges, plus <eos> = 256."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token_id=backend.token_to_id("<eos>"))


def feed_tree_by_levels(model: object, parents: list[int], nodes: list[int], prompt: list[int]) -> torch.Tensor:
    """Feed one tree to ``model`` after ``prompt`` the way a tree drafter grows it: level by level,
    each level's nodes after the earlier levels' (already cached) under a window mask that shows
    each node its ancestors. Returns the logits ``[N, V]`` of every node, in node order."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    cache = model.new_cache(1, len(prompt) + len(nodes) + 4)  # type: ignore[attr-defined]
    model(torch.tensor([prompt]), None, cache)  # type: ignore[operator]
    cached: list[int] = []
    out: dict[int, torch.Tensor] = {}
    for level in range(1, max(depth) + 1):
        new = [i for i, d in enumerate(depth) if d == level]
        window = torch.zeros((1, len(new), len(cached) + len(new)), dtype=torch.bool)
        for t, i in enumerate(new):
            a = parents[i]
            while a >= 0:
                window[0, t, cached.index(a)] = True
                a = parents[a]
        positions = torch.tensor([[len(prompt) + depth[i] - 1 for i in new]])
        logits = model(torch.tensor([[nodes[i] for i in new]]), positions, cache, window)[0]  # type: ignore[operator]
        for t, i in enumerate(new):
            out[i] = logits[t]
        cached += new
    return torch.stack([out[i] for i in range(len(nodes))])
