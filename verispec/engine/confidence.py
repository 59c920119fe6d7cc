"""Ending a draft early by its confidence, priced like the draft length.

A draft model's confidence in a token tracks how often the target accepts it (EAGLE-2, Li et al.
2024, §3; SpecDec++, Huang et al. 2024, stops on a predicted rejection; transformers' assisted
generation stops below a fixed confidence). A chain drafter that honours
:class:`~verispec.drafters.base.DraftStop` reports, after every token it draws, that token's
confidence ``f``: the draft's probability of it (for a greedy request, of its top token at
temperature 1). :class:`ConfidenceTable` learns from verified steps how often a token of confidence
``f`` was accepted when the tokens before it were, per bin of ``f`` and separately for greedy and
sampled requests. :class:`CostStop` then drafts one more token only while it pays: with ``R`` the
estimated probability that every token drafted so far is accepted (the product of their calibrated
acceptances), ``a`` the pooled acceptance (the next token's confidence is not known before its pass),
``c`` a draft pass and ``dv`` the verification pass's growth by one token, it continues while
``R * a / (c + dv) >= rate``, the tokens per second of recent speculative steps: the marginal test
for a ratio (Dinkelbach 1967), one more token is worth drafting when it yields more per second than
the steps do. A confident draft runs past the length a fixed K would have; a doubtful token ends it.
On 16 HumanEval prompts with the default pair (greedy, two Zen 4 cores) that was 1.10x the tokens
per second of drafting the K the policy chose and 1.05x those of the best fixed K; sampled at
temperature 0.7, 1.15x and 1.06x (``benchmarks/results/confidence_stop_zen4.md``).

Why the output law is unchanged: the decision to draft position ``i + 1`` is taken after token ``i``
was drawn, from draft-side values (the draft's laws, the drawn tokens) and from past steps, and
token ``i`` is kept whatever it is. When the rule reaches position ``i + 1``, every draft token
before it was accepted, so whether the position was drafted depends on the accepted prefix and on
randomness independent of the position's own draw and test: its token is the rule's exact output
either way (a drafted token tested, or the bonus token drawn from the target). Taking back a drawn
token because its confidence is low would change the law it was drawn from; the certification's
negative control does that and fails (``tests/stats/test_certify_engine.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

#: Upper edges of the confidence bins (the last bin runs to 1): fine near 1, where most of a good
#: draft's tokens fall.
BIN_EDGES = (0.2, 0.4, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995)
_MIDPOINTS = tuple((lo + hi) / 2 for lo, hi in zip((0.0, *BIN_EDGES), (*BIN_EDGES, 1.0), strict=True))


class ConfidenceTable:
    """How often a draft token was accepted, given that the tokens before it were, per bin of its
    confidence (:data:`BIN_EDGES`) and kind of request (greedy or sampled). A bin starts from its
    midpoint (a calibrated draft's acceptance) with the weight of ``prior_weight`` tokens."""

    def __init__(self, prior_weight: float = 4.0, prior_accept: float = 0.6) -> None:
        self.prior_weight = prior_weight
        self.prior_accept = prior_accept
        bins = len(_MIDPOINTS)
        self.reached = {False: [0.0] * bins, True: [0.0] * bins}  # by greedy
        self.passed = {False: [0.0] * bins, True: [0.0] * bins}

    @staticmethod
    def bin(confidence: float) -> int:
        return bisect.bisect_right(BIN_EDGES, confidence)

    def acceptance(self, greedy: bool, confidence: float) -> float:
        """Estimated probability that a token of this confidence is accepted."""
        b = self.bin(confidence)
        w = self.prior_weight
        return (self.passed[greedy][b] + _MIDPOINTS[b] * w) / (self.reached[greedy][b] + w)

    def pooled(self, greedy: bool) -> float:
        """Acceptance over every bin (for a token whose confidence is not known yet)."""
        w = self.prior_weight
        return (sum(self.passed[greedy]) + self.prior_accept * w) / (sum(self.reached[greedy]) + w)

    def record(self, greedy: bool, confidences: Sequence[float], accepted: int) -> None:
        """One verified draft: its tokens' confidences in order, and how many the rule accepted."""
        for i, f in enumerate(confidences):
            if i > accepted:  # not reached: an earlier token was rejected
                break
            b = self.bin(f)
            self.reached[greedy][b] += 1.0
            self.passed[greedy][b] += 1.0 if i < accepted else 0.0


class CostStop:
    """One step's stop (:class:`~verispec.drafters.base.DraftStop`; the rule in the module
    docstring). ``lengths[b]``: row b's ceiling (0: no draft); ``greedy[b]``: which table row b
    reads; ``draft_seconds``: a draft pass; ``verify_seconds[w]``: the target pass over ``w`` tokens
    per row, for ``w`` up to the largest ceiling + 2; ``rate``: tokens per second to beat. It keeps
    every token's confidence for :meth:`settle`."""

    def __init__(
        self,
        table: ConfidenceTable,
        lengths: Sequence[int],
        greedy: Sequence[bool],
        draft_seconds: float,
        verify_seconds: Sequence[float],
        rate: float,
    ) -> None:
        self.table = table
        self.lengths = list(lengths)
        self.greedy = list(greedy)
        self.draft_seconds = draft_seconds
        self.verify_seconds = list(verify_seconds)
        self.rate = rate
        self.confidences: list[list[float]] = [[] for _ in self.lengths]
        self._reach = [1.0] * len(self.lengths)
        self._pooled = {g: table.pooled(g) for g in (False, True)}
        #: rows whose draft the stop ended before its ceiling (not the ceiling itself)
        self.stopped = [False] * len(self.lengths)

    def keep_drafting(self, row: int, drafted: int, confidence: float) -> bool:
        self.confidences[row].append(confidence)
        self._reach[row] *= self.table.acceptance(self.greedy[row], confidence)
        if drafted >= self.lengths[row]:
            return False
        growth = max(self.verify_seconds[drafted + 2] - self.verify_seconds[drafted + 1], 0.0)
        gain = self._reach[row] * self._pooled[self.greedy[row]]
        if gain >= self.rate * (self.draft_seconds + growth):
            return True
        self.stopped[row] = True
        return False

    def settle(self, drafted: Sequence[int], accepted: Sequence[int], skip: Sequence[bool]) -> None:
        """Teach the table the verified outcome: of row b's ``drafted[b]`` verified draft tokens,
        ``accepted[b]`` were accepted; rows with ``skip[b]`` (failed, or drafted by something else:
        a composite's lookup) are left out, and so are tokens that were never verified (a draft
        the engine dropped)."""
        for b, (conf, d, a, s) in enumerate(zip(self.confidences, drafted, accepted, skip, strict=True)):
            if conf and d and not s:
                self.table.record(self.greedy[b], conf[:d], a)
