"""A composite drafter: a lookup first, the draft model where the lookup finds nothing
(SuffixDecoding's hybrid, Oliaro et al. 2024).

The lookup (:meth:`verispec.drafters.suffix.SuffixDrafter.lookup` as the registry builds it; any
object with the same ``lookup`` and life-cycle methods, e.g. :class:`~verispec.drafters.ngram.NgramDrafter`'s
prompt lookup) proposes the continuation that most earlier occurrences of the current suffix agree
on, in the request's own tokens and in earlier requests' outputs, and nothing when they disagree,
so the model drafts where the text is new. It beat prompt lookup + model in every run measured and
was at par with or ahead of the model alone on HumanEval, summarisation and chat prompts, greedy
and sampled (``benchmarks/results/composite_suffix_zen5.md``): the commands' default drafter.

Rows drafted by the lookup report a one-hot law (a point mass: exactly what it "sampled"), rows
drafted by the model report the model's law, so one :class:`~verispec.verify.Draft` carries both
and the rejection rule stays exact for each row. A lookup's draft is a function of the committed
tokens (the request's and other requests' committed outputs, independent of this request's
randomness), so the output's law is unchanged; a seeded sampled request's lookup reads its own
tokens only, so that its text does not depend on other requests either (README, Seeds). Both
drafters observe every committed token, so either can take over at any step.

A lookup draft is not held to the draft length scheduled for the model (see :meth:`propose`): it
costs nothing to make, so with K chosen per step it runs to the row's budget
(``BatchView.budgets``: the policy's ceiling, or fewer near the end of the request), and it
drafts on the steps the policy schedules no model draft for as well (``free_when_off``: the
engine then asks for a proposal all the same); a fixed K holds for both. On text that repeats its
input this is where the composite gains over the model alone. The lengths depend on the committed
context only, so the output's law is unchanged. Which rows the lookup drafted
(``last_free_rows``) the policy keeps out of the acceptance it expects of the model's drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch

from verispec.drafters.base import BatchView, seeded_sample
from verispec.drafters.model import ModelDrafter
from verispec.verify.base import PAD_ID, Draft


class Lookup(Protocol):
    """What the composite asks of its model-free half: the request life cycle and one chain."""

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...
    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None: ...
    def end(self, request_id: str) -> None: ...
    def lookup(self, request_id: str, k: int, *, seeded: bool = False) -> list[int]: ...


class CompositeDrafter:
    name: ClassVar[str] = "composite"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = False
    last_catchup_tokens: int = 0  # the model drafter's, for the rows it drafted (0 when lookups drafted all)
    last_draft_passes: int = 0  # the model's sequential passes in the last proposal (0 when lookups drafted all)
    last_free_rows: tuple[bool, ...] = ()  # per row of the last proposal: drafted by the lookup (no model pass)
    free_when_off: bool = True  # looks up on the steps the policy schedules no model draft for (see propose)
    stops_early: ClassVar[bool] = True  # its model's drafts end by their confidence (BatchView.stop)

    def __init__(self, lookup: Lookup, model: ModelDrafter) -> None:
        self.lookup = lookup
        self.model = model

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.lookup.begin(request_id, prompt_ids)
        self.model.begin(request_id, prompt_ids)

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self.lookup.observe(request_id, accepted_ids)
        self.model.observe(request_id, accepted_ids)

    def end(self, request_id: str) -> None:
        self.lookup.end(request_id)
        self.model.end(request_id)

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        # The scheduled length is sized for the model's drafts, which cost a pass per token and are
        # accepted less often deep into the draft; a lookup draft costs nothing and continues
        # a span seen before, so it may run to the row's budget (verification of a longer chain
        # costs about the same while decoding is memory-bound). A row scheduled for 0 gets a lookup
        # draft all the same where it has a budget (the policy found the model's drafts not worth
        # their passes; a lookup costs none): with a fixed K, or at the end of its tokens, nothing.
        budgets = batch.budgets if batch.budgets is not None else max_tokens
        free_ok = self.free_when_off and batch.budgets is not None
        lookups = [
            self.lookup.lookup(rid, max(k, budget), seeded=seeded_sample(p, g))
            if k > 0 or (free_ok and budget > 0)
            else []
            for rid, k, budget, p, g in zip(
                batch.request_ids, max_tokens, budgets, batch.params, batch.generators, strict=True
            )
        ]
        model_k = [0 if found else k for found, k in zip(lookups, max_tokens, strict=True)]
        model_draft = self.model.propose(batch, model_k)
        self.last_catchup_tokens = self.model.last_catchup_tokens
        self.last_draft_passes = int(model_draft.num_tokens.max()) if len(batch) else 0  # (a stop may end drafts early)
        self.last_free_rows = tuple(bool(found) for found in lookups)
        n = len(batch)
        # as wide as the longest draft made (the model's may end before its length: BatchView.stop)
        k_max = max([model_draft.max_tokens, *(len(found) for found in lookups)], default=0)
        ids = torch.full((n, k_max), PAD_ID, dtype=torch.long)
        ids[:, : model_draft.max_tokens] = model_draft.token_ids
        counts = model_draft.num_tokens.clone()
        for row, found in enumerate(lookups):
            if found:
                ids[row, : len(found)] = torch.tensor(found, dtype=torch.long)
                counts[row] = len(found)
        if model_draft.probs is None:  # the model's drafts are point masses (every row greedy), as lookups are
            return Draft(ids, counts)
        laws = torch.zeros((n, k_max, self.model.vocab_size), dtype=torch.float32, device=model_draft.probs.device)
        laws[:, : model_draft.max_tokens] = model_draft.probs
        for row, found in enumerate(lookups):
            if found:  # a lookup's draft: point masses at its tokens
                laws[row, : len(found)] = 0.0
                laws[row, torch.arange(len(found)), torch.tensor(found)] = 1.0
        return Draft(ids, counts, laws)
