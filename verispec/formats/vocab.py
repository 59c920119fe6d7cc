"""Pairing a draft model with a target model: their vocabularies, and the support of their laws.

Speculative decoding compares the draft's law and the target's law token id by token id, so the
two models must mean the same thing by every id. :func:`check_compatible` checks what llama.cpp's
``common_speculative_are_compatible`` checks, strictly: the same tokenizer vocabulary size, the
same token text for every id, the same BOS / EOS / PAD ids, the same stop ids and the same
special (control) tokens. It raises :class:`IncompatibleModelsError` naming both sizes and the
first id whose text differs.

**Vocabulary size vs logits width.** Models pad their embedding matrix (and LM head) past the
tokenizer's vocabulary for kernel-friendly shapes: Qwen2.5's tokenizer defines 151,665 ids (151,643
BPE tokens and 22 special tokens) while its embedding has 151,936 rows, and two models of a family
may be padded differently. Their GGUF files spell the padding rows as ``[PAD151665]`` ...
``[PAD151935]`` with token type *unused*; :func:`gguf_vocab_size` leaves those trailing
placeholders out. A loaded model therefore records two numbers: ``vocab_size`` (ids its tokenizer
really defines) and ``logits_width`` (``config.vocab_size``, the columns its forward pass returns).
Padded columns carry untrained rows and never correspond to text.

**How the engine uses it.** Take ``shared = check_compatible(target, draft)`` once, then, for every
forward pass of the target AND of the draft, and in the plain-decoding path (K = 0) too, call
``restrict_logits(logits, shared.vocab_size)`` before :func:`verispec.sampling.to_probs`. Both laws
then live on the same support ``[0, vocab_size)``: ``draft_probs`` and ``target_probs`` have the
same last dimension whatever each model's padding, every sampled id is a real token, and "spec
on" and "spec off" sample from the very same target law (the target's softmax over its real
tokens), which is what losslessness is measured against. :func:`mask_logits` is the same
restriction for code that needs the full width (padded columns set to ``-inf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from verispec.errors import IncompatibleModelsError, InputError
from verispec.formats.gguf_file import GGUFFile
from verispec.formats.tokenizer import Tokenizer

_UNUSED = 5  # GGUF token type of padding placeholders


class VocabModel(Protocol):
    """What :func:`check_compatible` reads of a model: a
    :class:`~verispec.formats.loader.LoadedModel`."""

    @property
    def name(self) -> str: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def logits_width(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SharedVocab:
    """The support both laws live on: logits columns ``[0, vocab_size)`` of either model."""

    vocab_size: int  # ids both tokenizers define
    target_width: int  # logits columns the target's forward pass returns (>= vocab_size)
    draft_width: int  # logits columns the draft's forward pass returns (>= vocab_size)


def gguf_vocab_size(file: GGUFFile) -> int:
    """Ids a GGUF file's tokenizer really defines: its token list without the trailing run of
    *unused* padding placeholders (Qwen2.5: 151,936 entries, 151,665 real tokens)."""
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type")
    n = len(tokens) if isinstance(tokens, list) else 0
    if isinstance(types, np.ndarray) and len(types) == n:
        used = np.flatnonzero(types != _UNUSED)
        n = int(used[-1]) + 1 if used.size else 0
    return n


def restrict_logits(logits: Tensor, vocab_size: int) -> Tensor:
    """``logits[..., :vocab_size]``, a view: the columns of real tokens. ``[..., W] -> [..., V]``."""
    width = logits.shape[-1]
    if not 0 < vocab_size <= width:
        raise InputError(f"cannot restrict {width} logits columns to a {vocab_size}-token vocabulary")
    return logits if vocab_size == width else logits[..., :vocab_size]


def mask_logits(logits: Tensor, vocab_size: int) -> Tensor:
    """A copy of ``logits`` with the columns past ``vocab_size`` set to ``-inf`` (probability 0
    after softmax), keeping the width. ``[..., W] -> [..., W]``."""
    restrict_logits(logits, vocab_size)  # validates
    out = logits.clone()
    out[..., vocab_size:] = -torch.inf
    return out


def _texts(tokenizer: Tokenizer, n: int) -> list[str | None]:
    texts: list[str | None] = [None] * n
    for text, i in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if i < n:
            texts[i] = text
    return texts


def _specials(tokenizer: Tokenizer, n: int) -> dict[int, str]:
    return {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special and i < n}


def check_compatible(target: VocabModel, draft: VocabModel) -> SharedVocab:
    """Check that ``draft`` can draft for ``target`` (see the module docstring) and return the
    shared support; raise :class:`IncompatibleModelsError` otherwise."""
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    who = f"target {target.name!r} and draft {draft.name!r}"
    for model in (target, draft):
        if model.vocab_size > model.logits_width:
            raise IncompatibleModelsError(
                f"{model.name!r}: its tokenizer defines {model.vocab_size} ids but the model returns only "
                f"{model.logits_width} logits; the tokenizer does not belong to this model"
            )
    n_t, n_d = target.vocab_size, draft.vocab_size
    same = t_tok.backend is d_tok.backend  # (one tokenizer.json for both: the same texts)
    t_texts, d_texts = ([], []) if same and n_t == n_d else (_texts(t_tok, n_t), _texts(d_tok, n_d))
    first = None if same else next((i for i in range(min(n_t, n_d)) if t_texts[i] != d_texts[i]), None)
    if first is None and n_t != n_d:
        first = min(n_t, n_d)
    if first is not None:  # also when the sizes differ
        t_text = t_texts[first] if first < n_t else None
        d_text = d_texts[first] if first < n_d else None
        raise IncompatibleModelsError(
            f"{who} have different vocabularies: target {n_t} tokens, draft {n_d} tokens; first differing "
            f"token id {first}: target {t_text!r}, draft {d_text!r}. Use a draft model with the target's "
            f"tokenizer (the same model family)"
        )
    for what, t_value, d_value in (
        ("BOS id", t_tok.bos_token_id, d_tok.bos_token_id),
        ("EOS id", t_tok.eos_token_id, d_tok.eos_token_id),
        ("PAD id", t_tok.pad_token_id, d_tok.pad_token_id),
        ("stop ids", sorted(t_tok.eos_token_ids), sorted(d_tok.eos_token_ids)),
    ):
        if t_value != d_value:
            raise IncompatibleModelsError(
                f"{who} have different special tokens: {what} {t_value} (target) vs {d_value} (draft); "
                f"use a draft model with the target's tokenizer"
            )
    t_special, d_special = _specials(t_tok, n_t), _specials(d_tok, n_d)
    if t_special != d_special:
        diff = sorted(set(t_special.items()) ^ set(d_special.items()))
        i = diff[0][0]
        raise IncompatibleModelsError(
            f"{who} mark different tokens as special (control) tokens: first at id {i}: target "
            f"{t_special.get(i)!r}, draft {d_special.get(i)!r}; use a draft model with the target's tokenizer"
        )
    return SharedVocab(n_t, target.logits_width, draft.logits_width)
