"""Measurements of the engine's steps: what the draft-length policy and the benchmarks read.

One :class:`StepRecord` per decode step (batch size, draft tokens and accepted tokens per row,
draft and verification time), the last ``maxlen`` of them kept; and each request's own timings
(:class:`~verispec.engine.request.Timings`) charged as its tokens are committed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from verispec.engine.request import Request

#: Context tokens a drafter feeds before drafting in steady state: the last committed token, plus
#: the last draft token after a full acceptance.
STEADY_CATCHUP = 2


@dataclass
class StepRecord:
    """Measurements of one decode step (the policy and the benchmarks read these)."""

    batch: int
    num_passes: int  # sequential draft passes (the largest k of the step)
    draft_tokens: list[int]
    accepted: list[int]
    draft_seconds: float
    verify_seconds: float
    catchup_tokens: int = 0  # context the drafter fed before drafting (see STEADY_CATCHUP)
    draft_passes: int | None = None  # the draft model's sequential passes, when the drafter says; None: num_passes
    free_rows: tuple[bool, ...] = ()  # per row: its draft cost no model pass (a composite's lookup); (): none did

    @property
    def passes(self) -> int:
        """The step's sequential draft passes: what its draft time paid for (a composite step whose
        rows a lookup drafted ran fewer than its longest draft, or none)."""
        return self.num_passes if self.draft_passes is None else self.draft_passes

    @property
    def draft_sample(self) -> float | None:
        """The draft time as a sample of what drafting costs, or None when the draft pass first
        caught up on a prompt or on tokens committed while speculation was off (the policy would
        otherwise mistake that one-off cost for the price of a draft token), or when no draft pass
        ran (lookup drafts only: their near-zero time is no price of a model pass)."""
        return self.draft_seconds if self.catchup_tokens <= STEADY_CATCHUP and self.passes > 0 else None


class StepRecorder:
    """Times the phases of each step: ``start()``, ``drafted()``, ``verified()``, then
    :meth:`record` keeps the step's :class:`StepRecord`."""

    def __init__(self, maxlen: int = 4096) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=maxlen)
        self._start = self._drafted = self._verified = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def drafted(self) -> None:
        self._drafted = time.perf_counter()

    def verified(self) -> None:
        self._verified = time.perf_counter()

    def record(
        self,
        draft_tokens: list[int],
        accepted: list[int],
        catchup_tokens: int,
        draft_passes: int | None = None,
        free_rows: tuple[bool, ...] = (),
    ) -> StepRecord:
        step = StepRecord(
            len(draft_tokens), max(draft_tokens, default=0), draft_tokens, accepted,
            self._drafted - self._start, self._verified - self._drafted, catchup_tokens if any(draft_tokens) else 0,
            draft_passes if any(draft_tokens) else None, free_rows if any(free_rows) else (),
        )  # fmt: skip
        self.steps.append(step)
        return step

    def charge(
        self,
        step: StepRecord,
        rows: Sequence[tuple[Request, int, int, tuple[Sequence[int], Sequence[int]] | None, bool]],
    ) -> None:
        """Each request's share of the step, for ``(request, draft tokens, accepted, tree, free)``
        rows (``tree``: a tree draft's parents and accepted path, else None; ``free``: a draft that
        cost no model pass): its acceptance figures, its draft and verification time, one more
        step, and the moment its new tokens were committed."""
        for req, drafted, accepted, tree, free in rows:
            req.stats.observe(drafted, accepted, free)
            if tree is not None:
                req.stats.observe_tree(*tree)
            req.timings.steps += 1
            req.timings.draft_seconds += step.draft_seconds
            req.timings.verify_seconds += step.verify_seconds
            req.timings.chunk_times.append(self._verified)
