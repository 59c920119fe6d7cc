"""The drafter protocol: how draft tokens are proposed, and what a drafter sees of the batch.

Lifecycle per request (as in llama.cpp's ``common/speculative.h`` and transformers'
``CandidateGenerator``): ``begin`` when the request joins, then each step ``propose`` for the whole
running batch and ``observe`` with the tokens the rule committed, and ``end`` when it leaves.
``begin`` hands the drafter the request's own token list (prompt, then output), which the engine
extends as it commits tokens: a drafter reads it and keeps no copy, and ``observe`` tells it how
many tokens the step committed (for its cache bookkeeping), whether or not they are appended yet.
A drafter keeps its per-request state (KV caches, n-gram indices) keyed by request id; the engine never
branches on the drafter's type: plain decoding is a drafter that proposes nothing
(:mod:`verispec.drafters.plain`), and the policy reads the one declared capability, ``proposes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.config import SamplingParams
from verispec.verify.base import Draft


class DraftStop(Protocol):
    """Ends a row's draft early by the confidence of its tokens (the policy's, see
    :mod:`verispec.engine.confidence`). A drafter that honours it (``stops_early = True``) calls
    :meth:`keep_drafting` after every draft token it draws, the last one included, and drafts the
    next position only on True; it never takes back a token it drew (that would change the law the
    token was drawn from)."""

    def keep_drafting(self, row: int, drafted: int, confidence: float) -> bool:
        """After row ``row``'s ``drafted``-th token, whose draft confidence is ``confidence`` (the
        draft's probability of that token; of its top token at temperature 1 for a greedy request):
        whether to draft another."""
        ...


def seeded_sample(params: SamplingParams, generator: torch.Generator | None) -> bool:
    """Whether a row is a seeded sampled request, whose text must follow from its prompt,
    parameters and seed alone (with a fixed K: the same batched or alone, whatever ran before).
    Its drafts may then not read what other requests leave behind (the suffix drafter's corpus of
    finished outputs): every draft is exact, but a different draft spends the seed's randomness
    differently. A greedy row takes the target's mode whatever is drafted; an unseeded one
    promises no text."""
    return generator is not None and params.seed is not None


@dataclass(frozen=True)
class BatchView:
    """What a drafter may read of the running batch, one entry per row.

    ``params`` and ``generators`` are each request's sampling parameters and generator (None for
    greedy requests); ``budgets[b]`` (when the engine gives them) is the most draft tokens a
    drafter whose tokens cost nothing may propose for request b instead of the scheduled draft
    length (see :class:`~verispec.drafters.composite.CompositeDrafter`): the policy's ceiling,
    within the request's remaining token allowance. A drafter keeps the committed tokens it needs
    from ``begin`` and ``observe``.
    """

    request_ids: Sequence[str]
    params: Sequence[SamplingParams]
    generators: Sequence[torch.Generator | None]
    budgets: Sequence[int] | None = None
    #: the most draft nodes row b may propose at all (its remaining token allowance less the
    #: bonus token: what its KV cache holds), for drafters whose draft is not a chain of K (trees)
    room: Sequence[int] | None = None
    #: a static tree (its parents, -1 the root) the policy planned for row b, which a drafter that
    #: grows trees from a model draws instead of its own shape (None: its own shape)
    shapes: Sequence[tuple[int, ...] | None] | None = None
    #: the policy's early stop for chain drafts (None: draft each row to its length); drafters that
    #: do not declare ``stops_early`` ignore it, and the policy then schedules them as without it
    stop: DraftStop | None = None

    def __len__(self) -> int:
        return len(self.request_ids)


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens. ``max_tokens[b]`` is the draft length the scheduler allows row b
    (0 = draft nothing for it); the returned :class:`~verispec.verify.Draft` may propose fewer."""

    #: The name users give it (``--drafter``), reported by the CLI, the server and its metrics.
    name: ClassVar[str]
    #: False only for plain decoding (:class:`~verispec.drafters.plain.PlainDrafter`): the policy
    #: then schedules no draft at all.
    proposes: ClassVar[bool]
    #: True for drafters that draft from the target's own last hidden states (Medusa heads, the
    #: EAGLE head): the engine then hands them, after the prefill and after every step, the hidden
    #: states that produced the tokens just committed (:class:`TargetHiddenDrafter`).
    uses_target_hidden: ClassVar[bool]
    # Context tokens the last propose() had to feed before drafting (a prompt, or tokens committed
    # while speculation was off); the policy does not take such a step's time as the draft cost.
    last_catchup_tokens: int
    # A drafter whose draft tokens are not each one sequential pass (the composite: a lookup's
    # tokens cost none) may also set ``last_draft_passes: int``, the passes the last propose() ran;
    # the engine reads it where present (else the longest draft) to divide the draft time by.
    # It may also set ``last_free_rows: tuple[bool, ...]``, per row of the last proposal whether
    # its draft cost no model pass (a lookup's): the policy then keeps such rows out of the
    # acceptance it expects of the model's drafts, and the request's stats count them apart; and
    # declare ``free_when_off = True`` to be asked for such drafts on steps the policy schedules
    # no draft for (the rows' ``BatchView.budgets`` then say how far they may go).
    # A chain drafter that declares ``stops_early = True`` honours ``BatchView.stop``: the policy
    # then schedules its rows to a ceiling and lets the stop end each draft where its confidence
    # says the next token is not worth its pass.

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...
    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft: ...
    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None: ...
    def end(self, request_id: str) -> None: ...


@runtime_checkable
class TargetHiddenDrafter(Drafter, Protocol):
    """A drafter that reads the target's hidden states (``uses_target_hidden = True``)."""

    def observe_hidden(self, request_id: str, hidden: Tensor) -> None:
        """``hidden`` ``[N, C]``: the target's last hidden states (after its final norm) at the N
        positions whose logits gave the tokens just committed, in order: after the prefill the
        prompt's every position (the last one gave the first token), after a step the pending
        token's and the accepted path's (N = accepted + 1). Called after ``observe`` with those
        tokens; ``hidden[-1]`` is what predicts the tokens after the last one."""
        ...
