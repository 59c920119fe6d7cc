"""The exact law of the first tokens a language model samples, by enumeration.

For a model with a small vocabulary (tiny transformers built in code), the law of the first ``n``
sampled tokens after a prompt, under any :class:`~verispec.config.SamplingParams`, is computed by
running every one of the ``V ** t`` prefixes of each length ``t < n`` through the model and
multiplying the :func:`~verispec.sampling.to_probs` conditionals, the same function and the same
vocabulary cut the engine uses. :mod:`verispec.certify.core` compares the engine's samples with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from verispec.config import SamplingParams
from verispec.errors import ConfigError
from verispec.models.protocol import LanguageModel
from verispec.sampling import TokenHistory, cut_vocab, to_probs


@torch.inference_mode()
def exact_prefix_law_lm(
    model: LanguageModel,
    params: SamplingParams,
    prompt: Sequence[int],
    prefix_len: int,
    vocab_limit: int | None = None,
    max_cells: int = 200_000,
) -> np.ndarray:
    """``[V ** n]`` float64: the law of the first ``n = prefix_len`` tokens, indexed by the base-V
    number of the sequence (first token most significant); ``V`` = ``vocab_limit`` (default: the
    model's vocabulary)."""
    vocab = vocab_limit or model.config.vocab_size
    if vocab**prefix_len > max_cells:
        raise ConfigError(f"{vocab}^{prefix_len} sequences are too many to enumerate; use a smaller model or prefix")
    law = np.ones(1, dtype=np.float64)  # law of the prefixes of length t, base-V indexed
    for t in range(prefix_len):
        prefixes = list(itertools.product(range(vocab), repeat=t))  # in base-V order
        rows = [list(prompt) + list(p) for p in prefixes]
        tokens = torch.tensor(rows, dtype=torch.long, device=model.device)  # [M, P + t]
        cache = model.new_cache(len(rows), tokens.shape[1])
        at = torch.full((len(rows), 1), tokens.shape[1] - 1, device=model.device)
        logits = model.forward(tokens, None, cache, logits_at=at)[:, 0]  # [M, V_model]
        logits = cut_vocab(logits, vocab)[:, :vocab]
        history = None
        if params.uses_history:
            history = TokenHistory.from_ids([prompt] * len(rows), [list(p) for p in prefixes], vocab, model.device)
        probs = to_probs(logits, [params] * len(rows), history).to(torch.float64).cpu().numpy()  # [M, V]
        law = (law[:, None] * probs).reshape(-1)
    return law
