"""How much to speculate: the draft length K per request and per step, from measurements.

The single-request model (Leviathan et al. 2023; :mod:`verispec.analysis`) says a step that drafts
``k`` tokens emits ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` tokens on average (``a_i``: the
probability that draft position ``i`` is accepted given that the positions before it were) and
costs ``k`` draft passes plus one target pass over ``k + 1`` tokens. :class:`MeasuredPolicy`
estimates the ``a_i`` from what the rule actually accepted (each position shrunk towards the
acceptance pooled over positions; a request's towards what the other requests did), and the costs
from the measured step times (exponential moving averages per batch size and pass width), and
picks the ``k`` in ``[0, max]`` that maximises tokens per second. ``k = 0`` (no speculation) wins
when drafting is too expensive for its acceptance, or when the target pass stops being flat in
``k`` (compute-bound: large batches, long contexts), which is "speculate only while decode is
memory-bound", measured instead of assumed.

Costs start from the calibration of the target measured on this machine at first use
(:mod:`verispec.engine.calibrate`), or from a prior (a flat verification curve and a draft pass at
20% of a target pass); the draft's cost is learnt from the first steps; every estimate then follows
the times of real steps (the calibrated curve keeps its shape and takes its level from them).
While speculation is off, a one-token probe draft on two consecutive steps every ``probe_every``
steps keeps the acceptance and draft-cost estimates alive (the second step measures the draft in
steady state), so that speculation comes back when the text becomes predictable again.

With ``confidence_stop`` (the default), a drafter that can end its drafts early (the draft model's
chains) is not held to the chosen ``k``: it drafts up to ``max_k`` and ends each draft after the
first token whose confidence says the next one does not pay for its pass
(:mod:`verispec.engine.confidence`, learnt from the verified steps); ``k`` then only decides whether
to speculate at all. On 16 HumanEval prompts (greedy, the default pair, two Zen 4 cores) that was
1.10x the tokens per second of the chosen ``k`` and 1.05x those of the best fixed ``k``
(``benchmarks/results/confidence_stop_zen4.md``).

The ``a_i`` are those of the drafts K schedules. A composite drafter's lookup drafts (``free_rows``
in :meth:`MeasuredPolicy.observe`) cost no model pass and are not held to K: they are kept out
of the estimates, which would otherwise mix two kinds of draft (on summarisation prompts the
lookups' long chains pulled the estimates down and the model's drafts were cut short; see
``benchmarks/results/composite_free_rows_zen5.md``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from verispec.analysis import TreePlan, optimal_trees, tree_paths
from verispec.config import EngineConfig
from verispec.engine.calibrate import CostTable
from verispec.engine.confidence import ConfidenceTable, CostStop
from verispec.engine.request import Request
from verispec.metrics import SpecStats

#: One tree step of a row as the policy sees it: the draft's parents (-1: the root) and the
#: accepted path (node indices, root first).
TreeStep = tuple[Sequence[int], Sequence[int]]


class DraftPolicy(Protocol):
    """Chooses each request's draft length per step from what it has observed. ``budgets[b]``: the
    draft tokens that can still be useful to request b (its remaining allowance)."""

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]: ...

    def tree_shapes(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...] | None] | None:
        """A static tree (its parents) per request for drafters that grow trees, chosen with the
        draft ``lengths`` just returned; None: each drafter keeps its own shape."""
        ...

    def ceilings(self, budgets: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """The most tokens a drafter whose tokens cost nothing (prompt lookup) may propose per
        request, beside the draft ``lengths`` just scheduled: a fixed K holds for every drafter; a
        chosen K does not bind a free draft, the cost of the wider pass it makes does."""
        ...

    def draft_stop(self, batch: Sequence[Request], lengths: Sequence[int], budgets: Sequence[int]) -> CostStop | None:
        """For a drafter that ends drafts early (``stops_early``), with the draft ``lengths`` just
        scheduled: a stop whose ``lengths`` are the ceilings to draft to instead, or None (draft
        ``lengths``). The engine settles it with the verified outcome."""
        ...

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,  # None: the draft time held a one-off catch-up, not a cost sample
        verify_seconds: float,
        trees: Sequence[TreeStep | None] | None = None,  # tree drafts: each row's tree and accepted path
        draft_passes: int | None = None,  # sequential draft passes the draft time paid for (None: the longest draft)
        free_rows: Sequence[bool] | None = None,  # rows whose draft cost no model pass (a composite's lookup)
    ) -> None: ...


class FixedPolicy:
    """The same K for every request and step (capped by each request's remaining budget)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        return [max(0, min(self.k, b)) for b in budgets]

    def ceilings(self, budgets: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        return self.draft_lengths((), budgets)  # a fixed K binds every drafter

    def draft_stop(self, batch: Sequence[Request], lengths: Sequence[int], budgets: Sequence[int]) -> CostStop | None:
        return None  # a fixed K is what was asked for

    def tree_shapes(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...] | None] | None:
        return None

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,
        verify_seconds: float,
        trees: Sequence[TreeStep | None] | None = None,
        draft_passes: int | None = None,
        free_rows: Sequence[bool] | None = None,
    ) -> None:
        return None


