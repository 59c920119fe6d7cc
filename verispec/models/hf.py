"""Hugging Face model folders: the runtime's loader, and an adapter for architectures it lacks.

**Loader** (:func:`load_hf_folder`). A folder written by transformers' ``save_pretrained`` holds
``config.json`` and the weights as ``model.safetensors`` or as shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). The weights already
use the names :class:`~verispec.models.transformer.Transformer` expects, so loading is reading:
every shard is opened memory-mapped (``safetensors.safe_open``), each tensor read once and
converted to the requested dtype and device (no second copy when it already has them).
``pytorch_model.bin`` files are refused: they are Python pickles, which can run code when loaded.

``config.json`` maps onto :class:`~verispec.models.config.ModelConfig` key for key
(:func:`config_from_hf`), for ``LlamaForCausalLM`` (SmolLM, Llama 2/3), ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` (always q/k/v biases). RoPE settings are read in both spellings:
transformers 4.x (``rope_theta`` plus a ``rope_scaling`` block, ``type`` or ``rope_type``) and 5.x
(one ``rope_parameters`` block holding ``rope_theta``). Sliding-window attention (Mistral v0.1,
Qwen2 with ``use_sliding_window``) is not implemented; since full attention equals windowed
attention while a sequence fits in the window, such a config is loaded with ``max_position``
lowered to the window (a warning says so), and refused when it also scales RoPE (whose result
depends on ``max_position``). ``eos_token_id`` may be a list; ModelConfig keeps its first id (the
tokenizer, :meth:`~verispec.models.tokenizer.Tokenizer.from_hf_folder`, keeps all stop ids).

**Adapter** (:class:`HFCausalLMAdapter`). Any causal LM transformers can run (GPT-2, GPT-NeoX,
Phi, ...), behind the interface the engine uses for ``Transformer``: ``config``, ``dtype``,
``device``, ``new_cache`` and ``forward``. It serves one sequence and chains only (no batches, no
tree masks). Its cache (:class:`HFCache`) keeps the KVCache methods the engine calls over
transformers' ``DynamicCache``; a rollback crops the cache's tail, as transformers' assisted
generation does after verification (``crop`` with a negative count removes that many tokens).
transformers is optional and imported only when an adapter is built.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor

from verispec.errors import ConfigError, InputError, ModelLoadError, UnsupportedModelError, VerispecError
from verispec.models.config import ModelConfig, RopeScaling
from verispec.models.transformer import ForwardOutput

logger = logging.getLogger(__name__)

#: transformers class names the runtime implements -> family (the HF ``model_type``).
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
_RUNTIME_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # family -> ModelConfig.architecture
_ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn")
_ROPE_KEYS = (
    "rope_theta",
    "rope_type",
    "type",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
)
_DTYPES = (
    dict.fromkeys(("bf16", "bfloat16"), torch.bfloat16)
    | dict.fromkeys(("fp16", "float16", "half"), torch.float16)
    | dict.fromkeys(("fp32", "float32", "float"), torch.float32)
)
_USE_ADAPTER = "run it through verispec.models.hf.HFCausalLMAdapter (needs transformers) instead"


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or a name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"bfloat16"``, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ConfigError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or a torch.dtype")


# ------------------------------------------------------------------------------------- config.json


def _family(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = config.get("model_type")
    if not names and model_type in _RUNTIME_ARCH:
        return str(model_type)
    found = names or [str(model_type)]
    raise UnsupportedModelError(
        f"config.json: architecture {', '.join(found)} is not implemented by the runtime; "
        f"supported: {', '.join(HF_ARCHITECTURES)}; {_USE_ADAPTER}"
    )


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"config.json: {key} should be an integer, got {value!r}; is it a model config?")
    return value


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from transformers 4.x (``rope_theta`` + ``rope_scaling``) or 5.x
    (``rope_parameters``) spelling."""
    params: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        block = config.get(key) or {}
        if not isinstance(block, Mapping):
            raise ModelLoadError(f"config.json: {key} should be an object, got {block!r}")
        params.update(block)
    theta = config.get("rope_theta") or params.get("rope_theta", 10000.0)  # transformers' default
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    if partial != 1.0 or any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError(
            f"config.json: partial rotary embeddings or per-layer RoPE are not supported; {_USE_ADAPTER}"
        )
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        raise ModelLoadError(f"config.json: rope_theta should be a number, got {theta!r}")
    if kind == "default":
        return float(theta), None
    if kind not in _ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: RoPE scaling {kind!r} is not implemented; supported: {', '.join(_ROPE_TYPES)}; "
            f"{_USE_ADAPTER}"
        )
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    if not isinstance(factor, int | float) or isinstance(factor, bool):
        raise ModelLoadError(f"config.json: RoPE scaling {kind!r} needs a numeric factor, got {factor!r}")
    extra = sorted((k, v) for k, v in params.items() if k not in _ROPE_KEYS and isinstance(v, int | float | str))
    return float(theta), RopeScaling(kind, float(factor), original if isinstance(original, int) else None, tuple(extra))


