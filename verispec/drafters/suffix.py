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
``corpus_tokens`` tokens (the oldest leave first), indexed the same way. A seeded sampled request
does not read the corpus: its text must not depend on what other requests wrote (README, Seeds).
A tree costs nothing to draft (no model); its nodes cost target rows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from verispec.drafters.trie import ContinuationDrafter, Occurrences
from verispec.errors import ConfigError


class SuffixDrafter(ContinuationDrafter):
    """Trees of earlier continuations of the current suffix (see the module docstring)."""

    name: ClassVar[str] = "suffix"
    elsewhere_grows: ClassVar[bool] = True  # the corpus gains each finished request's output

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
        super().__init__(
            min_n=min_n, max_n=max_n, depth=depth, max_nodes=max_nodes, min_share=min_share, max_matches=max_matches,
            spec_factor=spec_factor,
        )  # fmt: skip
        if corpus_tokens < 0:
            raise ConfigError(f"suffix drafter: corpus_tokens must be >= 0, got {corpus_tokens}")
        self.corpus_tokens = corpus_tokens
        self._corpus = Occurrences(min_n, max_n, max_matches)
        self._corpus_seqs: dict[int, list[int]] = {}
        self._corpus_order: deque[int] = deque()
        self._corpus_size = 0
        self._next_id = 1

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

    def elsewhere(self, suffix: Sequence[int]) -> list[Sequence[int]]:
        """What followed ``suffix`` in earlier requests' outputs (the most recent ``max_matches``)."""
        where = self._corpus.tables[len(suffix)].get(tuple(suffix), ())
        return [self._corpus_seqs[seq][start : start + self.depth] for seq, start in where]
