"""Toy language models with exactly computable laws: Markov chains over a small vocabulary.

A :class:`MarkovLM` of order ``m`` gives next-token logits as a function of the last ``m`` tokens.
Because the vocabulary is small, the law of the first ``n`` generated tokens under any
:class:`~verispec.config.SamplingParams` (temperature, top-k/top-p/min-p, penalties, logit bias;
all applied through :func:`verispec.sampling.to_probs`, like everywhere else) can be computed
exactly by enumerating the ``V ** n`` sequences (:func:`exact_prefix_law`). That truth is what
:mod:`verispec.certify.core` compares speculative sampling against.

:func:`toy_pair` builds a target and a draft whose distance is controllable (draft logits = target
logits + ``distance`` * Gaussian noise), and :func:`generate` runs whole sequences through the full
loop (draft K tokens, score K + 1 positions with the target, verify, commit, repeat), vectorised
over many sequences. With no drafter it is plain sampling: the same loop with K = 0.

This is certification's minimal loop, kept apart from the engine on purpose: it certifies the
acceptance RULES on tens of thousands of sequences at once, as tensors, which the engine's
per-request bookkeeping would make a hundred times slower. Its drafters (:class:`ToyDrafter`) take
tensors, not the :class:`~verispec.drafters.base.Drafter` protocol. The engine itself, with the
protocol's drafters, is certified on tiny transformers (:func:`verispec.certify.core.certify_engine_case`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from verispec.config import SamplingParams
from verispec.errors import ConfigError, InputError
from verispec.metrics import SpecStats
from verispec.sampling import TokenHistory, sample, to_probs
from verispec.verify.base import PAD_ID, AcceptanceRule, Draft


class MarkovLM:
    """Next-token logits from the last ``order`` tokens: ``table[index(context)]``.

    ``table`` ``[V ** order, V]`` fp32; the context index is the base-V number of the last
    ``order`` tokens (oldest first).
    """

    def __init__(self, table: Tensor, order: int = 1) -> None:
        if order < 1:
            raise ConfigError(f"a Markov model needs order >= 1, got {order}")
        vocab = table.shape[-1]
        if table.dim() != 2 or table.shape[0] != vocab**order:
            raise InputError(f"table must be [V ** order, V] = [{vocab**order}, {vocab}], got {tuple(table.shape)}")
        self.table = table.to(torch.float32)
        self.order = order
        self.vocab_size = vocab

    def logits(self, tokens: Tensor, ends: Tensor) -> Tensor:
        """Logits ``[N, V]`` for the token after ``tokens[n, :ends[n]]``.

        ``tokens`` ``[N, L]`` int64; ``ends`` ``[N]`` int64 with ``ends >= order``.
        """
        index = torch.zeros_like(ends)
        for j in range(self.order):
            index = index * self.vocab_size + tokens.gather(1, (ends - self.order + j).unsqueeze(1)).squeeze(1)
        return self.table[index]


def toy_pair(
    vocab_size: int = 4, order: int = 1, distance: float = 1.0, scale: float = 1.5, seed: int = 0
) -> tuple[MarkovLM, MarkovLM]:
    """A target and a draft Markov model; ``distance`` scales the draft's logit noise (0 = equal)."""
    if vocab_size < 2:
        raise ConfigError(f"vocab_size must be >= 2, got {vocab_size}")
    if distance < 0:
        raise ConfigError(f"distance must be >= 0, got {distance}")
    gen = torch.Generator().manual_seed(seed)
    target = scale * torch.randn((vocab_size**order, vocab_size), generator=gen)
    draft = target + distance * torch.randn((vocab_size**order, vocab_size), generator=gen)
    return MarkovLM(target, order), MarkovLM(draft, order)


def mean_total_variation(target: MarkovLM, draft: MarkovLM, params: SamplingParams) -> float:
    """Mean over contexts of TV(target law, draft law) under ``params`` (no penalties): the
    expected single-token rejection probability, averaged uniformly over contexts."""
    contexts = torch.arange(target.vocab_size**target.order)
    rows = [params] * len(contexts)
    shape = (len(contexts), target.vocab_size)
    empty = TokenHistory(torch.zeros(shape, dtype=torch.int32), torch.zeros(shape, dtype=torch.bool))
    p = to_probs(target.table[contexts], rows, empty)
    q = to_probs(draft.table[contexts], rows, empty)
    return float(0.5 * (p - q).abs().sum(dim=1).mean())


