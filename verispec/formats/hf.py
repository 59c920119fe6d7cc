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
tokenizer, :meth:`~verispec.formats.tokenizer.Tokenizer.from_hf_folder`, keeps all stop ids).

**Adapter** (:func:`load_adapter`, :func:`adapt`). Any causal LM transformers can run (GPT-2,
GPT-NeoX, Phi, ...), described as a ModelConfig (:func:`describe`) and wrapped in
:class:`~verispec.models.hf_adapter.HFCausalLMAdapter`, the runtime's interface over transformers
(one sequence, chains only; see that module). transformers is optional and imported only when an
adapter is built.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from verispec.errors import ConfigError, ModelLoadError, UnsupportedModelError, VerispecError
from verispec.models.config import ModelConfig, RopeScaling
from verispec.models.hf_adapter import HFCausalLMAdapter, import_transformers

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
_USE_ADAPTER = (
    "run it through the transformers adapter (HFCausalLMAdapter, from verispec.formats.hf.load_adapter; needs "
    "transformers) instead"
)


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
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON or UTF-8; deep nesting
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
            name = str(file)
            # A shard is a plain file name in the model's folder: the index is downloaded data, and a
            # path like "../../secret" or "/etc/passwd" in it must not make us open files elsewhere.
            if not name or "/" in name or "\\" in name or name in (".", "..") or Path(name).is_absolute():
                raise ModelLoadError(
                    f"{index_path}: shard {name[:100]!r} (for tensor {str(tensor)[:100]!r}) is not a file name "
                    "inside the model folder; the index is corrupt or crafted: download it again"
                )
            shards.setdefault(root / name, []).append(tensor)
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


# ----------------------------------------------------------------------- the transformers adapter
def adapt(model: Any) -> HFCausalLMAdapter:
    """A transformers causal LM in eval mode behind the runtime's interface, described as a
    :class:`ModelConfig` (:func:`describe`)."""
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    vocab = int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
    return HFCausalLMAdapter(model, describe(model.config, vocab, tied))


def load_adapter(
    path: str | os.PathLike[str],
    dtype: torch.dtype | str = "fp32",
    device: torch.device | str = "cpu",
) -> HFCausalLMAdapter:
    """Load a local folder with ``AutoModelForCausalLM`` (safetensors only, no download, no
    remote code)."""
    transformers = import_transformers()
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
    return adapt(model.to(device).eval())


def describe(hf_config: Any, vocab: int, tied: bool) -> ModelConfig:
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
