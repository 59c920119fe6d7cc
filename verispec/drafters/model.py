"""Drafting with a small language model (Leviathan et al. 2023; Chen et al. 2023).

The draft model keeps its own KV cache, one slot per request. Each draft token is drawn from the
draft model's law through the SAME :func:`~verispec.sampling.to_probs` and SamplingParams as the
target (penalties included), and that exact law is reported in ``Draft.probs``: the rejection rule
needs the law the token was actually drawn from, nothing else. A greedy request's law is the point
mass at the mode of its logits; when every drafting row of a step is greedy (no bias, no penalty)
the draft reports no laws (``Draft.probs`` None, which the rules read as point masses at the
tokens) and builds none: ~0.6 MB of laws per draft token and their sampling left out.

Cache bookkeeping per request: ``context`` is the request's own token list (everything committed:
prompt + output; the engine extends it), ``fed`` how many of its tokens are in the draft cache. A
proposal first feeds the tokens not yet fed (the last committed token, plus the last draft token
when the whole draft was accepted: the "catch-up"), in one batched pass, then one pass per further
draft token. After verification the cache keeps the committed prefix and drops what the target
rejected (O(1)). A new request's prompt is fed by its first proposal, batched with the other
requests' pending tokens; a prompt longer than ``context_window`` tokens only from its last that
many (``skipped`` counts the others), and a prompt of ``PREFILL_MIN_TOKENS`` or more through the
model's prefill path. A catch-up longer than ``catch_up_chunk`` tokens (a long prompt with the whole
prompt as the window, or many tokens committed while speculation was off) goes ahead in chunks of
that many, one request a pass, as the engine feeds the target a prompt: a pass's attention
masks grow with the square of its width, so one pass over a 32k-token prompt would build
gigabytes of them.

Drafting on verispec's kernels (no drafting row with a bias or penalty, a restricted head on the
kernels: the machine defaults) runs a whole proposal in one native call
(:meth:`~verispec.models.transformer.Transformer.draft`), without the ~0.6 ms of Python and torch
calls (heads, laws, picks) each pass of the loop below costs around its kernels
(``benchmarks/draft_step.py --loop both``). Greedy: the
same passes and the same tokens as the loop below, picked by ``ops.greedy_pick`` (the mode, ties
to the smallest id). Sampled: the same passes; each law by :func:`~verispec.sampling.build_laws`'s
steps in the kernels' arithmetic (``ops.sampled_pick``: fp32 rounding apart, the loop's law), the
token drawn from that law with the request's generator, one uniform a token as
:func:`~verispec.sampling.sample` draws, and that law reported: the rule needs the law each token
was drawn from, and this is it.

Rows that draft nothing this step are not run and consume no randomness. A row whose draft law
cannot be built (NaN draft logits, every token banned) stops drafting at that position; the
other rows are untouched.

A cheaper draft head (``head_size``): the draft's LM head is often a large share of its cost (for
Qwen2.5-0.5B, 136M of 494M parameters). With ``head_size = N`` the drafter computes logits only for
token ids ``[0, N)`` (BPE ids are roughly in order of frequency) plus ``keep_ids`` (e.g. the stop
tokens), and its law is 0 elsewhere. The rule stays exact: a token the draft never proposes reaches
the output through the residual ``max(0, target_probs - draft_probs)``, which is the whole target
mass there. Only acceptance can drop, by the target mass outside the head. When no row of the
step has a penalty or a logit bias (which name ids of the whole vocabulary), the laws are built on
the head's ids alone, through the same :func:`~verispec.sampling.build_laws` (BPE ids ascending, so
ties and top-p order are those of the full row), and scattered into the reported law: the same law
without a pass over 151,936 mostly impossible ids for each draft token.

The request's own ids (``context_ids``, on by default with a restricted head): a token outside the
head that the request's context holds (its prompt, or output the target committed) is scored too,
for that request alone. Identifiers of the user's code recur: on 24 HumanEval prompts the target's
greedy output had 5.5% of its tokens outside the first 32768 ids and 1.8% outside them and the
request's context so far, acceptance 0.856 -> 0.890 (``benchmarks/draft_head_ab.py``, 2-core
Zen 4). Those ids' rows (at most ``MAX_CONTEXT_IDS`` per request) form a second small head, cut
from the whole head as the first one is and rebuilt when a request brings an id it lacks; their
scores are merged with the head's in ascending id order, as the narrow laws need; a row's law is
0 on the ids another request brought, so it depends on its own context alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from verispec.config import DRAFT_CONTEXT_WINDOW
from verispec.drafters.base import BatchView
from verispec.errors import ConfigError, InputError
from verispec.kernels.linear import native_projection
from verispec.models.protocol import LanguageModel
from verispec.models.transformer import PREFILL_MIN_TOKENS, DraftSampling
from verispec.sampling import TokenHistory, build_laws, cut_vocab, mode, sample
from verispec.verify.base import PAD_ID, Draft

# DRAFT_CONTEXT_WINDOW (verispec.config), the most prompt tokens the draft model reads by default: a
# longer prompt's draft starts at its last that many tokens (positions from 0, as if the prompt
# began there). The draft feeds its prompt at its first proposal, a cost that grows faster than the
# prompt (attention); the drafts are only proposals, so the output stays the target's. A
# 2129-token prompt (HumanEval prompts, 128 tokens, 1.5B / 0.5B int4, Intel Xeon with AMX): decode
# steps at 18.3 tokens/s with the whole prompt, 28.4 with the last 1024 tokens (acceptance 0.81 /
# 0.89), 27.2 with 512 (0.66); plain decoding 20.6.
#: Most ids outside a restricted head that one request's context adds to its draft law (the first seen).
MAX_CONTEXT_IDS = 512
#: Most rows of the context ids' head: past it, only the rows of the pass that needs it are kept.
MAX_CONTEXT_POOL = 2048
#: Most tokens of one request a catch-up pass feeds (EngineConfig.prefill_chunk's default).
CATCH_UP_CHUNK = 512


@dataclass
class _State:
    slot: int
    prompt_len: int
    context: Sequence[int]  # the request's token list (prompt + committed output): read, never copied
    fed: int = 0
    skipped: int = 0  # prompt tokens before the draft's window, never fed: the cache holds context[skipped:fed]
    last_k: int = 0  # tokens drafted in the last proposal
    context_at_propose: int = 0
    drafts: list[int] = field(default_factory=list)
    extra: set[int] = field(default_factory=set)  # its context's ids outside the restricted head
    scanned: int = 0  # context tokens looked at for them
    mask: tuple[int, int, Tensor | None] | None = None  # (pool version, len(extra), [E] bool: pool ids not its own)

    @property
    def cached(self) -> int:
        """Tokens in the draft cache: context[skipped:fed]."""
        return self.fed - self.skipped


class ModelDrafter:
    """A draft language model with its own KV cache (see the module docstring).

    ``vocab_size``: width of the laws to report (the target's logits width); ``vocab_limit``: ids
    past it get probability 0 (the tokenizer's vocabulary), as in the engine. ``context_window``:
    the most prompt tokens the draft reads (:data:`~verispec.config.DRAFT_CONTEXT_WINDOW`; None: all).
    """

    name: ClassVar[str] = "model"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = False
    stops_early: ClassVar[bool] = True  # honours BatchView.stop (drafts end by their confidence)
    catch_up_chunk: int = CATCH_UP_CHUNK

    def __init__(
        self,
        model: LanguageModel,
        *,
        vocab_size: int,
        vocab_limit: int | None = None,
        max_batch: int = 8,
        max_len: int = 4096,
        head_size: int | None = None,
        keep_ids: Sequence[int] = (),
        context_ids: bool = True,
        context_window: int | None = DRAFT_CONTEXT_WINDOW,
    ) -> None:
        if model.config.vocab_size < 2:
            raise ConfigError("the draft model needs a vocabulary")
        if context_window is not None and context_window < 1:
            raise ConfigError(f"the draft's context window must be at least 1 token, got {context_window}")
        self.context_window = context_window
        self.model = model
        self.vocab_size = vocab_size
        self.vocab_limit = min(vocab_limit or vocab_size, vocab_size, model.config.vocab_size)
        self.cache: Any = model.new_cache(max_batch, max_len)
        self.max_len = max_len
        self._state: dict[str, _State] = {}
        self._head_ids: Tensor | None = None  # [H] int64: ids the restricted head scores
        self._head_module: torch.nn.Module | None = None  # the LM head scoring only those ids
        self._head_id_set: frozenset[int] = frozenset()
        # the requests' context ids (module docstring): the pool's head, its ids, and the columns
        # of the last pass's scores (head and pool ids merged, ascending) with the permutation
        # that merges them
        self.context_ids = context_ids and head_size is not None
        self._pool: tuple[int, ...] = ()
        self._pool_set: frozenset[int] = frozenset()
        self._pool_version = 0
        self._pool_module: torch.nn.Module | None = None
        self._merge_order: Tensor | None = None  # [H + E] int64
        self._merged_ids: Tensor | None = None  # [H + E] int64
        self._columns: Tensor | None = None  # [H] or [H + E]: the ids of the last pass's score columns
        # the heads as the kernels' projections, for greedy drafting in one native call (None: not on the kernels)
        self._head_native: Any = None
        self._pool_ids: Tensor | None = None  # [E] int64
        self._pool_native: Any = None
        if head_size is not None:
            self._restrict_head(head_size, keep_ids)

    def _restrict_head(self, head_size: int, keep_ids: Sequence[int]) -> None:
        # (lm_head first: a packed head's lm_weight dequantises every row, ~2.5 s for a 151936-id head)
        if self.model.lm_head is None and self.model.lm_weight is None:
            raise ConfigError(
                f"{type(self.model).__name__} does not expose its hidden states and LM head, so its head "
                "cannot be restricted; drop the draft vocabulary option"
            )
        if not 1 <= head_size <= self.vocab_limit:
            raise ConfigError(f"draft head size must be in [1, {self.vocab_limit}], got {head_size}")
        ids = sorted(set(range(head_size)) | {i for i in keep_ids if 0 <= i < self.vocab_limit})
        self._head_ids = torch.tensor(ids, dtype=torch.long, device=self.model.device)
        self._head_id_set = frozenset(ids)
        self._head_module = restricted_head(self.model, self._head_ids)
        self._head_native = native_projection(self._head_module)
        self._columns = self._head_ids

    # ------------------------------------------------------------------------------ lifecycle
    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._state:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        slot = self.cache.add_sequence()
        state = _State(slot, len(prompt_ids), prompt_ids)
        if self.context_window is not None and len(prompt_ids) > self.context_window:
            state.skipped = state.fed = len(prompt_ids) - self.context_window
        self._state[request_id] = state  # the prompt is fed by the first proposal, batched with others

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        state = self._get(request_id)
        if state.last_k > 0:
            num_accepted = len(accepted_ids) - 1
            # Draft tokens 1 .. k-1 were fed; keep those the target accepted.
            state.fed = state.context_at_propose + min(num_accepted, state.last_k - 1)
            self.cache.truncate([state.cached], [state.slot])
            state.last_k = 0

    def end(self, request_id: str) -> None:
        state = self._state.pop(request_id, None)
        if state is not None:
            self.cache.remove_sequence(state.slot)

    def _get(self, request_id: str) -> _State:
        try:
            return self._state[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() first") from None

    # ------------------------------------------------------------------------------- drafting
    def _feed(self, states: Sequence[_State], pieces: Sequence[Sequence[int]], narrow: bool = False) -> Tensor:
        """Append ``pieces[i]`` to ``states[i]``'s cache in one pass; return the logits ``[R, V]``
        fp32 after each row's last token (the law of its next token); ``narrow``: only the
        restricted head's ``[R, H]``, column j for id ``_head_ids[j]``."""
        device = self.model.device
        num_new = [len(p) for p in pieces]
        last = torch.tensor([[n - 1] for n in num_new], device=device)
        logits = self._run(states, pieces, last, narrow=narrow)[:, 0]
        for state, n in zip(states, num_new, strict=True):
            state.fed += n
        return logits

    def _feed_ahead(self, states: Sequence[_State]) -> None:
        """Feed each state's pending tokens except the last ``catch_up_chunk`` or fewer, a chunk
        of one state a pass, computing no logits (the module docstring); the rest go with the
        step's first batched pass."""
        chunk = self.catch_up_chunk
        extra: dict[str, Any] = {"prefill": True} if chunk >= PREFILL_MIN_TOKENS else {}
        for state in states:  # (in steady state a test per request and nothing else)
            while len(state.context) - state.fed > chunk:
                device = self.model.device
                piece = torch.tensor([state.context[state.fed : state.fed + chunk]], dtype=torch.long, device=device)
                no_logits = torch.empty((1, 0), dtype=torch.long, device=device)
                slots = [state.slot]
                self.model.forward(piece, None, self.cache, num_new=[chunk], slots=slots, logits_at=no_logits, **extra)
                state.fed += chunk

    def _run(
        self,
        states: Sequence[_State],
        pieces: Sequence[Sequence[int]],
        at: Tensor,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        narrow: bool = False,
    ) -> Tensor:
        """One draft pass appending ``pieces[i]`` to ``states[i]``'s cache (``positions`` /
        ``mask`` as :meth:`~verispec.models.transformer.Transformer.forward` takes them, None: a
        chain); the logits ``[R, N, V]`` fp32 at the step offsets ``at`` ``[R, N]``, on the
        target's support (the restricted head's ids only, when the head is restricted; with
        ``narrow``, just those: ``[R, N, H]``)."""
        device = self.model.device
        if self._head_ids is not None:
            h = self._hidden(states, pieces, at, positions, mask)  # [R, N, C]
            assert self._head_module is not None
            scores: Tensor = self._head_module(h)  # [R, N, H]
            self._columns = self._head_ids
            own = self._context_scores(states, h) if self.context_ids else None  # [R, N, E]
            if own is not None:
                assert self._merge_order is not None
                scores = torch.cat([scores, own.to(scores.dtype)], dim=-1).index_select(-1, self._merge_order)
                self._columns = self._merged_ids
            if narrow:  # (the head's ids are below vocab_limit: nothing to cut)
                return scores.float()
            logits = torch.full((len(pieces), at.shape[1], self.vocab_size), float("-inf"), device=device)
            logits[:, :, self._columns] = scores.float()
        else:
            logits = self._pass(states, pieces, positions, mask, at)  # [R, N, V_draft]
        r, n, v = logits.shape
        return self._fit(logits.reshape(r * n, v)).reshape(r, n, -1)

    def _pass(
        self,
        states: Sequence[_State],
        pieces: Sequence[Sequence[int]],
        positions: Tensor | None,
        mask: Tensor | None,
        logits_at: Tensor,
        hidden: bool = False,
    ) -> Any:
        """One draft pass appending ``pieces[i]`` to ``states[i]``'s cache, right-padded (a
        catch-up over a prompt on the model's prefill path): the model's ``forward`` (logits
        ``[R, N, V_draft]`` at ``logits_at``), or with ``hidden`` its ``forward_with_hidden``."""
        width = max(len(p) for p in pieces)
        tokens = torch.full((len(pieces), width), 0, dtype=torch.long)  # [R, T]
        for row, piece in enumerate(pieces):
            tokens[row, : len(piece)] = torch.tensor(piece, dtype=torch.long)
        extra: dict[str, Any] = {} if mask is None else {"attn_mask": mask}  # (chains: no mask, any model takes them)
        if width >= PREFILL_MIN_TOKENS:
            extra["prefill"] = True
        run = self.model.forward_with_hidden if hidden else self.model.forward
        return run(tokens.to(self.model.device), positions, self.cache, num_new=[len(p) for p in pieces],
                   slots=[s.slot for s in states], logits_at=logits_at, **extra)  # fmt: skip

    def _hidden(
        self,
        states: Sequence[_State],
        pieces: Sequence[Sequence[int]],
        at: Tensor,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> Tensor:
        """One draft pass appending ``pieces[i]`` to ``states[i]``'s cache (as :meth:`_run`); the
        final norm's output ``[R, N, C]`` at the step offsets ``at`` ``[R, N]`` (what the heads score)."""
        none = torch.empty((len(pieces), 0), dtype=torch.long, device=self.model.device)
        hidden: Tensor = self._pass(states, pieces, positions, mask, none, hidden=True).hidden  # [R, T, C]
        return hidden.gather(1, at[:, :, None].expand(-1, -1, hidden.shape[-1]))

    def _context_scores(self, states: Sequence[_State], h: Tensor) -> Tensor | None:
        """The scores ``[R, N, E]`` of the context ids' head for ``h`` ``[R, N, C]``, -inf where
        an id is not in that row's own context; None when no row has any (``_merged_ids`` then
        names the merged columns)."""
        scored, blocked = self._own_ids(states)
        if not scored:
            return None
        assert self._pool_module is not None
        scores: Tensor = self._pool_module(h)  # [R, N, E]
        if blocked is not None:
            scores = scores.masked_fill(blocked[:, None, :].to(scores.device), float("-inf"))
        return scores

    def _own_ids(self, states: Sequence[_State]) -> tuple[bool, Tensor | None]:
        """Whether the context ids' head scores this pass of ``states`` (False: no row has an id
        outside the restricted head), with the pool made to hold their ids, and the pool's columns
        each row must not see (``[R, E]`` bool: ids other requests brought; None: none)."""
        for state in states:
            self._note_context(state)
        needed = set().union(*(s.extra for s in states))
        if not needed:
            return False, None
        if not needed <= self._pool_set:
            live = set().union(*(s.extra for s in self._state.values()))
            self._set_pool(sorted(live if len(live) <= MAX_CONTEXT_POOL else needed))
        masks = [self._mask_of(s) for s in states]
        if all(m is None for m in masks):
            return True, None
        none = torch.zeros(len(self._pool), dtype=torch.bool)
        return True, torch.stack([none if m is None else m for m in masks])  # [R, E]

    def _note_context(self, state: _State) -> None:
        """Add the ids of ``state``'s context not looked at yet that the restricted head lacks."""
        context = state.context
        if state.scanned < len(context) and len(state.extra) < MAX_CONTEXT_IDS:
            head, limit = self._head_id_set, self.vocab_limit
            for t in context[state.scanned :]:
                if 0 <= t < limit and t not in head:
                    state.extra.add(t)
                    if len(state.extra) >= MAX_CONTEXT_IDS:
                        break
        state.scanned = len(context)

    def _set_pool(self, ids: Sequence[int]) -> None:
        assert self._head_ids is not None
        device = self.model.device
        pool = torch.tensor(ids, dtype=torch.long, device=device)
        self._pool_module = restricted_head(self.model, pool)
        self._pool_ids, self._pool_native = pool, native_projection(self._pool_module)
        merged = torch.cat([self._head_ids, pool])
        self._merged_ids, self._merge_order = merged.sort(stable=True)
        self._pool, self._pool_set = tuple(ids), frozenset(ids)
        self._pool_version += 1

    def _mask_of(self, state: _State) -> Tensor | None:
        """``[E]`` bool: the pool's ids that are not in ``state``'s context (None: every one is)."""
        key = (self._pool_version, len(state.extra))
        if state.mask is None or state.mask[:2] != key:
            mask = None if self._pool_set <= state.extra else torch.tensor([i not in state.extra for i in self._pool])
            state.mask = (*key, mask)
        return state.mask[2]

    def _fit(self, logits: Tensor) -> Tensor:
        """Draft logits ``[R, V_draft]`` on the target's support: width ``vocab_size``, ids past
        ``vocab_limit`` at -inf."""
        r, v = logits.shape
        if v < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((r, self.vocab_size - v), float("-inf"))], dim=1)
        elif v > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        return cut_vocab(logits, self.vocab_limit)

    last_catchup_tokens: int = 0  # widest context catch-up of the last propose() (see there)

    @torch.inference_mode()
    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        n = len(batch)
        k_max = max(max_tokens, default=0)
        ids = torch.full((n, k_max), PAD_ID, dtype=torch.long)
        rows = [b for b in range(n) if max_tokens[b] > 0]
        # Every drafting row greedy, with no bias or penalty to apply: each draft token is the mode
        # of its logits, a point mass, so the draft carries no laws (Draft.probs None: what the
        # rules take for point masses) and none are built.
        point = bool(rows) and all(batch.params[b].plain_greedy for b in rows)
        states = [self._get(batch.request_ids[b]) for b in rows]
        for b, state in zip(rows, states, strict=True):
            if state.cached + max_tokens[b] > self.max_len:
                raise InputError(f"draft cache overflow for request {batch.request_ids[b]!r}")
            state.last_k = max_tokens[b]
            state.context_at_propose = len(state.context)
        histories = self._histories(batch, rows, states)
        # (each position zeroed when it is drafted: a stop may end every draft well before k_max)
        device = self.model.device
        laws = None if point else torch.empty((n, k_max, self.vocab_size), dtype=torch.float32, device=device)
        # laws on the head's ids alone (module docstring) unless a row's penalties or biases need the whole row
        narrow = self._head_ids is not None and histories is None and not any(batch.params[b].logit_bias for b in rows)
        drafted: dict[int, list[int]] = {b: [] for b in rows}
        active = list(range(len(rows)))  # indices into rows/states
        # Context tokens to feed (1-2 in steady state; a prompt or the tokens committed while
        # speculation was off otherwise): a one-off cost the draft-length policy must not mistake
        # for the price of a draft token.
        self.last_catchup_tokens = max((len(s.context) - s.fed for s in states), default=0)
        self._feed_ahead(states)
        pieces = [s.context[s.fed :] for s in states]
        if narrow and rows and self._natively() and (point or self._samples_natively(batch, rows, pieces)):
            self._draft_natively(batch, rows, states, pieces, max_tokens, ids, drafted, laws)
            active = []  # (drafted)
        for i in range(k_max):
            if not active:
                break
            logits = self._feed([states[j] for j in active], [pieces[j] for j in active], narrow)  # [A, V] or [A, H]
            columns = self._columns  # the ids of a narrow row's columns (the head's, and context ids)
            params = [batch.params[rows[j]] for j in active]
            hist = None
            if histories is not None:
                hist = TokenHistory(
                    torch.stack([histories[j].output_counts[0] for j in active]),
                    torch.stack([histories[j].prompt_mask[0] for j in active]),
                ).extended(self._drafted_matrix([drafted[rows[j]] for j in active], i))
            law: Tensor | None = None
            if point:  # the mode (lowest id on ties), as build_laws and sample give it
                failed = self._without_mode(logits)
            else:
                built = build_laws(logits, params, hist)  # [A, V] or [A, H]
                law, failed = built.probs, list(built.failed)
            if failed:  # a row without a draft law stops drafting here; the others go on
                ok = [a for a in range(len(active)) if a not in failed]
                logits = logits[ok]
                law = law[ok] if law is not None else None
                active = [active[a] for a in ok]
                if not active:
                    break
            picked = mode(logits) if law is None else sample(law, [batch.generators[rows[j]] for j in active])
            ends: set[int] = set()  # rows whose draft the policy's stop ends here
            if batch.stop is not None:
                ends = self._stops(batch, [rows[j] for j in active], i + 1, logits, law, picked)
            if laws is not None:
                laws[:, i].zero_()
            if narrow:
                assert columns is not None
                picked = columns[picked]
                if laws is not None and law is not None:
                    laws[:, i].index_copy_(1, columns, self._scatter_rows(law, [rows[j] for j in active], n))
            tokens = picked.tolist()  # host: the next feed
            for a, j in enumerate(active):
                b = rows[j]
                ids[b, i] = tokens[a]
                if not narrow and laws is not None and law is not None:
                    laws[b, i] = law[a]
                drafted[b].append(tokens[a])
                pieces[j] = [tokens[a]]
            active = [j for j in active if max_tokens[rows[j]] > i + 1 and rows[j] not in ends]
        # The last draft token of each row is never fed: fed counts context + (k - 1) drafts.
        for b, state in zip(rows, states, strict=True):  # (what observe() rolls the cache back by)
            state.last_k = len(drafted[b])
        num = torch.tensor([len(drafted.get(b, [])) for b in range(n)], dtype=torch.long)
        width = int(num.max()) if n else 0  # the longest draft (positions past it were never drafted)
        return Draft(ids[:, :width], num, None if laws is None else laws[:, :width])

    def _natively(self) -> bool:
        """Whether drafting runs on the kernels (:meth:`_draft_natively`): the restricted head (and
        the context ids' head) as the kernels' projections, the model's layers in one call."""
        can = getattr(self.model, "can_draft", None)
        return self._head_native is not None and can is not None and bool(can(self.cache))

    @staticmethod
    def _samples_natively(batch: BatchView, rows: Sequence[int], pieces: Sequence[Sequence[int]]) -> bool:
        """Whether a proposal with sampled rows (no bias or penalty: the narrow laws) drafts on the
        kernels: every sampled row has its generator, and no catch-up is long enough for the
        model's prefill path (a prompt's first proposal keeps the Python loop)."""
        every_row_draws = all(batch.params[b].greedy or batch.generators[b] is not None for b in rows)
        return every_row_draws and max(len(p) for p in pieces) < PREFILL_MIN_TOKENS

    def _draft_natively(
        self,
        batch: BatchView,
        rows: Sequence[int],
        states: Sequence[_State],
        pieces: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        ids: Tensor,
        drafted: dict[int, list[int]],
        laws: Tensor | None,
    ) -> None:
        """Drafting on the kernels, no row with a bias or penalty: the whole proposal in one native
        call (:meth:`~verispec.models.transformer.Transformer.draft`), its first pass feeding each
        request's pending tokens (1-2 in steady state; a greedy prompt's catch-up long enough for
        the model's prefill path runs in Python first, :meth:`_first_greedy_pass`).

        Greedy (``laws`` None): the same passes and tokens as :meth:`propose`'s loop (the mode of
        the scores on the head's ids and the request's own, ties to the smallest id; a row with
        none stops); the stop reads each token's probability at temperature 1 from the same pick
        (``ops.greedy_pick``). Sampled: the same passes; each row's law on those ids by the steps
        of :func:`~verispec.sampling.build_laws` in the kernels' arithmetic (``ops.sampled_pick``:
        fp32 rounding apart, the loop's law; a greedy row's: the point mass at its mode), the token
        drawn from it with one uniform of the request's generator a token (as
        :func:`~verispec.sampling.sample` draws), the law reported in ``laws`` ``[n, K, V]``.
        Fills ``ids`` ``[n, K]`` and ``drafted``; the states' ``fed`` counts follow."""
        chain: list[int] = list(range(len(states)))  # indices into rows / states, drafting natively
        lead: list[Sequence[int]] = list(pieces)  # what each feeds first
        done = 0  # tokens each drafted before the native call
        if laws is None and max(len(p) for p in pieces) >= PREFILL_MIN_TOKENS:
            chain, done = [], 1
            for j, pick in enumerate(self._first_greedy_pass(states, pieces)):
                if pick is None:  # no greedy token: this row drafts nothing
                    continue
                b, (token, confidence) = rows[j], pick
                ids[b, 0] = token
                drafted[b].append(token)
                if (batch.stop is None or batch.stop.keep_drafting(b, 1, confidence)) and max_tokens[b] > 1:
                    chain.append(j)
            lead = [drafted[rows[j]][-1:] for j in chain]
            if not chain:
                return
        scored, blocked = self._own_ids([states[j] for j in chain]) if self.context_ids else (False, None)
        stop = batch.stop
        keep = None if stop is None else (lambda a, i, f: stop.keep_drafting(rows[chain[a]], done + i + 1, f))
        sampling = None
        if laws is not None:
            params = [batch.params[rows[j]] for j in chain]
            rules = [[0.0, 0, 1.0, 0.0] if p.greedy else [p.temperature, p.top_k, p.top_p, p.min_p] for p in params]
            gens = [batch.generators[rows[j]] for j in chain]
            sampling = DraftSampling(
                torch.tensor(rules, dtype=torch.float64),
                self._merge_order if scored else None,
                lambda i, which: [torch.rand(1, dtype=torch.float64, generator=gens[a]).item() for a in which],
            )
        tokens, appended, drawn = self.model.draft(  # type: ignore[attr-defined]
            self.cache, lead, [states[j].slot for j in chain], [max_tokens[rows[j]] - done for j in chain],
            self._head_native, self._head_ids, more=self._pool_native if scored else None,
            more_ids=self._pool_ids if scored else None, blocked=blocked, keep=keep, sampling=sampling,
        )  # fmt: skip
        for j, row_tokens, fed in zip(chain, tokens, appended, strict=True):
            states[j].fed += fed
            b = rows[j]
            for t, token in enumerate(row_tokens, start=done):
                ids[b, t] = token
                drafted[b].append(token)
        if laws is not None and drawn is not None:  # [A, L, W] in merged column order -> [n, K, V]
            columns = self._merged_ids if scored else self._head_ids
            assert columns is not None
            width = max(len(row_tokens) for row_tokens in tokens)  # (positions past it: never drafted)
            laws[:, :width].zero_()
            for a, j in enumerate(chain):
                laws[rows[j], :width].index_copy_(1, columns, drawn[a, :width])

    def _first_greedy_pass(
        self, states: Sequence[_State], pieces: Sequence[Sequence[int]]
    ) -> list[tuple[int, float] | None]:
        """:meth:`_draft_natively`'s first greedy pass in Python (a prompt's catch-up on the
        model's prefill path): each row's greedy token and its confidence by ``ops.greedy_pick``
        (None: none)."""
        from verispec.kernels import load

        h = self._hidden(states, pieces, torch.tensor([[len(p) - 1] for p in pieces]))[:, 0]  # [R, C]
        for state, piece in zip(states, pieces, strict=True):
            state.fed += len(piece)
        assert self._head_module is not None
        scored, blocked = self._own_ids(states) if self.context_ids else (False, None)
        more = self._pool_module(h) if scored and self._pool_module is not None else None  # [R, E]
        picked, confidence, ok = load().greedy_pick(
            self._head_module(h), self._head_ids, more, self._pool_ids if scored else None, blocked
        )
        picks = zip(picked.tolist(), confidence.tolist(), ok.tolist(), strict=True)
        return [(token, f) if good else None for token, f, good in picks]

    @staticmethod
    def _without_mode(logits: Tensor) -> list[int]:
        """The rows of ``logits`` ``[A, V]`` with no mode to draft: a largest logit that is not
        finite (NaN or +inf from the model, or every token at -inf), as :func:`build_laws` finds them."""
        finite = torch.isfinite(logits.amax(dim=1))  # (amax propagates NaN)
        return [] if bool(finite.all()) else (~finite).nonzero()[:, 0].tolist()

    @staticmethod
    def _stops(
        batch: BatchView, rows: Sequence[int], drafted: int, logits: Tensor, law: Tensor | None, picked: Tensor
    ) -> set[int]:
        """Ask ``batch.stop`` about each row's ``drafted``-th token (``picked`` ``[A]``, drawn from
        ``law`` ``[A, V]``, the draft's ``logits`` ``[A, V]`` before the request's processing) and
        return the rows whose draft ends here. A token's confidence is its probability under the
        law it was drawn from; a greedy request's law is a point mass, so there it is the top
        token's probability at temperature 1 (``law`` None: every row is greedy)."""
        assert batch.stop is not None
        greedy = [batch.params[b].greedy for b in rows]
        if law is None:
            drawn = torch.softmax(logits, dim=-1).amax(dim=-1)  # [A]
        else:
            drawn = law.gather(1, picked[:, None])[:, 0]  # [A]
            if any(greedy):
                top = torch.softmax(logits, dim=-1).amax(dim=-1)  # [A]
                drawn = torch.where(torch.tensor(greedy, device=drawn.device), top, drawn)
        confidence = drawn.tolist()
        return {b for b, f in zip(rows, confidence, strict=True) if not batch.stop.keep_drafting(b, drafted, f)}

    @staticmethod
    def _scatter_rows(law: Tensor, rows: Sequence[int], n: int) -> Tensor:
        """``law`` ``[A, H]`` placed at batch ``rows`` of a zero ``[n, H]`` (itself when they are all)."""
        if len(rows) == n:
            return law
        out = law.new_zeros((n, law.shape[1]))
        out[torch.tensor(rows, device=law.device)] = law
        return out

    @staticmethod
    def _drafted_matrix(drafted: Sequence[Sequence[int]], width: int) -> Tensor:
        out = torch.full((len(drafted), width), PAD_ID, dtype=torch.long)
        for row, toks in enumerate(drafted):
            if toks:
                out[row, : len(toks)] = torch.tensor(toks[:width], dtype=torch.long)
        return out

    def _histories(self, batch: BatchView, rows: Sequence[int], states: Sequence[_State]) -> list[TokenHistory] | None:
        if not any(batch.params[b].uses_history for b in rows):
            return None
        return [
            TokenHistory.from_ids(
                [s.context[: s.prompt_len]], [s.context[s.prompt_len :]], self.vocab_size, self.model.device
            )
            for s in states
        ]


def restricted_head(model: LanguageModel, ids: Tensor) -> torch.nn.Module:
    """``model``'s LM head scoring only ``ids`` (``[H]`` int64): a head on verispec's kernels (bf16,
    int8 or Q4_K) sliced as it is, computing exactly the full head's scores for its ids at the
    kernel's speed; otherwise its weight rows in the model's dtype (:class:`ConfigError` when the
    model does not expose them)."""
    head = model.lm_head
    if head is not None and model.cpu_kernels:
        from verispec.kernels.linear import select_rows

        module = select_rows(head, ids)
        if module is not None:
            from verispec.kernels.hugepages import move_to_huge_pages

            move_to_huge_pages(module)  # (read on every draft pass, like the model's own weights)
            return module
    weight = model.lm_weight
    if weight is None:
        raise ConfigError(f"{type(model).__name__} does not expose its LM head, so it cannot be restricted")
    linear = torch.nn.Linear(weight.shape[1], ids.numel(), bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight.data = weight.index_select(0, ids).contiguous()
    return linear.requires_grad_(False)