class ToyDrafter:
    """Draws draft tokens from a draft :class:`MarkovLM` through ``to_probs`` (the same warping as
    the target) and reports the laws it drew from.

    A chain of ``k`` tokens by default; with ``tree`` (a static shape: the parent of each node,
    -1 for the root, parents first) one token per node, each node's children drawn from the law
    after its parent's path as ``children`` says (:class:`~verispec.verify.Draft`): ``"sampled"``
    i.i.d., ``"distinct"`` without replacement, ``"fixed"`` the draft's best, second best, ...
    (no randomness; ``probs=None``). ``point_mass=True`` is ``children="fixed"``: on a chain, the
    mode of each draft law, like n-gram lookup or greedy heads.
    """

    name: ClassVar[str] = "model"

    def __init__(
        self,
        model: MarkovLM,
        point_mass: bool = False,
        *,
        tree: Sequence[int] | None = None,
        children: str = "sampled",
    ) -> None:
        self.model = model
        self.children = "fixed" if point_mass else children
        if self.children not in ("sampled", "distinct", "fixed"):
            raise ConfigError(f"children must be sampled, distinct or fixed, got {children!r}")
        self.tree = tuple(tree) if tree is not None else None
        if self.tree is not None and any(not -1 <= p < i for i, p in enumerate(self.tree)):
            raise ConfigError(f"a tree shape lists each node's parent, earlier nodes only (or -1): got {self.tree}")

    @property
    def point_mass(self) -> bool:
        return self.children == "fixed"

    def sampling_law(self, logits: Tensor, reported: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        """The law the draft token is actually drawn from (``[N, V]``); honest drafters use ``reported``."""
        return reported

    def labelled_children(self) -> str:
        """What the draft says of its children (honest drafters: what they did)."""
        return self.children

    def propose(
        self,
        tokens: Tensor,
        lengths: Tensor,
        k: int,
        params: Sequence[SamplingParams],
        history: TokenHistory | None,
        generators: Sequence[torch.Generator | None],
    ) -> Draft:
        """``tokens`` ``[N, L]`` (room for the deepest path after ``lengths``), ``lengths`` ``[N]``;
        ``k`` tokens for a chain (a tree drafts its own size)."""
        parents = self.tree if self.tree is not None else tuple(range(-1, k - 1))
        n, vocab, size = tokens.shape[0], self.model.vocab_size, len(parents)
        rows = torch.arange(n)
        ids = torch.empty((n, size), dtype=torch.long)
        laws = torch.empty((n, size, vocab), dtype=torch.float32)
        depth = [0] * size
        paths: list[list[int]] = []  # the nodes on each node's path
        node_tokens: list[Tensor] = []  # [N, L] each node's sequence (its path appended)
        siblings: dict[int, list[int]] = {}
        for i, par in enumerate(parents):
            base = tokens if par < 0 else node_tokens[par]
            start = 0 if par < 0 else depth[par]
            path = [] if par < 0 else paths[par]
            logits = self.model.logits(base, lengths + start)  # [N, V] the law after the parent
            hist = history.extended(ids[:, path]) if history is not None else None
            reported = to_probs(logits, params, hist)
            law = self.sampling_law(logits, reported, params)
            earlier = siblings.setdefault(par, [])
            if self.children == "sampled":
                ids[:, i] = sample(law, generators)
            else:  # without replacement: the earlier siblings' tokens removed
                drawn = law.clone()
                if earlier:
                    drawn[rows.unsqueeze(1), ids[:, earlier]] = 0.0
                empty = drawn.sum(dim=1) <= 0
                drawn = torch.where(empty.unsqueeze(1), law, drawn)  # (the support ran out: repeat)
                ids[:, i] = drawn.argmax(dim=1) if self.children == "fixed" else sample(drawn, generators)
            earlier.append(i)
            laws[:, i] = reported
            depth[i] = start + 1
            paths.append([*path, i])
            seq = base.clone()
            seq[rows, lengths + start] = ids[:, i]
            node_tokens.append(seq)
        draft_parents = (
            None if self.tree is None else torch.tensor(parents, dtype=torch.long).expand(n, size).contiguous()
        )
        label = self.labelled_children()
        probs = None if label == "fixed" else laws
        return Draft(ids, torch.full((n,), size, dtype=torch.long), probs, draft_parents, label)


class MisreportingToyDrafter(ToyDrafter):
    """A BROKEN drafter (negative control): it samples from the raw ``softmax(logits)``, forgetting
    temperature / top-k / top-p / min-p, but reports the warped law as ``draft_probs``."""

    name: ClassVar[str] = "broken-misreporting-drafter"

    def sampling_law(self, logits: Tensor, reported: Tensor, params: Sequence[SamplingParams]) -> Tensor:
        return torch.softmax(logits, dim=1)


class TopKAsSampledToyDrafter(ToyDrafter):
    """A BROKEN tree drafter (negative control): it takes the draft's top-k as children
    (deterministic) but labels them i.i.d. samples, so the sampled rule subtracts a law they were
    never drawn from."""

    name: ClassVar[str] = "broken-topk-as-sampled"

    def __init__(self, model: MarkovLM, *, tree: Sequence[int] | None = None, **_: object) -> None:
        super().__init__(model, tree=tree, children="fixed")

    def labelled_children(self) -> str:
        return "sampled"


@dataclass
class ToyRun:
    """The result of :func:`generate`: ``tokens`` ``[N, n]`` (the first ``n`` generated tokens of
    each sequence), the speculation counters, and the number of target passes."""

    tokens: Tensor
    stats: SpecStats = field(default_factory=SpecStats)
    target_passes: int = 0


def generate(
    target: MarkovLM,
    drafter: ToyDrafter | None,
    rule: AcceptanceRule,
    params: SamplingParams,
    *,
    k: int,
    num_sequences: int,
    prefix_len: int,
    prompt: Sequence[int] = (0,),
    seed: int = 0,
) -> ToyRun:
    """Generate ``num_sequences`` sequences of ``prefix_len`` tokens after ``prompt``.

    Each step: the drafter proposes ``k`` tokens for every unfinished sequence, the target scores the
    ``k + 1`` positions, ``rule`` verifies, the output tokens are committed. ``drafter=None`` (or
    ``k = 0``) is plain sampling through the same rule. All sequences share one generator seeded
    with ``seed`` (the rule draws for them as one block); greedy params use none.
    """
    if len(prompt) < target.order:
        raise ConfigError(f"the prompt needs at least {target.order} tokens for an order-{target.order} model")
    if k < 0 or prefix_len < 1 or num_sequences < 1:
        raise ConfigError(f"need k >= 0, prefix_len >= 1, num_sequences >= 1; got {k}, {prefix_len}, {num_sequences}")
    if drafter is None:
        k = 0
    elif drafter.model.vocab_size != target.vocab_size:
        raise InputError(f"draft vocabulary {drafter.model.vocab_size} != target vocabulary {target.vocab_size}")
    vocab, start = target.vocab_size, len(prompt)
    width = start + prefix_len + k + 1
    tokens = torch.full((num_sequences, width), 0, dtype=torch.long)
    tokens[:, :start] = torch.as_tensor(list(prompt), dtype=torch.long)
    lengths = torch.full((num_sequences,), start, dtype=torch.long)
    history = TokenHistory.from_ids([prompt], [[]], vocab) if params.uses_history else None
    counts = history.output_counts.repeat(num_sequences, 1) if history is not None else None
    prompt_mask = history.prompt_mask.repeat(num_sequences, 1) if history is not None else None
    gen = None if params.greedy else torch.Generator().manual_seed(seed)
    run = ToyRun(tokens=torch.empty(0))

    while True:
        active = (lengths - start < prefix_len).nonzero().squeeze(1)  # [A]
        if active.numel() == 0:
            break
        a = int(active.numel())
        sub_tokens, sub_lengths = tokens[active], lengths[active]
        sub_hist = (
            TokenHistory(counts[active], prompt_mask[active])
            if counts is not None and prompt_mask is not None
            else None
        )
        gens = [gen] * a
        if k > 0 and drafter is not None:
            draft = drafter.propose(sub_tokens, sub_lengths, k, [params] * a, sub_hist, gens)
        else:
            draft = Draft(torch.empty((a, 0), dtype=torch.long), torch.zeros(a, dtype=torch.long))
        kk = draft.max_tokens
        # Score the last committed token plus every draft node: K + 1 target laws per sequence.
        if draft.parents is None:
            scored = sub_tokens.clone()
            pos = sub_lengths.unsqueeze(1) + torch.arange(kk).unsqueeze(0)  # [A, K]
            scored.scatter_(1, pos, draft.token_ids.clamp_min(0))
            ends = (sub_lengths.unsqueeze(1) + torch.arange(kk + 1).unsqueeze(0)).reshape(-1)  # [A * (K+1)]
            logits = target.logits(scored.repeat_interleave(kk + 1, dim=0), ends)  # [A * (K+1), V]
        else:
            seqs, ends = node_sequences(sub_tokens, sub_lengths, draft)  # [A, K + 1, L], [A, K + 1]
            logits = target.logits(seqs.reshape(a * (kk + 1), -1), ends.reshape(-1))
        vhist = sub_hist.for_verification(draft.token_ids, draft.parents) if sub_hist is not None else None
        target_probs = to_probs(logits, [params] * (a * (kk + 1)), vhist).reshape(a, kk + 1, vocab)
        verdict = rule.verify(draft, target_probs, gens)
        run.target_passes += 1
        run.stats.observe_tensors(draft.num_tokens, verdict.num_accepted)

        out = verdict.output_ids  # [A, K+1]
        write = sub_lengths.unsqueeze(1) + torch.arange(kk + 1).unsqueeze(0)
        keep = out != PAD_ID
        sub_tokens.scatter_(1, write, torch.where(keep, out, sub_tokens.gather(1, write)))
        tokens[active] = sub_tokens
        lengths[active] = sub_lengths + keep.sum(dim=1)
        if counts is not None and sub_hist is not None:
            counts[active] = sub_hist.extended(out).output_counts
    run.tokens = tokens[:, start : start + prefix_len]
    return run


def node_sequences(tokens: Tensor, lengths: Tensor, draft: Draft) -> tuple[Tensor, Tensor]:
    """Each node's sequence for a tree draft: ``[N, K + 1, L]`` (entry 0: the committed tokens;
    entry 1 + i: with node i's path appended) and where each ends ``[N, K + 1]``."""
    assert draft.parents is not None
    n, k = draft.token_ids.shape
    rows = torch.arange(n)
    seqs = [tokens]
    ends = [lengths]
    for i in range(k):
        par = draft.parents[:, i].clamp_min(-1) + 1  # [N]: the parent's entry
        base = torch.stack(seqs, dim=1)[rows, par].clone()  # [N, L]
        end = torch.stack(ends, dim=1)[rows, par]
        used = i < draft.num_tokens
        base[rows, end.clamp_max(tokens.shape[1] - 1)] = torch.where(
            used, draft.token_ids[:, i].clamp_min(0), base[rows, end.clamp_max(tokens.shape[1] - 1)]
        )
        seqs.append(base)
        ends.append(torch.where(used, end + 1, end))
    return torch.stack(seqs, dim=1), torch.stack(ends, dim=1)


def exact_prefix_law(
    model: MarkovLM, params: SamplingParams, prefix_len: int, prompt: Sequence[int] = (0,)
) -> np.ndarray:
    """The exact law of the first ``prefix_len`` tokens sampled from ``model`` after ``prompt``.

    Returns ``[V ** prefix_len]`` float64 indexed by :func:`sequence_index` (the base-V number of the
    sequence). Built by enumerating every sequence and multiplying the ``to_probs`` conditionals.
    """
    vocab = model.vocab_size
    if vocab**prefix_len > 2_000_000:
        raise ConfigError(f"{vocab}^{prefix_len} sequences are too many to enumerate; lower prefix_len or vocab")
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=prefix_len)), dtype=torch.long)  # [M, n]
    m = seqs.shape[0]
    start = len(prompt)
    full = torch.cat([torch.as_tensor(list(prompt), dtype=torch.long).expand(m, start), seqs], dim=1)
    law = torch.ones(m, dtype=torch.float64)
    for t in range(prefix_len):
        hist = None
        if params.uses_history:
            base = TokenHistory.from_ids([prompt], [[]], vocab)
            hist = TokenHistory(base.output_counts.repeat(m, 1), base.prompt_mask.repeat(m, 1)).extended(seqs[:, :t])
        probs = to_probs(model.logits(full, torch.full((m,), start + t)), [params] * m, hist)
        law *= probs.gather(1, seqs[:, t : t + 1]).squeeze(1).to(torch.float64)
    return law.numpy()


def sequence_index(tokens: Tensor, vocab_size: int) -> np.ndarray:
    """Base-``vocab_size`` index of each row of ``tokens`` ``[N, n]`` (first token most significant)."""
    weights = vocab_size ** torch.arange(tokens.shape[1] - 1, -1, -1, dtype=torch.long)
    return (tokens * weights).sum(dim=1).numpy()
