"""What the engine and the drafters need of a language model and of its KV cache.

:class:`~verispec.models.transformer.Transformer` implements it natively; the generic Hugging
Face adapter (:mod:`verispec.models.hf_adapter`, built by :mod:`verispec.formats.hf`) implements
it for one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from verispec.models.config import ModelConfig

if TYPE_CHECKING:
    from verispec.models.transformer import ForwardOutput


class Cache(Protocol):
    """Per-sequence KV state with O(1) rollback (see :class:`verispec.models.kv_cache.KVCache`)."""

    lengths: Tensor  # [S] int64

    def add_sequence(self) -> int: ...
    def remove_sequence(self, slot: int) -> None: ...
    def truncate(self, new_lengths: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None: ...
    def keep_step_prefix(self, num_keep: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None: ...


class LanguageModel(Protocol):
    """Every capability of a model that the engine, the drafters and calibration use."""

    config: ModelConfig
    #: The decoder layers run on verispec's CPU kernels (batch-invariant; calibration keys on them).
    cpu_kernels: bool
    #: The LM head as a module (a restricted draft head slices it on the kernels), or None.
    lm_head: torch.nn.Module | None

    @property
    def precision(self) -> str:
        """ "fp32", "bf16", "int8" or "int4" (quantised weights cost differently from dense ones)."""
        ...

    @property
    def lm_weight(self) -> Tensor | None:
        """The LM head's rows ``[V, C]`` (a restricted draft head scores a subset of them), or None
        when the model does not expose them."""
        ...

    @property
    def embed_weight(self) -> Tensor | None:
        """The token embedding ``[V, C]`` (dense in every precision: trained heads fingerprint the
        model by it), or None when the model does not expose it."""
        ...

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
        prefill: bool = False,
    ) -> Tensor: ...

    def forward_with_hidden(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: Any,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
        prefill: bool = False,
    ) -> ForwardOutput:
        """:meth:`forward` that also returns the last hidden states (after the final norm)."""
        ...
