"""How much to speculate: the draft length K per request and per step, from measurements.

The single-request model (Leviathan et al. 2023; :mod:`verispec.analysis`) says a step that drafts
``k`` tokens emits ``E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i`` tokens on average (``a_i``: the
probability that draft position ``i`` is accepted given that the positions before it were) and
costs ``k`` draft passes plus one target pass over ``k + 1`` tokens. :class:`MeasuredPolicy`
estimates the ``a_i`` from what the rule actually accepted (per request, shrunk towards the
engine-wide estimate), and the costs from the measured step times (exponential moving averages
per batch size and pass width), and picks the ``k`` in ``[0, max]`` that maximises tokens per
second. ``k = 0`` (no speculation) wins when drafting is too expensive for its acceptance, or when
the target pass stops being flat in ``k`` (compute-bound: large batches, long contexts), which is
"speculate only while decode is memory-bound", measured instead of assumed.

Costs start from the calibration of the target measured on this machine at first use
(:mod:`verispec.engine.calibrate`), or from a prior (a flat verification curve and a draft pass at
20% of a target pass); the draft's cost is learnt from the first steps; every estimate then follows
the times of real steps. While speculation is off, a short probe draft every ``probe_every`` steps
keeps the acceptance estimates alive, so that speculation comes back when the text becomes
predictable again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from verispec.config import EngineConfig
from verispec.engine.calibrate import CostTable
from verispec.engine.request import Request


class DraftPolicy(Protocol):
    """Chooses each request's draft length per step from what it has observed. ``budgets[b]``: the
    draft tokens that can still be useful to request b (its remaining allowance)."""

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]: ...

    def ceilings(self, budgets: Sequence[int]) -> list[int]:
        """The most tokens a drafter whose tokens cost nothing (prompt lookup) may propose per
        request: a fixed K holds for every drafter; a chosen K does not bind a free draft."""
        ...

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,  # None: the draft time held a one-off catch-up, not a cost sample
        verify_seconds: float,
    ) -> None: ...


class FixedPolicy:
    """The same K for every request and step (capped by each request's remaining budget)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
        return [max(0, min(self.k, b)) for b in budgets]

    def ceilings(self, budgets: Sequence[int]) -> list[int]:
        return self.draft_lengths((), budgets)  # a fixed K binds every drafter

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,
        verify_seconds: float,
    ) -> None:
        return None


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
    ) -> None:
        self.max_k = max_k
        self.prior_accept = prior_accept
        self.prior_weight = prior_weight
        # Engine-wide conditional acceptance per position: accepted / reached.
        self.reached = [0.0] * max_k
        self.passed = [0.0] * max_k
        self.per_request: dict[str, tuple[list[float], list[float]]] = {}
        # Costs: target pass time per (batch, width) and draft pass time per batch.
        self.verify_time: dict[tuple[int, int], _Ema] = defaultdict(_Ema)
        self.draft_pass: dict[int, _Ema] = defaultdict(_Ema)
        if costs is not None:
            for key, seconds in costs.seconds.items():
                self.verify_time[key].update(seconds)
        self.probe_every = probe_every
        self._idle_steps = 0  # consecutive steps without speculation

    # ---------------------------------------------------------------------------- estimates
    def acceptance(self, request_id: str | None = None) -> list[float]:
        """Conditional acceptance per draft position (engine-wide, or for one request)."""
        out = []
        for i in range(self.max_k):
            prior = (self.passed[i] + self.prior_accept * self.prior_weight) / (self.reached[i] + self.prior_weight)
            if request_id is not None and request_id in self.per_request:
                reached, passed = self.per_request[request_id]
                prior = (passed[i] + prior * self.prior_weight) / (reached[i] + self.prior_weight)
            out.append(min(max(prior, 0.0), 0.999))
        return out

    def _verify_cost(self, batch: int, width: int) -> float:
        """Seconds of a target pass over ``width`` tokens per row, from the nearest measurement."""
        return max(self._verify_estimate(batch, width), 1e-9)

    def _verify_estimate(self, batch: int, width: int) -> float:
        exact = self.verify_time.get((batch, width))
        if exact is not None and exact.value is not None:
            return exact.value
        known = [(w, e.value) for (b, w), e in self.verify_time.items() if b == batch and e.value is not None]
        if not known:
            known = [(w, e.value / b * batch) for (b, w), e in self.verify_time.items() if e.value is not None]
        if not known:
            return 1.0
        below = [(w, v) for w, v in known if w <= width]
        above = [(w, v) for w, v in known if w >= width]
        if below and above:
            (w0, v0), (w1, v1) = max(below), min(above)
            return v0 if w1 == w0 else v0 + (v1 - v0) * (width - w0) / (w1 - w0)
        _, v = min(known, key=lambda wv: abs(wv[0] - width))
        return v  # flat beyond what was measured: optimistic, so that it gets measured

    def _draft_cost(self, batch: int) -> float:
        ema = self.draft_pass.get(batch)
        if ema is not None and ema.value is not None:
            return ema.value
        known = [e.value for e in self.draft_pass.values() if e.value is not None]
        return min(known) if known else 0.2 * self._verify_cost(batch, 1)

    def ceilings(self, budgets: Sequence[int]) -> list[int]:
        return [max(0, min(self.max_k, b)) for b in budgets]

    def draft_lengths(self, batch: Sequence[Request], budgets: Sequence[int]) -> list[int]:
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
        if best_k == 0:
            self._idle_steps += 1
            if self.probe_every and self._idle_steps % self.probe_every == 0:
                best_k = 1  # a cheap probe: keeps the acceptance and cost estimates current
        else:
            self._idle_steps = 0
        return [max(0, min(best_k, b)) for b in budgets]

    def observe(
        self,
        batch: Sequence[Request],
        drafted: Sequence[int],
        accepted: Sequence[int],
        draft_seconds: float | None,
        verify_seconds: float,
    ) -> None:
        k = max(drafted, default=0)
        self.verify_time[(len(batch), k + 1)].update(verify_seconds)
        if k > 0 and draft_seconds is not None:
            self.draft_pass[len(batch)].update(draft_seconds / k)
        for req, d, a in zip(batch, drafted, accepted, strict=True):
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


def make_policy(config: EngineConfig, speculative: bool, costs: CostTable | None = None) -> DraftPolicy:
    if not speculative:
        return FixedPolicy(0)
    if config.num_draft_tokens is not None:
        return FixedPolicy(config.num_draft_tokens)
    return MeasuredPolicy(config.max_draft_tokens, costs=costs)
