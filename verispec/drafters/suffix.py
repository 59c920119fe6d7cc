"""Suffix drafting: a tree of the continuations that followed the current suffix before
(SuffixDecoding, Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications"), over the request's own prompt and output and the outputs of earlier requests.

Where prompt lookup (:mod:`verispec.drafters.ngram`) proposes the one continuation of the most
recent match, this drafter gathers every earlier occurrence of the longest matching suffix (up to
``max_matches``, the most recent first) and proposes the likeliest nodes of the trie of their
next ``depth`` tokens (:mod:`verispec.drafters.trie`: share of the matches through a node at
least ``min_share``, at most ``max_nodes`` nodes, and at most ``spec_factor`` times the match's
length: so a frequent, long match drafts a deep tree and a short or rare one a short guess; the
draft's size adapts to the match's statistics, as SuffixDecoding's does). The candidates do not
depend on any randomness: they are ``"fixed"`` children, verified by recursive point-mass
acceptance, which keeps the target's law.

Memory: each request indexes its own tokens (n-gram -> the positions after its occurrences, the
last ``max_matches`` kept); finished requests' outputs join a shared corpus of at most
``corpus_tokens`` tokens (the oldest leave first), indexed the same way. A tree costs nothing to
draft (no model); its nodes cost target rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from verispec.drafters.base import BatchView
from verispec.drafters.trie import Occurrences, OwnTokens, best_continuations, tree_draft
from verispec.errors import ConfigError, InputError
from verispec.verify.base import Draft


class SuffixDrafter:
    """Trees of earlier continuations of the current suffix (see the module docstring)."""

    name: ClassVar[str] = "suffix"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = False
    last_catchup_tokens: int = 0  # no model state to catch up

    def __init__(
        self,
        *,
        min_n: int = 2,
        max_n: int = 8,
        depth: int = 8,
        max_nodes: int = 16,
        min_share: float = 0.1,
        max_matches: int = 32,
        corpus_tokens: int = 1_000_000,
        spec_factor: float = 2.0,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"suffix sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if depth < 1 or max_nodes < 1 or max_matches < 1 or corpus_tokens < 0:
            raise ConfigError("suffix drafter: depth, max_nodes and max_matches must be >= 1, corpus_tokens >= 0")
        if not 0.0 < min_share <= 1.0:
            raise ConfigError(f"min_share must be in (0, 1], got {min_share}")
        if not 0.0 < spec_factor < float("inf"):
            raise ConfigError(f"spec_factor must be a number > 0, got {spec_factor}")
        self.spec_factor = spec_factor
        self.min_n, self.max_n, self.depth, self.max_nodes = min_n, max_n, depth, max_nodes
        self.min_share, self.max_matches, self.corpus_tokens = min_share, max_matches, corpus_tokens
        self._own: dict[str, OwnTokens] = {}
        self._corpus = Occurrences(min_n, max_n, max_matches)
        self._corpus_seqs: dict[int, list[int]] = {}
        self._corpus_order: deque[int] = deque()
        self._corpus_size = 0
        self._next_id = 1  # 0: the request's own tokens

    # ------------------------------------------------------------------------------ lifecycle
    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._own:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        self._own[request_id] = OwnTokens(prompt_ids, self.min_n, self.max_n, self.max_matches)

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self._get(request_id)  # the tokens arrive through the request's own list

    def end(self, request_id: str) -> None:
        entry = self._own.pop(request_id, None)
        if entry is None or self.corpus_tokens == 0:
            return
        tokens = list(entry.tokens)
        if not tokens:
            return
        tokens = tokens[-self.corpus_tokens :]
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._corpus_seqs[seq_id] = tokens
        self._corpus_order.append(seq_id)
        self._corpus_size += len(tokens)
        self._corpus.add(seq_id, tokens, 0, len(tokens))
        while self._corpus_size > self.corpus_tokens and self._corpus_order:
            old = self._corpus_order.popleft()
            gone = self._corpus_seqs.pop(old)
            self._corpus_size -= len(gone)
            self._corpus.remove(old, gone)

    def _get(self, request_id: str) -> OwnTokens:
        try:
            return self._own[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() before propose()/observe()") from None

    # ------------------------------------------------------------------------------- drafting
    def tree(self, request_id: str, budget: int) -> tuple[list[int], list[int]]:
        """The tokens and parents (-1: the root) of the tree for one request, at most ``budget``
        nodes, parents first."""
        own = self._get(request_id)
        tokens = own.tokens
        budget = min(budget, self.max_nodes)
        if budget <= 0:
            return [], []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) < n:
                continue
            key = tuple(tokens[-n:])
            corpus = list(self._corpus.tables[n].get(key, ()))
            starts = corpus + [(0, pos) for pos in own.starts(n)]  # oldest first
            if starts:  # a draft of at most spec_factor x the match's length (SuffixDecoding's adaptive size)
                size = min(budget, max(1, round(self.spec_factor * n)))
                return self._best_nodes(tokens, starts[-self.max_matches :], size)
        return [], []

    def _best_nodes(
        self, tokens: Sequence[int], starts: list[tuple[int, int]], budget: int
    ) -> tuple[list[int], list[int]]:
        continuations = (
            (tokens if seq_id == 0 else self._corpus_seqs[seq_id])[start : start + self.depth]
            for seq_id, start in starts
        )
        return best_continuations(continuations, budget, self.min_share)

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        room = batch.room if batch.room is not None else [self.max_nodes] * len(batch)
        trees = [
            self.tree(rid, min(r, self.max_nodes)) if k > 0 else ([], [])
            for rid, k, r in zip(batch.request_ids, max_tokens, room, strict=True)
        ]
        return tree_draft(trees)