def _interpolate(known: Sequence[tuple[int, float]], width: int) -> float:
    """Seconds of a pass over ``width`` tokens from ``(width, seconds)`` points: linear between
    the nearest two, flat beyond the widest (optimistic, so that it gets measured); 1 s without
    any point."""
    if not known:
        return 1.0
    below = [(w, v) for w, v in known if w <= width]
    above = [(w, v) for w, v in known if w >= width]
    if below and above:
        (w0, v0), (w1, v1) = max(below), min(above)
        return v0 if w1 == w0 else v0 + (v1 - v0) * (width - w0) / (w1 - w0)
    _, v = min(known, key=lambda wv: abs(wv[0] - width))
    return v


class _Ema:
    def __init__(self, weight: float = 0.2) -> None:
        self.value: float | None = None
        self.weight = weight

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


class MeasuredPolicy:
    """Chooses K to maximise expected output tokens per second (see the module docstring)."""

    def __init__(
        self,
        max_k: int,
        prior_accept: float = 0.6,
        prior_weight: float = 4.0,
        costs: CostTable | None = None,
        probe_every: int = 16,
        position_weight: float = 8.0,
        free_widening: float = 0.25,
        confidence_stop: bool = True,
    ) -> None:
        self.max_k = max_k
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight  # of prior_accept against the pooled record
        self.position_weight = position_weight  # of the pooled estimate against one position's record
        # Engine-wide conditional acceptance per position: accepted / reached.
        self.reached = [0.0] * max_k
        self.passed = [0.0] * max_k
        self.per_request: dict[str, tuple[list[float], list[float]]] = {}
        # Costs: target pass time per (batch, width) and draft pass time per batch, as measured in
        # real steps; the calibrated curve and how fast this machine runs it now (real / calibrated).
        self.verify_time: dict[tuple[int, int], _Ema] = defaultdict(_Ema)
        self.draft_pass: dict[int, _Ema] = defaultdict(_Ema)
        # the calibrated curve per batch size: (width, seconds) points
        self.calibrated: dict[int, list[tuple[int, float]]] = {}
        for (b, w), seconds in sorted(costs.seconds.items()) if costs is not None else ():
            self.calibrated.setdefault(b, []).append((w, seconds))
        self.speed = _Ema()
        # what each (query row, cached key) pair adds to a pass past the calibration's context
        # (attention's share, which grows with the context: CostTable.key_seconds), and the mean
        # tokens per row of the batch last planned or observed
        self.key_seconds = costs.key_seconds if costs is not None else 0.0
        self.calibration_context = costs.context if costs is not None else 0
        self.context = 0.0
        self.probe_every = probe_every
        self._idle_steps = 0  # consecutive steps without speculation
        #: the share of the planned pass's cost free drafts may add to it, over the batch (:meth:`ceilings`)
        self.free_widening = free_widening
        #: whether drafters that can end drafts by their confidence draft to ``max_k`` and stop there
        #: (:mod:`verispec.engine.confidence`), with what they learnt of confidence and acceptance
        self.confidence_stop = confidence_stop
        self.confidence = ConfidenceTable(prior_accept=prior_accept)
        # tokens and seconds of speculative steps per batch size (their ratio: the rate a longer draft must beat)
        self.step_tokens: dict[int, _Ema] = defaultdict(_Ema)
        self.step_seconds: dict[int, _Ema] = defaultdict(_Ema)
        self._planned_rate: dict[int, float] = {}  # the last draft_lengths' expected tokens per second

    # ---------------------------------------------------------------------------- estimates
    def acceptance(self, request_id: str | None = None) -> list[float]:
        """Conditional acceptance per draft position (engine-wide, or for one request).

        Each position's record is shrunk towards the pooled acceptance of all positions, the
        constant-alpha model's estimate (accepted / (accepted + rejections), as
        :attr:`~verispec.metrics.SpecStats.alpha`), which starts from ``prior_accept``: a position
        seldom reached (position 2 after a run of one-token drafts, or after one early rejection) is
        expected to do what the draft does on average, and its own record takes over as it grows
        (weight ``position_weight``). Shrinking towards the position before instead let one early
        rejection at position 2 hold a HumanEval run at K = 1 while 90% of drafts were accepted
        (benchmarks/policy_ab.py). For one request the prior is what the other requests did: its
        pooled acceptance is shrunk towards theirs, and its positions follow their positional
        profile scaled to it (each observation counted once)."""
        if request_id is None or request_id not in self.per_request:
            return self._shrunk(self.passed, self.reached, self.prior_accept, [1.0] * self.max_k)
        reached, passed = self.per_request[request_id]
        others_passed = [a - b for a, b in zip(self.passed, passed, strict=True)]
        others_reached = [a - b for a, b in zip(self.reached, reached, strict=True)]
        others_pool = self._pool(others_passed, others_reached, self.prior_accept)
        others = self._shrunk(others_passed, others_reached, self.prior_accept, [1.0] * self.max_k)
        return self._shrunk(passed, reached, others_pool, [a / max(others_pool, 1e-6) for a in others])

    def _pool(self, passed: Sequence[float], reached: Sequence[float], prior: float) -> float:
        """Acceptance pooled over positions, shrunk towards ``prior`` (weight ``prior_weight``)."""
        return (sum(passed) + prior * self.prior_weight) / (sum(reached) + self.prior_weight)

    def _shrunk(
        self, passed: Sequence[float], reached: Sequence[float], prior: float, profile: Sequence[float]
    ) -> list[float]:
        """Each position's record shrunk towards the pooled acceptance times ``profile[i]``."""
        pool, wp = self._pool(passed, reached, prior), self.position_weight
        return [
            min(max((p + min(pool * f, 1.0) * wp) / (r + wp), 0.0), 0.999)
            for p, r, f in zip(passed, reached, profile, strict=True)
        ]

    def pass_seconds(self, batch: int, width: int, context: float | None = None) -> float | None:
        """Estimated seconds of a decode step's target work (the pass, the laws and the rule) over
        ``width`` tokens per row at ``batch`` rows with ``context`` tokens cached per row (None:
        the last batch's): the calibrated curve at today's speed plus attention over the context
        past the calibration's, as :meth:`draft_lengths` prices it; without a calibration, the
        real steps' time at exactly that shape, or None (the neighbouring widths
        :meth:`draft_lengths` falls back on are no measure of this one)."""
        if self.calibrated:
            return self._verify_cost(batch, width, context)
        return self.verify_time[(batch, width)].value if (batch, width) in self.verify_time else None

    def _note_context(self, batch: Sequence[Request]) -> None:
        """The batch's mean tokens per row, which the pass costs of this step depend on."""
        if batch:
            self.context = sum(len(r.tokens) for r in batch) / len(batch)

    def _beyond_calibration(self, batch: int, width: int, context: float | None = None) -> float:
        """Seconds a pass over ``width`` tokens per row adds at ``context`` (None: the last batch's)
        over the calibration's: every query row attends to the extra cached keys."""
        extra = (self.context if context is None else context) - self.calibration_context
        return self.key_seconds * batch * width * max(0.0, extra)

    def _verify_cost(self, batch: int, width: int, context: float | None = None) -> float:
        """Seconds of a target pass over ``width`` tokens per row (see :meth:`_verify_estimate`)."""
        return max(self._verify_estimate(batch, width, context), 1e-9)

    def _verify_estimate(self, batch: int, width: int, context: float | None = None) -> float:
        """The calibrated curve at (batch, width), times how much faster or slower real steps run
        it now: the curve's shape is the calibration's, its level today's (a table cached hours
        before, on a shared machine, was 25% off, and real steps at one width beside calibrated
        values at the others made the measured width look cheap or dear by that much), plus what
        ``context`` cached tokens per row (None: the last batch's) add past the calibration's.
        Without a calibration, the real steps' times."""
        calibrated = self._calibrated_estimate(batch, width)
        if calibrated is not None:
            return calibrated * (self.speed.value or 1.0) + self._beyond_calibration(batch, width, context)
        known = [(w, e.value) for (b, w), e in self.verify_time.items() if b == batch and e.value is not None]
        if not known:
            known = [(w, e.value / b * batch) for (b, w), e in self.verify_time.items() if e.value is not None]
        return _interpolate(known, width)

    def _calibrated_estimate(self, batch: int, width: int) -> float | None:
        """The calibrated seconds of a (batch, width) pass (None without a calibration): linear in
        width, then in batch size between the nearest calibrated ones (proportional to it past
        them)."""
        if not self.calibrated:
            return None

        def at(b: int) -> float:
            return _interpolate(self.calibrated[b], width)

        lower = [b for b in self.calibrated if b <= batch]  # (batch sizes in ascending order)
        upper = [b for b in self.calibrated if b >= batch]
        if lower and upper:
            b0, b1 = lower[-1], upper[0]
            return at(b0) if b0 == b1 else at(b0) + (at(b1) - at(b0)) * (batch - b0) / (b1 - b0)
        b = lower[-1] if lower else upper[0]
        return at(b) * batch / b

    def _draft_cost(self, batch: int) -> float:
        ema = self.draft_pass.get(batch)
        if ema is not None and ema.value is not None:
            return ema.value
        known = [e.value for e in self.draft_pass.values() if e.value is not None]
        return min(known) if known else 0.2 * self._verify_cost(batch, 1)

    def ceilings(self, budgets: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """Free drafts (a lookup's) may widen the pass the policy planned (its longest scheduled
        draft, or a one-token pass) as long as its estimated cost grows by at most
        ``free_widening`` of the planned pass's, shared among the batch's rows (every row pays for
        the wider pass, a lookup gains its own row only), up to ``max_k``: at one row with a flat
        pass that is ``max_k`` (int4 on two Zen 5 cores, 42% dearer at 8 tokens than at 1: 5); at several
        rows, or compute-bound (a long context), free drafts soon stop widening it. (Measured on
        two cores, 16 prompts: at batch 4, allowing 0, 10, 25 and 50% of the pass without sharing
        gained 1.18x, 1.15x, 1.11x, 1.02x over no limit; at batch 1, 10% lost 3% where 25% was at
        par; benchmarks/results/composite_free_rows_zen5.md.)"""
        n = len(budgets)
        planned = max(lengths, default=0) if lengths is not None else 0
        limit = (1.0 + self.free_widening / max(n, 1)) * self._verify_cost(n, planned + 1)
        width = planned
        while width < self.max_k and self._verify_cost(n, width + 2) <= limit:
            width += 1
        return [max(0, min(width, b)) for b in budgets]

    def tree_shapes(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...] | None] | None:
        return None  # chains (a tree drafter keeps its own shape, its depth capped by the length)

    def _observe_verify(self, requests: Sequence[Request], width: int, seconds: float) -> None:
        """A real step's target pass: its width's time, and the machine's speed against the
        calibration (what the pass took less what its context adds past the calibration's: a
        long context must not read as a slow machine, which priced one-token steps high)."""
        self._note_context(requests)
        batch = len(requests)
        self.verify_time[(batch, width)].update(seconds)
        calibrated = self._calibrated_estimate(batch, width)
        if calibrated:
            own = max(seconds - self._beyond_calibration(batch, width), 0.1 * seconds)
            self.speed.update(own / calibrated)

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        self._note_context(batch)
        n = len(batch)
        draft = self._draft_cost(n)
        accept = [self.acceptance(r.request_id) for r in batch]
        best_k, best_rate = 0, sum(1.0 for _ in batch) / self._verify_cost(n, 1)
        for k in range(1, self.max_k + 1):
            tokens = 0.0
            for a, budget in zip(accept, budgets, strict=True):
                expected, run = 1.0, 1.0
                for i in range(min(k, max(budget, 0))):
                    run *= a[i]
                    expected += run
                tokens += expected
            rate = tokens / (k * draft + self._verify_cost(n, k + 1))
            if rate > best_rate * 1.01:  # a longer draft must earn its keep
                best_k, best_rate = k, rate
        self._planned_rate[n] = best_rate
        if best_k == 0:
            self._idle_steps += 1
            if self._probing():
                best_k = 1  # a cheap probe: keeps the acceptance and cost estimates current
        else:
            self._idle_steps = 0
        return [max(0, min(best_k, b)) for b in budgets]

    def draft_stop(self, batch: Sequence[Request], lengths: Sequence[int], budgets: Sequence[int]) -> CostStop | None:
        """Rows the plan drafts for (``lengths[b] > 0``) draft up to ``max_k`` and stop where the
        next token no longer pays (:class:`~verispec.engine.confidence.CostStop`) at the rate
        speculative steps of this batch size reach (the plan's rate until there are some); None
        when the stop is off, no row drafts, or the step is a probe of a policy that found
        speculation not worth it (:meth:`_probing`)."""
        if not self.confidence_stop or not any(lengths) or self._idle_steps:  # (a probe drafts its one token)
            return None
        n = len(batch)
        ceilings = [min(self.max_k, b) if k > 0 else 0 for k, b in zip(lengths, budgets, strict=True)]
        tokens, seconds = self.step_tokens[n].value, self.step_seconds[n].value
        rate = tokens / seconds if tokens and seconds else self._planned_rate.get(n, 0.0)
        verify = [0.0] + [self._verify_cost(n, w) for w in range(1, max(ceilings) + 3)]
        greedy = [r.params.greedy for r in batch]
        return CostStop(self.confidence, ceilings, greedy, self._draft_cost(n), verify, rate)

    def _probing(self) -> bool:
        """Whether this idle step (speculation off, ``_idle_steps`` of them in a row) drafts a
        one-token probe: two consecutive steps every ``probe_every``. The first feeds the drafter
        the tokens committed while it was off, so its draft time is no sample of the draft's
        cost; the second drafts in steady state and is one. With single probes an estimate that
        one slow step had inflated was never measured again, and kept speculation off for good."""
        if not self.probe_every:
            return False
        phase = self._idle_steps % self.probe_every
        return phase == 0 or (phase == 1 and self._idle_steps > self.probe_every)

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,
        verify_seconds: float,
        trees: Sequence[TreeStep | None] | None = None,
        draft_passes: int | None = None,
        free_rows: Sequence[bool] | None = None,
    ) -> None:
        k = max(drafted, default=0)
        self._observe_verify(batch, k + 1, verify_seconds)
        passes = k if draft_passes is None else draft_passes
        if passes > 0 and draft_seconds is not None:
            self.draft_pass[len(batch)].update(draft_seconds / passes)
            self.step_tokens[len(batch)].update(float(sum(a + 1 for a in accepted)))
            self.step_seconds[len(batch)].update(draft_seconds + verify_seconds)
        free = free_rows if free_rows is not None else [False] * len(batch)
        for req, d, a, is_free in zip(batch, drafted, accepted, free, strict=True):
            if is_free:  # a lookup's draft: not what K schedules
                continue
            reached, passed = self.per_request.setdefault(req.request_id, ([0.0] * self.max_k, [0.0] * self.max_k))
            for i in range(min(d, self.max_k)):
                if i > a:
                    break
                ok = 1.0 if i < a else 0.0
                self.reached[i] += 1
                self.passed[i] += ok
                reached[i] += 1
                passed[i] += ok
        live = {r.request_id for r in batch}
        for rid in [r for r in self.per_request if r not in live]:
            del self.per_request[rid]


