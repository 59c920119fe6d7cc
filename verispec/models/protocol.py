"""What the engine and the drafters need of a language model and of its KV cache.

:class:`~verispec.models.transformer.Transformer` implements it natively; the generic Hugging
Face adapter (:mod:`verispec.models.hf_adapter`, built by :mod:`verispec.formats.hf`) implements
it for one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from verispec.models.config import ModelConfig


class Cache(Protocol):
    """Per-sequence KV state with O(1) rollback (see :class:`verispec.models.kv_cache.KVCache`)."""

    lengths: Tensor  # [S] int64

    def add_sequence(self) -> int: ...
    def remove_sequence(self, slot: int) -> None: ...
    def truncate(self, new_lengths: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None: ...
    def keep_step_prefix(self, num_keep: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None: ...


class LanguageModel(Protocol):
    config: ModelConfig

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, max_batch: int, max_len: int) -> Any: ...

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: Any,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
    ) -> Tensor: ...
