"""Prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram proposer,
llama.cpp's lookup decoding): find the longest suffix of the context (between ``min_n`` and
``max_n`` tokens) that occurred earlier in the context, and propose the tokens that followed its
most recent earlier occurrence. Free to run, strong wherever the output repeats the input
(summaries, code edits, retrieval-augmented answers).

Drafts are point masses (``Draft.probs is None``): the rejection rule accepts a draft token ``x``
with probability ``target_probs(x)``, which keeps the output exactly the target's.

Index: per request and per n, a dict from each n-gram to the position right after its most recent
occurrence, updated incrementally as tokens are committed: a lookup costs ``max_n - min_n + 1``
dict probes however long the context grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from verispec.drafters.base import BatchView
from verispec.errors import ConfigError, InputError
from verispec.verify.base import Draft


class _Index:
    """n-gram -> start of its continuation, for every n in [min_n, max_n], over one sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: Sequence[int] = ()  # the request's token list (read, never copied)
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # n-grams ending before this position are indexed. The n-grams ending at the last token
        # are indexed only once another token follows, so a lookup never finds its own suffix.
        self.indexed_end = 0

    def _sync(self) -> None:
        last = len(self.tokens) - 1  # index n-grams ending at positions < last
        toks = self.tokens
        for end in range(self.indexed_end, last):
            for n, table in self.tables.items():
                if end + 1 >= n:
                    table[tuple(toks[end + 1 - n : end + 1])] = end + 1
        self.indexed_end = max(self.indexed_end, last)

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier match of the current suffix."""
        self._sync()
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) < n + 1:
                continue
            start = self.tables[n].get(tuple(toks[-n:]))
            if start is not None:
                return list(toks[start : start + k])
        return []


class NgramDrafter:
    """Prompt lookup with suffixes of ``min_n``..``max_n`` tokens; point-mass drafts."""

    name: ClassVar[str] = "ngram"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = False
    last_catchup_tokens: int = 0  # a lookup has no model state to catch up

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, _Index] = {}

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._index:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        index = _Index(self.min_n, self.max_n)
        index.tokens = prompt_ids
        self._index[request_id] = index

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self._state(request_id)  # the tokens arrive through the request's list; only check the id

    def end(self, request_id: str) -> None:
        self._index.pop(request_id, None)

    def lookup(self, request_id: str, k: int, *, seeded: bool = False) -> list[int]:
        """The draft for one request (up to ``k`` tokens; empty when no suffix matches), from its
        own tokens alone (so ``seeded`` changes nothing)."""
        return self._state(request_id).lookup(k) if k > 0 else []

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        drafts = [self.lookup(rid, k) for rid, k in zip(batch.request_ids, max_tokens, strict=True)]
        return Draft.from_lists(drafts)

    def _state(self, request_id: str) -> _Index:
        try:
            return self._index[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() before propose()/observe()") from None