def _token(config: Mapping[str, Any], key: str, vocab: int) -> int | None:
    """The id under ``key`` (the first one of a list); out-of-vocabulary ids are dropped."""
    value = config.get(key)
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if not 0 <= value < vocab:
        logger.warning("config.json: %s = %d is outside the vocabulary [0, %d); ignored", key, value, vocab)
        return None
    return value


def config_from_hf(config: Mapping[str, Any], *, name: str = "") -> ModelConfig:
    """The :class:`ModelConfig` a transformers ``config.json`` (as a dict) describes.

    Raises :class:`UnsupportedModelError` for architectures or features the runtime does not
    implement (the message points at :class:`HFCausalLMAdapter`), :class:`ModelLoadError` for a
    config with missing or malformed keys.
    """
    family = _family(config)
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"config.json: activation {act!r} is not supported (SwiGLU needs silu)")
    if config.get("mlp_bias") or (family != "qwen2" and config.get("attention_bias")):
        raise UnsupportedModelError(
            f"config.json: biases on the MLP or on o_proj (mlp_bias / attention_bias of {family}) are not "
            f"implemented; {_USE_ADAPTER}"
        )
    if config.get("quantization_config"):
        quant = config["quantization_config"]
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        raise UnsupportedModelError(
            f"config.json: quantized checkpoint ({method}); use the unquantized model or a GGUF file"
        )
    hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    vocab, max_position = _int(config, "vocab_size"), _int(config, "max_position_embeddings")
    theta, scaling = _rope(config)
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or ()
    windowed = family == "mistral" or config.get("use_sliding_window") or "sliding_attention" in layer_types
    if windowed and isinstance(window, int) and not isinstance(window, bool) and window < max_position:
        if scaling is not None:
            raise UnsupportedModelError(
                f"config.json: sliding-window attention (window {window}) together with RoPE scaling is not "
                f"implemented; {_USE_ADAPTER}"
            )
        logger.warning(
            "%s: sliding-window attention is not implemented; exact up to %d tokens, so max_position is "
            "lowered from %d to the window",
            name or "config.json",
            window,
            max_position,
        )
        max_position = window
    try:
        return ModelConfig(
            architecture=_RUNTIME_ARCH[family],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int(config, "intermediate_size"),
            num_layers=_int(config, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(config, "num_key_value_heads", heads),
            head_dim=_int(config, "head_dim", hidden // heads if heads else 0),
            rope_theta=theta,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position=max_position,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2",
            rope_scaling=scaling,
            bos_token_id=_token(config, "bos_token_id", vocab),
            eos_token_id=_token(config, "eos_token_id", vocab),
            pad_token_id=_token(config, "pad_token_id", vocab),
            name=name or str(config.get("_name_or_path") or ""),
        )
    except ConfigError as exc:
        raise ModelLoadError(f"config.json: inconsistent model config: {exc}") from exc


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no {what}; is {path.parent} a Hugging Face model folder?")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: unreadable {what} ({exc}); re-download the file") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: {what} should hold a JSON object; re-download the file")
    return value


def read_hf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face model folder (reads only ``config.json``)."""
    root = Path(path)
    raw = _read_json(root / "config.json", "config.json")
    try:
        return config_from_hf(raw, name=root.name)
    except ModelLoadError as exc:  # the same type (UnsupportedModelError stays one), with the folder
        raise type(exc)(f"{root}: {exc}") from exc


# ------------------------------------------------------------------------------------------ weights


def _weight_files(root: Path) -> Sequence[tuple[Path, Sequence[str] | None]]:
    """Shard file -> tensor names the index assigns to it (None: every tensor of the file)."""
    index_path = root / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map; re-download the file")
        shards: dict[Path, list[str]] = {}
        for tensor, file in weight_map.items():
            shards.setdefault(root / str(file), []).append(tensor)
        missing = sorted(p.name for p in shards if not p.is_file())
        if missing:
            raise ModelLoadError(
                f"{root}: shard(s) {', '.join(missing)} listed by {index_path.name} are missing; "
                "the download is incomplete: download them again"
            )
        return list(shards.items())
    if (root / "model.safetensors").is_file():
        return [(root / "model.safetensors", None)]
    if any(root.glob("pytorch_model*.bin")) or (root / "pytorch_model.bin.index.json").is_file():
        raise ModelLoadError(
            f"{root}: only pytorch_model.bin weights, which are not supported: they are Python pickles, and "
            "loading a pickle can run arbitrary code. Convert the folder once with transformers, in an "
            "environment you trust: AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, "
            "safe_serialization=True) (transformers 5 always writes safetensors)"
        )
    raise ModelLoadError(
        f"{root}: no model.safetensors or model.safetensors.index.json; download the model's safetensors files"
    )


def load_hf_folder(
    path: str | os.PathLike[str], dtype: torch.dtype | str = "bf16", device: torch.device | str = "cpu"
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(config, state_dict)`` of a Hugging Face model folder, every floating-point tensor in
    ``dtype`` on ``device``, ready for ``Transformer(config, state_dict, dtype=..., device=...)``."""
    root = Path(path)
    config = read_hf_config(root)
    target, dev = resolve_dtype(dtype), torch.device(device)
    state: dict[str, Tensor] = {}
    for file, names in _weight_files(root):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                present = set(handle.keys())
                absent = sorted(set(names or ()) - present)
                if absent:
                    raise ModelLoadError(
                        f"{file}: tensors {absent[:4]} listed by the index are not in this shard; "
                        "the index and the shards come from different downloads: download both again"
                    )
                for name in names if names is not None else sorted(present):
                    tensor = handle.get_tensor(name)
                    to = target if tensor.is_floating_point() else tensor.dtype
                    state[name] = tensor.to(device=dev, dtype=to)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(
                f"{file}: not a readable safetensors file ({exc}); it is truncated or corrupt: download it again"
            ) from exc
    logger.info("loaded %s: %d tensors as %s on %s", root.name, len(state), target, dev)
    return config, state


# ------------------------------------------------------------------------------------------ adapter


def _import_transformers() -> Any:
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

    ``config`` describes the model as a :class:`ModelConfig`: exactly (via :func:`config_from_hf`)
    for the families the runtime implements; for other architectures ``vocab_size`` (the LM head's
    rows), ``num_layers``, ``hidden_size``, ``num_heads`` and the token ids are exact and the
    Llama-specific fields (``rope_theta``, ``rms_norm_eps``, ``intermediate_size``, ...) best-effort
    placeholders. Build it from a folder with :meth:`from_pretrained`, or from a model in eval mode.
    """

    def __init__(self, model: Any) -> None:
        transformers = _import_transformers()
        if getattr(model.config, "is_encoder_decoder", False):
            raise UnsupportedModelError("the Hugging Face adapter runs decoder-only causal LMs only")
        if model.training:
            raise ConfigError("the model is in training mode (dropout on); call model.eval() first")
        self.model = model
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4
        self._keep_logits = "logits_to_keep" in params
        self._new_dynamic = transformers.DynamicCache  # no config: full, croppable layers everywhere
        head = model.get_output_embeddings()
        tied = head is not None and head.weight is model.get_input_embeddings().weight
        vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
        self.config = _describe(model.config, vocab, tied)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        dtype: torch.dtype | str = "fp32",
        device: torch.device | str = "cpu",
    ) -> HFCausalLMAdapter:
        """Load a local folder with ``AutoModelForCausalLM`` (safetensors only, no download, no
        remote code)."""
        transformers = _import_transformers()
        root = Path(path)
        _read_json(root / "config.json", "config.json")
        _weight_files(root)  # the same checks and messages as load_hf_folder
        major = int(transformers.__version__.split(".")[0])
        kwargs = {"dtype" if major >= 5 else "torch_dtype": resolve_dtype(dtype)}
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(root), local_files_only=True, use_safetensors=True, **kwargs
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{root}: transformers could not load the model ({exc})") from exc
        return cls(model.to(device).eval())

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
    ) -> Tensor:
        """As :meth:`Transformer.forward` for one row: ``tokens`` ``[1, T]`` -> logits ``[1, N, V]``
        fp32, appending to ``cache``."""
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


def _describe(hf_config: Any, vocab: int, tied: bool) -> ModelConfig:
    """A :class:`ModelConfig` for a transformers config (see :class:`HFCausalLMAdapter`)."""
    as_dict = hf_config.to_dict()
    try:  # transformers implements sliding windows: no need for config_from_hf's cap
        return config_from_hf({**as_dict, "sliding_window": None})
    except VerispecError:
        pass  # an architecture or feature the runtime lacks: describe it as far as it goes

    def first(*keys: str, default: Any = None) -> Any:
        values = (getattr(hf_config, k, None) for k in keys)
        return next((v for v in values if v is not None), default)

    hidden, heads = int(hf_config.hidden_size), int(hf_config.num_attention_heads)
    try:
        theta, scaling = _rope(as_dict)
    except VerispecError:
        theta, scaling = 10000.0, None  # RoPE the runtime cannot express (partial, per layer): a placeholder
    tokens = {k: _token({k: getattr(hf_config, k, None)}, k, vocab) for k in ("bos_token_id", "eos_token_id")}
    try:
        return ModelConfig(
            architecture=str(as_dict.get("model_type") or type(hf_config).__name__),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(first("num_key_value_heads", default=heads)),
            head_dim=int(first("head_dim", default=hidden // heads)),
            rope_theta=theta,
            rms_norm_eps=float(first("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-6)),
            max_position=int(first("max_position_embeddings", default=2048)),
            tie_word_embeddings=tied,
            attention_bias=bool(first("attention_bias", default=False)),
            rope_scaling=scaling,
            bos_token_id=tokens["bos_token_id"],
            eos_token_id=tokens["eos_token_id"],
            pad_token_id=_token({"p": getattr(hf_config, "pad_token_id", None)}, "p", vocab),
            name=str(as_dict.get("_name_or_path") or ""),
        )
    except ConfigError as exc:
        raise UnsupportedModelError(f"cannot describe this {type(hf_config).__name__} as a ModelConfig: {exc}") from exc