class TreePolicy(MeasuredPolicy):
    """Chooses a static tree per request and step: Sequoia's hardware-aware choice (Chen et al.
    2024, §3.2) with measured inputs.

    Acceptance: the positional acceptance ``p_i`` (the share of verified rank-``i`` children that
    were accepted, :mod:`verispec.analysis`), counted from the trees the rule walked, engine-wide and
    per request (shrunk towards the engine-wide figure, which is shrunk towards a prior). Costs:
    the target's pass over ``n + 1`` rows and the draft's pass per level, as
    :class:`MeasuredPolicy` measures them. For every node budget ``n`` the best tree is the
    dynamic programme's (:func:`~verispec.analysis.optimal_trees`), and the chosen ``n`` maximises
    ``E(tree) / (depth x draft pass + verify(n + 1))``: a wider tree only while the verification
    pass stays flat enough to pay for its nodes; none when no tree beats plain decoding.
    """

    def __init__(
        self,
        max_nodes: int,
        max_depth: int = 8,
        prior: Sequence[float] = (0.6, 0.15, 0.06, 0.03),
        prior_weight: float = 8.0,
        costs: CostTable | None = None,
        probe_every: int = 16,
    ) -> None:
        super().__init__(max_depth, costs=costs, probe_every=probe_every)
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.prior, self.prior_weight = tuple(prior), prior_weight
        self.rank_reached: list[float] = [0.0] * max_nodes
        self.rank_accepted: list[float] = [0.0] * max_nodes
        self.tree_counts: dict[str, tuple[list[float], list[float]]] = {}
        self._chosen: dict[str, tuple[int, ...]] = {}
        self._plans: dict[tuple[float, ...], list[TreePlan]] = {}

    def positional(self, request_id: str | None = None) -> list[float]:
        """``p_1, p_2, ...``: engine-wide, or for one request (shrunk towards engine-wide)."""
        w = self.prior_weight
        prior = [self.prior[i] if i < len(self.prior) else 0.0 for i in range(self.max_nodes)]
        out = [(a + p * w) / (r + w) for a, r, p in zip(self.rank_accepted, self.rank_reached, prior, strict=True)]
        if request_id is not None and request_id in self.tree_counts:
            reached, accepted = self.tree_counts[request_id]
            out = [(a + p * w) / (r + w) for a, r, p in zip(accepted, reached, out, strict=True)]
        total = sum(out)
        return [p / total * 0.999 for p in out] if total > 0.999 else out  # (at most one child is accepted)

    def _trees(self, acceptance: list[float]) -> list[TreePlan]:
        key = tuple(math.floor(p * 100) / 100 for p in acceptance)  # (plans change little within a percent)
        plans = self._plans.get(key)
        if plans is None:
            if len(self._plans) > 256:
                self._plans.clear()
            plans = self._plans[key] = optimal_trees(key, self.max_nodes, self.max_depth)
        return plans

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        self._note_context(batch)
        n = len(batch)
        draft = self._draft_cost(n)
        plain = 1.0 / self._verify_cost(n, 1)
        depths: list[int] = []
        for req, budget in zip(batch, budgets, strict=True):
            best: TreePlan | None = None
            best_rate = plain
            for plan in self._trees(self.positional(req.request_id))[1 : max(0, min(budget, self.max_nodes)) + 1]:
                if plan.depth > budget:
                    break
                rate = plan.expected_tokens / (plan.depth * draft + self._verify_cost(n, len(plan.parents) + 1))
                if rate > best_rate * 1.01:  # a bigger tree must earn its keep
                    best, best_rate = plan, rate
            if best is not None:
                self._chosen[req.request_id] = best.parents
            depths.append(best.depth if best is not None else 0)
        if not any(depths):
            self._idle_steps += 1
            if self._probing():  # a one-node probe
                for i, (req, budget) in enumerate(zip(batch, budgets, strict=True)):
                    if budget > 0:
                        self._chosen[req.request_id], depths[i] = (-1,), 1
        else:
            self._idle_steps = 0
        return depths

    def tree_shapes(self, batch: Sequence[Request], lengths: Sequence[int]) -> list[tuple[int, ...] | None] | None:
        return [self._chosen.get(r.request_id) if k > 0 else None for r, k in zip(batch, lengths, strict=True)]

    def draft_stop(self, batch: Sequence[Request], lengths: Sequence[int], budgets: Sequence[int]) -> CostStop | None:
        return None  # trees: the planned tree is the draft

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,
        verify_seconds: float,
        trees: Sequence[TreeStep | None] | None = None,
        draft_passes: int | None = None,
        free_rows: Sequence[bool] | None = None,
    ) -> None:
        steps = list(trees) if trees is not None else [None] * len(batch)
        self._observe_verify(batch, max(drafted, default=0) + 1, verify_seconds)
        levels = max((max(map(len, tree_paths(t[0])), default=0) for t in steps if t is not None), default=0)
        if levels and draft_seconds is not None:
            self.draft_pass[len(batch)].update(draft_seconds / levels)
        for req, step in zip(batch, steps, strict=True):
            if step is None:
                continue
            reached, acc = self.tree_counts.setdefault(req.request_id, ([0.0] * self.max_nodes, [0.0] * self.max_nodes))
            stats = SpecStats()
            stats.observe_tree(*step)
            for i, (r, a) in enumerate(zip(stats.rank_reached[: self.max_nodes], stats.rank_accepted, strict=False)):
                reached[i] += r
                acc[i] += a
                self.rank_reached[i] += r
                self.rank_accepted[i] += a
        live = {r.request_id for r in batch}
        for rid in [r for r in self.tree_counts if r not in live]:
            del self.tree_counts[rid]
        for rid in [r for r in self._chosen if r not in live]:
            del self._chosen[rid]


def make_policy(config: EngineConfig, speculative: bool, costs: CostTable | None = None) -> DraftPolicy:
    if not speculative:
        return FixedPolicy(0)
    if config.num_draft_tokens is not None:
        return FixedPolicy(config.num_draft_tokens)
    return MeasuredPolicy(config.max_draft_tokens, costs=costs, confidence_stop=config.confidence_stop)
