"""The speculative engine: draft, verify in one target pass, commit, for a batch of requests.

One step (ARCHITECTURE section 1), for the running batch:

1. the policy picks each request's draft length ``k_b`` (0 = no speculation for it), and a tree
   for it where the policy plans trees (``--tree auto``);
2. the drafter proposes up to ``k_b`` tokens per request (ragged: ``Draft.num_tokens``), or a tree;
3. ONE target pass over ``[pending token, draft tokens]`` per request (right-padded, each sequence
   at its own cache length) gives ``K + 1`` laws per request through :func:`~verispec.sampling.to_probs`;
4. the acceptance rule keeps a prefix of each draft and emits one more token;
5. each request's KV cache keeps the pending token plus its accepted tokens (O(1) rollback), the
   new tokens are committed (EOS, stop strings and max_tokens may end the request inside the
   block), and the drafter and the policy observe what happened (a drafter that declares
   ``uses_target_hidden``, Medusa heads or the EAGLE head, also gets the target's hidden states
   that produced the tokens just committed: the same pass, no second one).

Plain decoding is the same loop with K = 0: the same target pass, the same ``to_probs``, the same
rule with an empty draft, the same randomness. A request's draws come only from its own generator,
so a seeded request gives the same output batched or alone. Requests join (after a prefill that
produces their first token) and leave between steps: continuous batching.

Model logits wider than the tokenizer's vocabulary (padded embedding matrices) are cut to the
tokenizer's vocabulary for every model, so the draft and target laws share one support and no
undecodable id is ever produced; plain decoding applies the same cut.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from verispec.config import EngineConfig, SamplingParams, check_text
from verispec.drafters.base import BatchView, Drafter, DraftStop, TargetHiddenDrafter
from verispec.drafters.plain import PlainDrafter
from verispec.engine.policy import DraftPolicy, TreeStep, make_policy
from verispec.engine.recorder import StepRecord, StepRecorder
from verispec.engine.request import Request, RequestOutput
from verispec.errors import ConfigError, InputError, VerispecError
from verispec.formats.tokenizer import Tokenizer
from verispec.models.protocol import LanguageModel
from verispec.models.transformer import PREFILL_MIN_TOKENS, ForwardOutput, tree_attention_mask
from verispec.sampling import Laws, TokenHistory, build_laws, cut_vocab, make_generator, mode
from verispec.verify import Draft, make_rule
from verispec.verify.rejection import RejectionRule, greedy_verdict

log = logging.getLogger(__name__)


class Engine:
    """Speculative (or plain) generation for many requests at once; see the module docstring.

    ``target``: the model whose distribution the output follows. ``drafter``: where draft tokens
    come from (None = plain decoding: :class:`~verispec.drafters.plain.PlainDrafter`).
    ``tokenizer``: for text prompts, streaming text and stop strings (token ids work without one).
    ``vocab_limit``: ids the tokenizer defines (default: the tokenizer's size, else the model's
    logits width).
    """

    def __init__(
        self,
        target: LanguageModel,
        tokenizer: Tokenizer | None = None,
        drafter: Drafter | None = None,
        config: EngineConfig | None = None,
        *,
        policy: DraftPolicy | None = None,
        vocab_limit: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.target = target
        self.tokenizer = tokenizer
        self.drafter: Drafter = drafter if drafter is not None else PlainDrafter()
        self.rule = make_rule(self.config.spec, check_values=False)
        self.lossless = bool(self.rule.lossless)
        self.vocab_size = target.config.vocab_size
        limit = vocab_limit if vocab_limit is not None else (tokenizer.vocab_size if tokenizer else None)
        self.vocab_limit = min(self.vocab_size, limit) if limit else self.vocab_size
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
            if not eos_token_ids and target.config.eos_token_id is not None:
                eos_token_ids = (target.config.eos_token_id,)
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache = target.new_cache(self.config.max_batch, self.config.max_len)
        self.policy = policy or make_policy(self.config, speculative=self.drafter.proposes)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.recorder = StepRecorder()
        self._ids = itertools.count()
        self._live: set[str] = set()  # ids of queued and running requests

    @property
    def steps(self) -> deque[StepRecord]:
        """The measurements of the last decode steps (:class:`~verispec.engine.recorder.StepRecorder`)."""
        return self.recorder.steps

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request (text, or token ids); returns its id. Checks everything that can be
        checked before it runs and raises a typed error with a remedy."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("this engine has no tokenizer: pass the prompt as token ids")
            check_text("prompt", prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("the prompt is empty; give at least one token of text")
        bad = [t for t in ids if not 0 <= t < self.vocab_limit]
        if bad:
            raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_limit})")
        if len(ids) + params.max_tokens > self.config.max_len:
            raise ConfigError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.config.max_len} tokens; lower max_tokens or shorten the prompt"
            )
        for token in params.logit_bias or {}:
            if token >= self.vocab_limit:
                raise ConfigError(f"logit_bias names token {token}, outside the vocabulary [0, {self.vocab_limit})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._live:
            raise InputError(f"request id {rid!r} is already in use; request ids must be unique")
        self._live.add(rid)
        generator = None if params.greedy else make_generator(params.seed, self.target.device)
        req = Request(rid, ids, params, generator, self.tokenizer, self.eos_token_ids, self.config.max_len - len(ids))
        if params.uses_history:
            req.history = TokenHistory.from_ids([ids], [[]], self.vocab_size, self.target.device)
        self.waiting.append(req)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now (its slot and caches are freed at once). False if unknown."""
        for req in itertools.chain(self.waiting, self.running):
            if req.request_id == request_id and not req.finished:
                req.finish_reason = "abort"
                self._retire()
                self.waiting = deque(r for r in self.waiting if not r.finished)
                self._live.discard(request_id)
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.finished for r in self.running)

    # ---------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill: their first token), then one decode step for the batch."""
        outputs: list[RequestOutput] = []
        joining: list[Request] = []
        while self.waiting and len(self.running) < self.config.max_batch:
            req = self.waiting.popleft()
            self.running.append(req)
            joining.append(req)
        if joining:
            outputs.extend(self._prefill(joining))
        active = [r for r in self.running if not r.finished]
        if active:
            outputs.extend(self._decode(active))
        self._retire()
        return outputs

    def run(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding each step's outputs."""
        while self.has_unfinished():
            yield from self.step()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion (batched); final outputs in prompt order."""
        plist = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        for out in self.run():
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    # -------------------------------------------------------------------------------- prefill
    def _prefill(self, batch: list[Request]) -> list[RequestOutput]:
        """Feed the prompts of joining requests (batched, in chunks) and emit their first tokens
        (plain sampling through the rule, K = 0)."""
        start = time.perf_counter()
        try:
            for req in batch:
                req.slot = self.cache.add_sequence()
            last, prompt_hidden = self._feed_prompts(batch)  # [B, V], B x [P_b, C] | None
        except VerispecError as exc:
            return [self._fail(req, exc) for req in batch]
        _, rows, _, failed = self._judge(last.unsqueeze(1), batch, self._empty_draft(len(batch)))
        first = [row[0] if row else -1 for row in rows]
        now = time.perf_counter()
        outputs = [self._fail(batch[i], exc) for i, exc in failed.items()]
        for i, (req, token) in enumerate(zip(batch, first, strict=True)):
            if i in failed:
                continue
            req.timings.first_token = now
            req.timings.chunk_times.append(now)
            req.timings.prefill_seconds += now - start
            try:
                self.drafter.begin(req.request_id, req.tokens)
                self.drafter.observe(req.request_id, [token])
                if prompt_hidden is not None:  # every prompt position (the last predicts what follows the first token)
                    cast(TargetHiddenDrafter, self.drafter).observe_hidden(req.request_id, prompt_hidden[i])
                outputs.append(self._commit(req, [token]))
            except Exception as exc:  # one request's failure must not take the others down
                log.exception("request %s failed after prefill", req.request_id)
                outputs.append(self._fail(req, exc))
        return outputs

    def _feed_prompts(self, batch: list[Request]) -> tuple[Tensor, list[Tensor] | None]:
        """Run every prompt through the target in chunks of ``prefill_chunk`` tokens; return the
        logits ``[B, V]`` after each prompt's last token, and each prompt's hidden states
        ``[P_b, C]`` when the drafter reads them (else None). A chunk's piece of
        :data:`~verispec.models.transformer.PREFILL_MIN_TOKENS` tokens or more takes the model's
        prefill path, one prompt a pass (so its keys and values depend on its own tokens alone);
        shorter pieces go together (ragged rows, right-padded) as decoding steps do."""
        chunk = self.config.prefill_chunk
        lengths = [r.prompt_len for r in batch]
        last: list[Tensor | None] = [None] * len(batch)
        hidden: list[list[Tensor]] = [[] for _ in batch]
        for offset in range(0, max(lengths), chunk):
            rows = [i for i, n in enumerate(lengths) if n > offset]
            long = [i for i in rows if min(lengths[i], offset + chunk) - offset >= PREFILL_MIN_TOKENS]
            short = [i for i in rows if i not in long]
            groups = [([i], True) for i in long] + ([(short, False)] if short else [])
            for group, prefill in groups:
                pieces = [batch[i].tokens[offset : min(offset + chunk, lengths[i])] for i in group]
                logits, piece_states = self._feed_pieces(batch, group, pieces, prefill)
                for j, i in enumerate(group):
                    if piece_states is not None:
                        hidden[i].append(piece_states[j, : len(pieces[j])])  # [n, C]
                    if lengths[i] <= offset + chunk:
                        last[i] = logits[j, 0]
        states = [torch.cat(h) for h in hidden] if self.drafter.uses_target_hidden else None
        return torch.stack([t for t in last if t is not None]), states

    def _feed_pieces(
        self, batch: list[Request], rows: list[int], pieces: list[list[int]], prefill: bool
    ) -> tuple[Tensor, Tensor | None]:
        """One target pass over ``pieces`` (prompt tokens of ``batch[rows]``, right-padded); the
        logits ``[R, 1, V]`` after each piece's last token and, when the drafter reads them, the
        hidden states ``[R, T, C]``."""
        device = self.target.device
        width = max(len(p) for p in pieces)
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for j, piece in enumerate(pieces):
            tokens[j, : len(piece)] = torch.tensor(piece, dtype=torch.long)
        num_new = [len(p) for p in pieces]
        at = torch.tensor([[n - 1] for n in num_new], device=device)
        slots = [batch[i].cache_slot for i in rows]
        run = self.target.forward_with_hidden if self.drafter.uses_target_hidden else self.target.forward
        out = run(tokens.to(device), None, self.cache, num_new=num_new, slots=slots, logits_at=at, prefill=prefill)
        if isinstance(out, ForwardOutput):
            return out.logits, out.hidden
        return out, None

    # --------------------------------------------------------------------------------- decode
    def _decode(self, batch: list[Request]) -> list[RequestOutput]:
        """One step for the running batch, the six steps of ARCHITECTURE section 1."""
        budgets = [r.max_output - r.num_output - 1 for r in batch]  # drafting past max_tokens is waste
        ks = self.policy.draft_lengths(batch, budgets)  # 1. a draft length per request (0 = none)
        shapes = self.policy.tree_shapes(batch, ks)  # (and a tree per request, where the policy plans trees)
        # (or, for a drafter that ends drafts by their confidence, a ceiling and the stop that ends them)
        stop = self.policy.draft_stop(batch, ks, budgets) if getattr(self.drafter, "stops_early", False) else None
        lengths = stop.lengths if stop is not None else ks
        self.recorder.start()
        draft = self._propose(batch, lengths, self.policy.ceilings(budgets, ks), budgets, shapes, stop)  # 2. propose
        self.recorder.drafted()
        counts = draft.num_tokens.tolist()  # host ints: drafters build drafts on the host
        logits, hidden = self._verify_pass(batch, draft, counts)  # 3. one target pass: [B, K + 1, V] fp32
        draft = self._on_device(draft, self.target.device)
        accepted, rows, paths, failed = self._judge(logits, batch, draft)  # 4-5. laws, then the rule
        self._keep_accepted(batch, draft, accepted, paths)  # 6. commit: the accepted path's KV stays
        self.recorder.verified()
        # (a drafter whose drafts are not all model passes, the composite, says how many it ran)
        passes: int | None = getattr(self.drafter, "last_draft_passes", None)
        free: tuple[bool, ...] = getattr(self.drafter, "last_free_rows", ())  # (rows without a draft ignore it)
        free = free if len(free) == len(batch) else (False,) * len(batch)
        step = self.recorder.record(counts, accepted, self.drafter.last_catchup_tokens, passes, free)
        healthy = [i for i in range(len(batch)) if i not in failed]
        if stop is not None:  # what each confidence was worth (a lookup's rows were not the model's drafts)
            stop.settle(counts, accepted, [i in failed or free[i] for i in range(len(batch))])
        trees: list[TreeStep | None] = [None] * len(batch)
        if draft.is_tree:  # which child was accepted at each level (Sequoia's positional acceptance)
            assert draft.parents is not None
            parents = draft.parents.tolist()
            for i in healthy:
                trees[i] = (parents[i][: counts[i]], paths[i])
        self.policy.observe(batch, counts, accepted, step.draft_sample, step.verify_seconds, trees, step.passes, free)
        self.recorder.charge(step, [(batch[i], counts[i], accepted[i], trees[i], free[i]) for i in healthy])
        outputs = [self._fail(batch[i], exc) for i, exc in failed.items()]
        for i in healthy:
            try:
                self.drafter.observe(batch[i].request_id, rows[i])
                if hidden is not None:  # the positions whose logits gave the committed tokens
                    at = [0] + ([p + 1 for p in paths[i]] if draft.is_tree else list(range(1, accepted[i] + 1)))
                    at = at[: len(rows[i])]
                    cast(TargetHiddenDrafter, self.drafter).observe_hidden(batch[i].request_id, hidden[i, at])
                outputs.append(self._commit(batch[i], rows[i]))
            except Exception as exc:  # one request's failure must not take the batch down
                log.exception("request %s failed while committing", batch[i].request_id)
                outputs.append(self._fail(batch[i], exc))
        return outputs

    def _propose(
        self,
        batch: list[Request],
        ks: list[int],
        ceilings: list[int],
        room: list[int],
        shapes: list[tuple[int, ...] | None] | None,
        stop: DraftStop | None = None,
    ) -> Draft:
        """The drafter's proposal for the rows with ``ks[b] > 0`` (nothing is asked of it, and no
        randomness spent, when no row drafts, unless it drafts free tokens on such steps:
        ``free_when_off``, the composite's lookup, within the rows' ``ceilings``); a drafter fault
        costs this step its draft."""
        if not any(ks) and not (getattr(self.drafter, "free_when_off", False) and any(ceilings)):
            return self._empty_draft(len(batch))
        room = [min(r, self.config.max_draft_tokens) for r in room]
        view = BatchView(
            [r.request_id for r in batch], [r.params for r in batch], [r.generator for r in batch], ceilings, room,
            shapes, stop,
        )  # fmt: skip
        try:
            return self.drafter.propose(view, ks)
        except Exception:  # never a request's life
            log.exception("the drafter failed; this step decodes without a draft")
            return self._empty_draft(len(batch))

    def _verify_pass(self, batch: list[Request], draft: Draft, counts: list[int]) -> tuple[Tensor, Tensor | None]:
        """ONE target pass over ``[pending token, draft tokens]`` per row (right-padded, each row at
        its own cache length): logits ``[B, K + 1, V]`` fp32, and the last hidden states
        ``[B, K + 1, C]`` when the drafter reads them (else None). A tree's nodes see their
        ancestors only (tree mask) at positions ``length + depth``, so each node's logits are those
        of its path decoded alone."""
        device = self.target.device
        pending = torch.tensor([[r.pending] for r in batch], dtype=torch.long, device=device)  # [B, 1]
        tokens = torch.cat([pending, draft.token_ids.to(device).clamp_min(0)], dim=1)  # [B, K + 1]
        slots = [r.cache_slot for r in batch]
        positions: Tensor | None = None
        mask: Tensor | None = None
        if draft.is_tree:
            assert draft.parents is not None
            step_parents = torch.cat([torch.full_like(pending, -1), draft.parents.to(device).clamp_min(-1) + 1], 1)
            mask = tree_attention_mask(step_parents)  # [B, K + 1, K + 1]
            lengths = self.cache.lengths.index_select(0, torch.tensor(slots, device=self.cache.lengths.device))
            positions = lengths.to(device).unsqueeze(1) + mask.sum(dim=2) - 1  # [B, K + 1]: length + depth
        num_new = [1 + n for n in counts]
        extra: dict[str, Any] = {} if mask is None else {"attn_mask": mask}  # (chains: no mask, any model takes them)
        if self.drafter.uses_target_hidden:
            out = self.target.forward_with_hidden(tokens, positions, self.cache, num_new=num_new, slots=slots, **extra)
            return out.logits, out.hidden
        return self.target.forward(tokens, positions, self.cache, num_new=num_new, slots=slots, **extra), None

    def _keep_accepted(self, batch: list[Request], draft: Draft, accepted: list[int], paths: list[list[int]]) -> None:
        """Roll the target's cache back to the committed tokens: a chain keeps the first 1 +
        accepted entries of the step; a tree moves its accepted path's entries into place."""
        slots = [r.cache_slot for r in batch]
        if not draft.is_tree:
            self.cache.keep_step_prefix([1 + a for a in accepted], slots)
            return
        keep = torch.zeros((len(batch), 1 + max(accepted, default=0)), dtype=torch.long)  # [B, M]: step offsets
        for b, path in enumerate(paths):
            keep[b, 1 : 1 + len(path)] = torch.tensor(path, dtype=torch.long) + 1  # (the rest is ignored)
        self.cache.compact(slots, keep, [1 + a for a in accepted])

    def _judge(
        self, logits: Tensor, batch: list[Request], draft: Draft
    ) -> tuple[list[int], list[list[int]], list[list[int]], dict[int, VerispecError]]:
        """Laws and verdicts for the batch: accepted counts, output tokens and accepted tree nodes
        (empty for chains) per row, and the rows that failed. A row whose laws cannot be built (NaN
        logits, every token banned, ...) fails alone and the others are judged without it; their
        randomness is untouched, as each request draws only from its own generator."""
        greedy = self._judge_greedy(logits, batch, draft)
        if greedy is not None:
            return greedy
        b, t, _ = logits.shape
        laws = self._laws(logits, batch, draft)
        failed: dict[int, VerispecError] = {}
        for row, exc in sorted(laws.failed.items()):
            failed.setdefault(row // t, exc)
        keep = [i for i in range(b) if i not in failed]
        accepted: list[int] = [0] * b
        rows: list[list[int]] = [[] for _ in range(b)]
        paths: list[list[int]] = [[] for _ in range(b)]
        if not keep:
            return accepted, rows, paths, failed
        probs = laws.probs.reshape(b, t, -1)
        if failed:
            index = torch.tensor(keep, device=probs.device)
            probs, draft = probs.index_select(0, index), self._draft_rows(draft, keep)
        kept, kept_rows, kept_paths, bad = self._verify(draft, probs, [batch[i] for i in keep])
        for j, i in enumerate(keep):
            accepted[i], rows[i], paths[i] = kept[j], kept_rows[j], kept_paths[j]
            if j in bad:
                failed[i] = bad[j]
        return accepted, rows, paths, failed

    def _judge_greedy(
        self, logits: Tensor, batch: list[Request], draft: Draft
    ) -> tuple[list[int], list[list[int]], list[list[int]], dict[int, VerispecError]] | None:
        """:meth:`_judge` for a chain of greedy rows with no bias or penalty under the rejection rule:
        its verdict from the target's modes (:func:`~verispec.verify.rejection.greedy_verdict`), the
        same as the rule gives on the one-hot laws build_laws would make, without those laws of V ids
        per position (~1 ms a step for 5 positions of 151,936). None for anything else, and where a
        position has no mode (a NaN, no finite logit), which the general path reports."""
        if type(self.rule) is not RejectionRule or draft.is_tree or not all(r.params.plain_greedy for r in batch):
            return None
        b, t, v = logits.shape
        cut_vocab(logits, self.vocab_limit)
        x = logits.reshape(b * t, v)
        if not bool(torch.isfinite(x.amax(dim=1)).all()):  # (amax propagates NaN)
            return None
        verdict = greedy_verdict(draft, mode(x).reshape(b, t))
        return verdict.num_accepted.tolist(), verdict.tokens(), [[] for _ in batch], {}

    def _verify(
        self, draft: Draft, probs: Tensor, batch: list[Request]
    ) -> tuple[list[int], list[list[int]], list[list[int]], dict[int, VerispecError]]:
        """The rule's verdict on ``probs`` ``[B, K + 1, V]``; if it refuses the batch (a draft whose
        reported law is not a law, ...), each row again on its own, so that only the culprit fails."""
        try:
            verdict = self.rule.verify(draft, probs, [r.generator for r in batch])
            num = verdict.num_accepted.tolist()
            paths: list[list[int]] = [[] for _ in num]
            if verdict.path is not None:
                paths = [p[:n] for p, n in zip(verdict.path.tolist(), num, strict=True)]
            return num, verdict.tokens(), paths, {}
        except VerispecError as exc:
            if len(batch) == 1:
                return [0], [[]], [[]], {0: exc}
        accepted: list[int] = []
        rows: list[list[int]] = []
        paths_: list[list[int]] = []
        failed: dict[int, VerispecError] = {}
        for i, req in enumerate(batch):
            a, r, p, bad = self._verify(self._draft_rows(draft, [i]), probs[i : i + 1], [req])
            accepted.append(a[0])
            rows.append(r[0])
            paths_.append(p[0])
            if bad:
                failed[i] = bad[0]
        return accepted, rows, paths_, failed

    @staticmethod
    def _draft_rows(draft: Draft, rows: list[int]) -> Draft:
        return draft.rows(torch.tensor(rows, device=draft.token_ids.device))

    def _laws(self, logits: Tensor, batch: list[Request], draft: Draft) -> Laws:
        """Target laws of the ``B * (K + 1)`` rows of ``logits`` ``[B, K + 1, V]`` (the one
        to_probs path), with the rows that have none."""
        b, t, v = logits.shape
        cut_vocab(logits, self.vocab_limit)
        params = [r.params for r in batch for _ in range(t)]
        history = None
        if any(r.params.uses_history for r in batch):
            rows = [r.history if r.history is not None else self._blank_history() for r in batch]
            base = TokenHistory(torch.cat([h.output_counts for h in rows]), torch.cat([h.prompt_mask for h in rows]))
            parents = draft.parents.to(logits.device) if draft.parents is not None else None
            history = base.for_verification(draft.token_ids.to(logits.device), parents) if t > 1 else base
        return build_laws(logits.reshape(b * t, v), params, history)

    def _blank_history(self) -> TokenHistory:
        zeros = torch.zeros((1, self.vocab_size), dtype=torch.int32, device=self.target.device)
        return TokenHistory(zeros, zeros.bool())

    def _empty_draft(self, batch: int) -> Draft:
        device = self.target.device
        return Draft(
            torch.empty((batch, 0), dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
        )

    @staticmethod
    def _on_device(draft: Draft, device: torch.device) -> Draft:
        if draft.token_ids.device == device:
            return draft
        return draft.to(device)

    # -------------------------------------------------------------------------------- commits
    def _commit(self, req: Request, tokens: Sequence[int]) -> RequestOutput:
        added, delta = req.commit(tokens)
        if req.history is not None and added:
            ids = torch.tensor([added], dtype=torch.long, device=req.history.output_counts.device)
            req.history = req.history.extended(ids)
        req.pending = tokens[-1] if tokens else req.pending
        if req.finished:
            req.timings.finished = time.perf_counter()
        return req.output(added, delta, self.lossless)

    def _fail(self, req: Request, exc: BaseException) -> RequestOutput:
        req.finish_reason = "error"
        req.error = f"{type(exc).__name__}: {exc}"
        req.timings.finished = time.perf_counter()
        return req.output([], "", self.lossless)

    def _retire(self) -> None:
        """Free the slots and drafter state of finished requests."""
        keep = []
        for req in self.running:
            if not req.finished:
                keep.append(req)
                continue
            if req.slot is not None:
                self.cache.remove_sequence(req.slot)
                req.slot = None
            self.drafter.end(req.request_id)
            self._live.discard(req.request_id)
        self.running = keep
