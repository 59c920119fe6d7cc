"""A generic adapter over Hugging Face transformers' ``AutoModelForCausalLM``.

Architectures the verispec runtime does not implement still run through the engine this way: one
sequence at a time (batch size 1, chains only, no trees), with the model's own ``DynamicCache``
cropped on rollback (as transformers' assisted generation does). It presents the interface of
:class:`~verispec.models.protocol.LanguageModel`. transformers is an optional dependency, imported
only when the adapter is used.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.errors import ConfigError, InputError, ModelLoadError, UnsupportedModelError
from verispec.models.config import ModelConfig
from verispec.models.transformer import ForwardOutput


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            "the Hugging Face adapter needs the transformers package: pip install 'transformers>=4.46' "
            "(or load a Llama/Qwen2/Mistral folder with load_hf_folder, which does not)"
        ) from exc
    return transformers


class HFCache:
    """The :class:`~verispec.models.kv_cache.KVCache` methods the engine calls, for one sequence,
    over a transformers ``DynamicCache``. Rollback crops the ``DynamicCache`` tail (it holds
    exactly ``length`` positions, so the attention never sees stale entries). Built without the
    model's config, every layer keeps its whole history, so sliding-window models can roll back
    too (at full attention's memory cost). Lengths are host integers: nothing here synchronises
    with the device except reading tensor arguments."""

    def __init__(self, max_len: int, device: torch.device, new_dynamic: Any) -> None:
        self.max_batch = 1
        self.max_len = max_len
        self.device = device
        self.dynamic: Any = None  # transformers DynamicCache of the sequence, None when no slot is used
        self._new_dynamic = new_dynamic
        self._in_use = False
        self._length = self._step_start = 0
        self.lengths = torch.zeros(1, dtype=torch.int64, device=device)  # [1] int64, as KVCache.lengths
        self.step_start = torch.zeros(1, dtype=torch.int64, device=device)  # [1] int64: before the last step

    @property
    def active_slots(self) -> list[int]:
        return [0] if self._in_use else []

    def add_sequence(self) -> int:
        """Claim the one slot (0), empty."""
        if self._in_use:
            raise InputError(
                "the Hugging Face adapter's cache holds one sequence and it is in use; remove_sequence(0) first"
            )
        self.reset(in_use=True)
        return 0

    def remove_sequence(self, slot: int) -> None:
        self.resolve_slots([slot], 1)
        self.reset()

    def reset(self, in_use: bool = False) -> None:
        """Free (or, from :meth:`add_sequence`, claim) the slot, empty."""
        self._in_use = in_use
        self._set_length(0)
        self._record(0, 0)

    def resolve_slots(self, slots: Sequence[int] | None, batch_size: int) -> tuple[list[int], Tensor]:
        """As :meth:`KVCache.resolve_slots`; only slot 0 and batches of one row exist."""
        host = list(range(batch_size)) if slots is None else [int(s) for s in slots]
        if batch_size != 1 or host != [0]:
            raise ConfigError(
                f"the Hugging Face adapter serves one sequence (slot 0), got slots {host} for a batch of "
                f"{batch_size}; run one request at a time (max_batch=1)"
            )
        return host, torch.zeros(1, dtype=torch.int64, device=self.device)

    def sync_bounds(self) -> None:
        """Nothing to do: lengths are host integers here."""

    def next_positions(self, num_tokens: int, slots: Sequence[int] | None = None, batch_size: int = 1) -> Tensor:
        """``[1, T]`` int64: ``length + t``."""
        self.resolve_slots(slots, len(slots) if slots is not None else batch_size)
        return self._length + torch.arange(num_tokens, dtype=torch.int64, device=self.device)[None, :]

    def truncate(self, new_lengths: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None:
        """Roll back to ``new_lengths`` ``[1]`` (lengths only shrink)."""
        self._set_length(min(self._length, self._one(new_lengths, slots, "truncate")))

    def keep_step_prefix(self, num_keep: Sequence[int] | Tensor, slots: Sequence[int] | None = None) -> None:
        """Keep the first ``num_keep[0]`` entries of the last forward step."""
        keep = self._one(num_keep, slots, "keep_step_prefix")
        self._set_length(min(self._length, self._step_start + keep))

    def compact(self, slots: int | Sequence[int], keep_indices: Tensor, num_keep: Any = None) -> None:
        raise ConfigError("the Hugging Face adapter runs chains only, not trees; use a chain drafter")

    def _one(self, values: Sequence[int] | Tensor, slots: Sequence[int] | None, what: str) -> int:
        self.resolve_slots(slots if slots is not None else [0], 1)
        # A tensor argument costs one device sync: the DynamicCache is cropped on the host side.
        host = [int(v) for v in (values.reshape(-1).tolist() if isinstance(values, Tensor) else values)]
        if len(host) != 1 or host[0] < 0:
            raise InputError(f"{what} needs one count >= 0 for the adapter's one sequence, got {host}")
        return host[0]

    def _set_length(self, length: int) -> None:
        if length == 0 or self.dynamic is None:
            self.dynamic = self._new_dynamic()  # transformers 4.x/5.x disagree on crop(0); start afresh
        elif length < self._length:
            self.dynamic.crop(length - self._length)  # negative: remove that many tokens (both versions)
        self._record(length, self._step_start)

    def _record(self, length: int, step_start: int) -> None:
        """Set the host lengths and their tensor copies."""
        self._length, self._step_start = length, step_start
        self.lengths = torch.tensor([length], dtype=torch.int64, device=self.device)
        self.step_start = torch.tensor([step_start], dtype=torch.int64, device=self.device)


class HFCausalLMAdapter:
    """A transformers causal LM behind the runtime's interface (one sequence, chains only).

    ``config`` describes the model as a :class:`ModelConfig`: exactly (via ``config_from_hf``)
    for the families the runtime implements; for other architectures ``vocab_size`` (the LM head's
    rows), ``num_layers``, ``hidden_size``, ``num_heads`` and the token ids are exact and the
    Llama-specific fields (``rope_theta``, ``rms_norm_eps``, ``intermediate_size``, ...) best-effort
    placeholders. Build it with :func:`verispec.formats.hf.load_adapter` (a folder) or
    :func:`verispec.formats.hf.adapt` (a model in eval mode), which describe the model.
    """

    def __init__(self, model: Any, config: ModelConfig) -> None:
        transformers = import_transformers()
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedModelError("the Hugging Face adapter runs decoder-only causal LMs only")
        if model.training:
            raise ConfigError("the model is in training mode (dropout on); call model.eval() first")
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4
        self._keep_logits = "logits_to_keep" in params
        self._new_dynamic = transformers.DynamicCache  # no config: full, croppable layers everywhere
        self.config = config
        self.cpu_kernels = False  # transformers' own kernels
        self.lm_head: torch.nn.Module | None = None  # not exposed: the draft head cannot be restricted

    @property
    def precision(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, str(self.dtype).removeprefix("torch."))

    @property
    def lm_weight(self) -> Tensor | None:
        return None

    @property
    def embed_weight(self) -> Tensor | None:
        table = self.model.get_input_embeddings()
        return table.weight.detach() if table is not None else None

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def new_cache(self, max_batch: int, max_len: int) -> HFCache:
        """An empty one-sequence cache; ``max_batch`` must be 1."""
        if max_batch != 1 or max_len <= 0:
            raise ConfigError(
                f"the Hugging Face adapter serves one sequence: new_cache needs max_batch=1 and max_len > 0, "
                f"got max_batch={max_batch}, max_len={max_len}"
            )
        return HFCache(max_len, self.device, self._new_dynamic)

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.forward(*args, **kwargs)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: HFCache,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
        prefill: bool = False,
    ) -> Tensor:
        """As :meth:`Transformer.forward` for one row: ``tokens`` ``[1, T]`` -> logits ``[1, N, V]``
        fp32, appending to ``cache``. ``prefill`` changes nothing here (transformers has one path)."""
        return self._run(tokens, positions, cache, attn_mask, num_new, slots, logits_at, False).logits

    def forward_with_hidden(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        cache: HFCache,
        attn_mask: Tensor | None = None,
        *,
        num_new: Tensor | Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        logits_at: Tensor | None = None,
        prefill: bool = False,
    ) -> ForwardOutput:
        """:meth:`forward` plus the last hidden states ``[1, T, C]`` (transformers' last
        ``hidden_states`` entry, after the final norm)."""
        return self._run(tokens, positions, cache, attn_mask, num_new, slots, logits_at, True)

    def _run(
        self,
        tokens: Tensor,  # [1, T] int64
        positions: Tensor | None,  # [1, T] int64: must be the chain's
        cache: HFCache,
        attn_mask: Tensor | None,
        num_new: Tensor | Sequence[int] | None,
        slots: Sequence[int] | None,
        logits_at: Tensor | None,  # [1, N] int64
        hidden: bool,
    ) -> ForwardOutput:
        if not isinstance(cache, HFCache):
            raise InputError("the Hugging Face adapter needs its own cache: use adapter.new_cache(1, max_len)")
        if tokens.dim() != 2:
            raise InputError(f"tokens must be [B, T] int64, got shape {tuple(tokens.shape)}")
        if attn_mask is not None:
            raise ConfigError("the Hugging Face adapter runs chains only: tree masks are not supported")
        b, t = tokens.shape
        cache.resolve_slots(slots, b)
        if not cache._in_use:
            raise InputError("the adapter's cache has no sequence: call cache.add_sequence() first")
        # Host counts (syncs): the adapter is the portable path; transformers needs host shapes.
        n = t if num_new is None else int(torch.as_tensor(num_new).reshape(-1)[0])
        start = cache._length
        chain = cache.next_positions(t)  # [1, T]
        if positions is not None and not torch.equal(positions[:, :n].to(chain.device), chain[:, :n]):
            raise ConfigError("the Hugging Face adapter runs chains only: positions must be length + t")
        if not 0 <= n <= t or start + n > cache.max_len:
            raise InputError(
                f"cannot add {n} of {t} tokens to a sequence of {start} with max_len={cache.max_len}; "
                "build the cache with a larger max_len or stop the sequence earlier"
            )
        picks = None if logits_at is None else logits_at.to(self.device).clamp(0, max(n - 1, 0))  # [1, N]
        keep = picks is not None and self._keep_logits and not hidden and n > 0
        with torch.inference_mode():
            logits = torch.zeros(1, 0, self.config.vocab_size, device=self.device)  # [1, n, V] fp32 once run
            states = torch.zeros(1, n, self.config.hidden_size, dtype=self.dtype, device=self.device)
            if n > 0:
                kwargs: dict[str, Any] = {self._cache_arg: cache.dynamic, "output_hidden_states": hidden}
                if keep and picks is not None:
                    kwargs["logits_to_keep"] = picks[0]  # only the wanted rows go through the LM head
                out = self.model(input_ids=tokens[:, :n].to(self.device), use_cache=True, **kwargs)
                logits = out.logits.float()
                states = out.hidden_states[-1] if hidden else states
            # Rows past num_new are right padding: zeros (garbage in Transformer too).
            states = F.pad(states, (0, 0, 0, t - n))  # [1, T, C]
            if not keep:
                logits = F.pad(logits, (0, 0, 0, t - n))  # [1, T, V]
                if picks is not None:
                    logits = logits.gather(1, picks[:, :, None].expand(-1, -1, logits.shape[-1]))
        cache._record(start + n, start)
        assert n == 0 or cache.dynamic.get_seq_length() == cache._length, "DynamicCache out of step"
        return ForwardOutput(logits=logits, hidden=states)
