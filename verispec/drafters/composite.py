"""A composite drafter: prompt lookup first, the draft model where the lookup finds nothing.

Rows drafted by the n-gram index report a one-hot law (a point mass: exactly what the index
"sampled"), rows drafted by the model report the model's law, so one :class:`~verispec.verify.Draft`
carries both and the rejection rule stays exact for each row. Both drafters observe every committed
token, so either can take over at any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from verispec.drafters.base import BatchView
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.verify.base import PAD_ID, Draft


class CompositeDrafter:
    name: ClassVar[str] = "composite"
    needs_hidden_states: ClassVar[bool] = False
    point_mass: ClassVar[bool] = False
    last_catchup_tokens: int = 0  # the model drafter's, for the rows it drafted (0 when n-grams drafted all)

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter) -> None:
        self.ngram = ngram
        self.model = model

    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.ngram.begin(request_id, prompt_ids)
        self.model.begin(request_id, prompt_ids)

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self.ngram.observe(request_id, accepted_ids)
        self.model.observe(request_id, accepted_ids)

    def end(self, request_id: str) -> None:
        self.ngram.end(request_id)
        self.model.end(request_id)

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        lookups = [self.ngram.lookup(rid, k) for rid, k in zip(batch.request_ids, max_tokens, strict=True)]
        model_k = [0 if found else k for found, k in zip(lookups, max_tokens, strict=True)]
        model_draft = self.model.propose(batch, model_k)
        self.last_catchup_tokens = self.model.last_catchup_tokens
        n, k_max = len(batch), max(max_tokens, default=0)
        ids = torch.full((n, k_max), PAD_ID, dtype=torch.long)
        laws = torch.zeros((n, k_max, self.model.vocab_size), dtype=torch.float32, device=model_draft.token_ids.device)
        if model_draft.probs is not None:
            laws = laws.to(model_draft.probs.device)
            laws[:, : model_draft.max_tokens] = model_draft.probs
        ids[:, : model_draft.max_tokens] = model_draft.token_ids
        counts = model_draft.num_tokens.clone()
        for row, found in enumerate(lookups):
            if found:
                ids[row, : len(found)] = torch.tensor(found, dtype=torch.long)
                laws[row, : len(found)] = 0.0
                laws[row, torch.arange(len(found)), torch.tensor(found)] = 1.0
                counts[row] = len(found)
        return Draft(ids, counts, laws)
