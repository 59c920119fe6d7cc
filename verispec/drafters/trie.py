"""The tree a model-free drafter proposes: the likeliest nodes of a trie of earlier continuations.

Given the continuations that followed earlier occurrences of the current suffix (from the
request's own tokens, earlier outputs or a datastore), merge them into a trie that counts how many
continuations pass through each node; a node's score is that count over the number of
continuations (SuffixDecoding, Oliaro et al. 2024; REST, He et al. 2024). Nodes are taken best
first while their score is at least ``min_share`` and fewer than ``budget`` are taken, so a
frequent, long match drafts a deep tree and a rare one a short guess. A child never scores above
its parent, so parents come first; siblings come in order of score, which is their rank in the
tree (:mod:`verispec.analysis`: positional acceptance).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch

from verispec.drafters.base import BatchView, seeded_sample
from verispec.errors import ConfigError, InputError
from verispec.verify.base import Draft


def best_continuations(
    continuations: Iterable[Sequence[int]], budget: int, min_share: float
) -> tuple[list[int], list[int]]:
    """The tokens and parents (-1: the root, i.e. the last committed token) of the at most
    ``budget`` likeliest trie nodes of ``continuations``, parents first; ties by first appearance."""
    trie_token: list[int] = [-1]
    trie_parent: list[int] = [-1]
    trie_count: list[int] = [0]
    trie_children: list[dict[int, int]] = [{}]
    for seq in continuations:
        trie_count[0] += 1
        node = 0
        for tok in seq:
            child = trie_children[node].get(tok)
            if child is None:
                child = len(trie_token)
                trie_token.append(tok)
                trie_parent.append(node)
                trie_count.append(0)
                trie_children.append({})
                trie_children[node][tok] = child
            trie_count[child] += 1
            node = child
    total = trie_count[0]
    if total == 0 or budget <= 0:
        return [], []
    order = sorted(range(1, len(trie_token)), key=lambda i: (-trie_count[i], i))
    chosen: dict[int, int] = {0: -1}  # trie node -> draft node index (-1: the root)
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for node in order:
        if len(out_tokens) >= budget or trie_count[node] / total < min_share:
            break
        if trie_parent[node] not in chosen:
            continue  # its parent was not taken (a tie broke the other way)
        chosen[node] = len(out_tokens)
        out_tokens.append(trie_token[node])
        out_parents.append(chosen[trie_parent[node]])
    return out_tokens, out_parents


def majority_path(continuations: Sequence[Sequence[int]], limit: int, min_share: float) -> list[int]:
    """The trie path of ``continuations`` taking at each depth the token most of them continue
    with (the lowest id on ties), while its count is at least ``min_share`` of all of them; at most
    ``limit`` tokens."""
    path: list[int] = []
    alive = list(continuations)
    total = len(alive)
    while len(path) < limit and alive:
        depth = len(path)
        counts: dict[int, int] = {}
        for seq in alive:
            if len(seq) > depth:
                counts[seq[depth]] = counts.get(seq[depth], 0) + 1
        if not counts:
            break
        token, count = min(counts.items(), key=lambda tc: (-tc[1], tc[0]))
        if count < min_share * total:
            break
        path.append(token)
        alive = [seq for seq in alive if len(seq) > depth and seq[depth] == token]
    return path


class Occurrences:
    """n-gram -> the (sequence, position after it) of its last ``keep`` occurrences, n in [min_n, max_n]."""

    def __init__(self, min_n: int, max_n: int, keep: int) -> None:
        self.min_n, self.max_n, self.keep = min_n, max_n, keep
        self.tables: dict[int, dict[tuple[int, ...], deque[tuple[int, int]]]] = {n: {} for n in range(min_n, max_n + 1)}

    def add(self, seq_id: int, tokens: Sequence[int], start: int, end: int) -> None:
        """Index the n-grams of ``tokens`` ending at positions ``start .. end - 1``."""
        for pos in range(start, end):
            for n, table in self.tables.items():
                if pos + 1 >= n:
                    key = tuple(tokens[pos + 1 - n : pos + 1])
                    where = table.get(key)
                    if where is None:
                        where = table[key] = deque(maxlen=self.keep)
                    where.append((seq_id, pos + 1))

    def remove(self, seq_id: int, tokens: Sequence[int]) -> None:
        for pos in range(len(tokens)):
            for n, table in self.tables.items():
                if pos + 1 >= n:
                    key = tuple(tokens[pos + 1 - n : pos + 1])
                    where = table.get(key)
                    if where is not None:
                        kept = deque((s, p) for s, p in where if s != seq_id)
                        if kept:
                            table[key] = deque(kept, maxlen=self.keep)
                        else:
                            del table[key]


class OwnTokens:
    """A request's own token list (the engine extends it) and an index of its n-grams, brought up
    to date when asked: where each n-gram ended before the current suffix."""

    def __init__(self, tokens: Sequence[int], min_n: int, max_n: int, keep: int) -> None:
        self.tokens = tokens
        self.index = Occurrences(min_n, max_n, keep)
        self._indexed = 0  # n-grams ending before this position are indexed

    def starts(self, n: int) -> list[int]:
        """Positions just after the earlier occurrences (the last ``keep``, oldest first) of the
        last ``n`` tokens; never the suffix itself."""
        last = len(self.tokens) - 1
        if last > self._indexed:
            self.index.add(0, self.tokens, self._indexed, last)
            self._indexed = last
        if len(self.tokens) < n or n not in self.index.tables:
            return []
        return [pos for _, pos in self.index.tables[n].get(tuple(self.tokens[-n:]), ())]


class ContinuationDrafter:
    """What the model-free tree drafters share: each request's own tokens (indexed as they grow),
    the search from the longest suffix (``max_n`` tokens) down to ``min_n`` for earlier
    occurrences, and the trie of what followed them, at most ``spec_factor`` times the matched
    length (SuffixDecoding's adaptive draft size) and ``max_nodes`` nodes. Subclasses say where
    else continuations come from (:meth:`elsewhere`): a corpus of earlier outputs, a datastore.
    Where that source grows with other requests (``elsewhere_grows``), seeded sampled rows do not
    read it (:func:`~verispec.drafters.base.seeded_sample`)."""

    name: ClassVar[str]
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = False
    last_catchup_tokens: int = 0  # no model state to catch up
    elsewhere_grows: ClassVar[bool] = False  # whether elsewhere() finds more as other requests finish

    def __init__(
        self, *, min_n: int, max_n: int, depth: int, max_nodes: int, min_share: float, max_matches: int,
        spec_factor: float,
    ) -> None:  # fmt: skip
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"{self.name} drafter: suffix sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if depth < 1 or max_nodes < 1 or max_matches < 1:
            raise ConfigError(f"{self.name} drafter: depth, max_nodes and max_matches must be >= 1")
        if not 0.0 < min_share <= 1.0:
            raise ConfigError(f"min_share must be in (0, 1], got {min_share}")
        if not 0.0 < spec_factor < float("inf"):
            raise ConfigError(f"spec_factor must be a number > 0, got {spec_factor}")
        self.min_n, self.max_n, self.depth, self.max_nodes = min_n, max_n, depth, max_nodes
        self.min_share, self.max_matches, self.spec_factor = min_share, max_matches, spec_factor
        self._own: dict[str, OwnTokens] = {}

    # ------------------------------------------------------------------------------ lifecycle
    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._own:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        self._own[request_id] = OwnTokens(prompt_ids, self.min_n, self.max_n, self.max_matches)

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self._get(request_id)  # the tokens arrive through the request's own list

    def end(self, request_id: str) -> None:
        self._own.pop(request_id, None)

    def _get(self, request_id: str) -> OwnTokens:
        try:
            return self._own[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() before propose()/observe()") from None

    # ------------------------------------------------------------------------------- drafting
    def elsewhere(self, suffix: Sequence[int]) -> list[Sequence[int]]:
        """Continuations (``depth`` tokens at most) of ``suffix`` outside the request's own tokens."""
        return []

    def _continuations(self, request_id: str, seeded: bool = False) -> tuple[int, list[Sequence[int]]]:
        """The longest suffix (``max_n`` down to ``min_n`` tokens) that occurred before, as its
        length and what followed its occurrences (``depth`` tokens at most; none: ``(0, [])``);
        for a ``seeded`` sample, not in a source that grows with other requests."""
        own = self._get(request_id)
        tokens = own.tokens
        shared = not (seeded and self.elsewhere_grows)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            found = (self.elsewhere(tokens[-n:]) if shared else []) + [
                tokens[pos : pos + self.depth] for pos in own.starts(n)
            ]
            if found:
                return n, found
        return 0, []

    def _draft_size(self, matched: int) -> int:
        """At most ``spec_factor`` x the match's length (a short match guesses little)."""
        return max(1, round(self.spec_factor * matched))

    def tree(self, request_id: str, budget: int, seeded: bool = False) -> tuple[list[int], list[int]]:
        """The tokens and parents (-1: the root) of the tree for one request, at most ``budget``
        nodes, parents first (``seeded``: see :meth:`_continuations`)."""
        self._get(request_id)  # (an unknown request is an error even with no room)
        budget = min(budget, self.max_nodes)
        if budget <= 0:
            return [], []
        matched, found = self._continuations(request_id, seeded)
        if not found:
            return [], []
        return best_continuations(found, min(budget, self._draft_size(matched)), self.min_share)

    def lookup(self, request_id: str, k: int, min_share: float = 0.7, *, seeded: bool = False) -> list[int]:
        """The one continuation most of the earlier ones agree on, for a chain draft (the composite
        drafter's lookup): from the longest matching suffix, the most frequent next token while
        at least ``min_share`` of the continuations found pass through it; at most ``k`` tokens
        and ``spec_factor`` times the match's length. Empty when nothing matches or the
        continuations disagree from the first token (SuffixDecoding's fallback to a model draft).
        ``seeded``: see :meth:`_continuations`."""
        matched, found = self._continuations(request_id, seeded)
        return majority_path(found, min(k, self._draft_size(matched)), min_share) if found else []

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        room = batch.room if batch.room is not None else [self.max_nodes] * len(batch)
        trees = [
            self.tree(rid, min(r, self.max_nodes), seeded_sample(p, g)) if k > 0 else ([], [])
            for rid, k, r, p, g in zip(batch.request_ids, max_tokens, room, batch.params, batch.generators, strict=True)
        ]
        return tree_draft(trees)


def tree_draft(trees: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Draft:
    """A draft of fixed-children trees, one ``(tokens, parents)`` per row (empty: no draft)."""
    k = max((len(t) for t, _ in trees), default=0)
    ids = torch.full((len(trees), k), -1, dtype=torch.long)
    parents = torch.full((len(trees), k), -1, dtype=torch.long)
    for row, (toks, pars) in enumerate(trees):
        if toks:
            ids[row, : len(toks)] = torch.tensor(list(toks), dtype=torch.long)
            parents[row, : len(pars)] = torch.tensor(list(pars), dtype=torch.long)
    num = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
    return Draft(ids, num, None, parents, "fixed")
