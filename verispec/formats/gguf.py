"""Llama / Qwen2 models from GGUF files: a :class:`ModelConfig` and Hugging Face-named tensors.

A GGUF file written by llama.cpp's ``convert_hf_to_gguf.py`` (and optionally ``llama-quantize``)
keeps a model's hyperparameters as ``{arch}.*`` metadata and its weights under llama.cpp's names.
This module maps both back to what the Hugging Face checkpoint of the same model has:

==============================  ====================================================
GGUF tensor                     Hugging Face name
==============================  ====================================================
token_embd.weight               model.embed_tokens.weight            [V, H]
blk.N.attn_norm.weight          model.layers.N.input_layernorm.weight
blk.N.attn_{q,k,v}.{weight,bias}  model.layers.N.self_attn.{q,k,v}_proj.{weight,bias}
blk.N.attn_output.weight        model.layers.N.self_attn.o_proj.weight
blk.N.ffn_norm.weight           model.layers.N.post_attention_layernorm.weight
blk.N.ffn_{gate,up,down}.weight model.layers.N.mlp.{gate,up,down}_proj.weight
output_norm.weight              model.norm.weight
output.weight                   lm_head.weight (absent => tie_word_embeddings)
rope_freqs.weight               model.rope_freqs (Llama 3.1+: per-frequency RoPE divisors that
                                llama.cpp stores instead of HF's ``rope_scaling`` "llama3" block)
==============================  ====================================================

RoPE layout. Hugging Face's Llama and Qwen2 rotate channel ``i`` of a head with channel
``i + head_dim/2`` ("rotate half", GPT-NeoX style). For ``llama`` files, llama.cpp's converter
permutes the rows of ``q_proj`` / ``k_proj`` within each head to the interleaved layout its
default RoPE uses (pairs ``(2i, 2i+1)``); we undo that permutation on load (rows only, so it
commutes with quantisation, which works along rows, and applies to raw blocks too). ``qwen2`` files
are NOT permuted: llama.cpp runs Qwen2 with its NeoX RoPE mode, and its converter only permutes in
its ``LlamaModel`` class. Checked on Qwen2.5-Coder-0.5B-Instruct Q4_K_M: through transformers'
Qwen2 (rotate half), the next-token loss of a 92-token Python snippet is 0.557 nats with the rows
as stored and 1.207 with llama's un-permutation applied, and every tensor we load equals, bit for
bit, what ``transformers`` loads from the same file.

Weights dequantise through :mod:`verispec.formats.dequant` (bit-identical to ``gguf.quants``);
:meth:`GGUFModel.quantized` hands out the raw blocks instead, for integer kernels.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import ConfigError, InputError, ModelLoadError, UnsupportedModelError
from verispec.formats.dequant import FORMATS, SUPPORTED_TYPES, dequantize
from verispec.formats.gguf_file import GGUFFile, MetadataValue
from verispec.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "model.rope_freqs",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_FLOAT_TYPES = ("F32", "F16", "BF16")
#: Architectures whose GGUF conversion interleaves q/k rows for llama.cpp's non-NeoX RoPE.
_PERMUTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one Hugging Face-named tensor lives in the file and how it is stored."""

    name: str  # Hugging Face name
    gguf_name: str
    type_name: str  # GGML storage type: "Q4_K", "Q6_K", "F32", ...
    shape: tuple[int, ...]  # PyTorch order: [out_features, in_features] for a linear weight
    nbytes: int
    rope_heads: int  # > 0: rows are llama.cpp-interleaved per head (this many heads), undone on load


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """The stored blocks of a quantised 2-D tensor, for integer kernels.

    ``blocks`` is ``[rows, cols // block_size * type_size]`` uint8; row ``r`` holds the blocks of
    row ``r`` of the ``[rows, cols]`` matrix in Hugging Face row order (llama q/k rows already
    un-permuted). It is a read-only view of the file's memory map unless rows had to be reordered.
    """

    name: str
    type_name: str
    shape: tuple[int, int]
    block_size: int
    type_size: int
    blocks: np.ndarray


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or ``None`` if it is not one we map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def _unpermute_tensor(rows: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row interleave: within each head, GGUF row ``2i + j`` is HF row
    ``j * head_dim/2 + i``. [R, ...] -> [R, ...] (R = n_heads * head_dim)."""
    shape = tuple(rows.shape)
    return rows.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _unpermute_blocks(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """:func:`_unpermute_tensor` for the rows of raw quantised blocks: [R, row_bytes] uint8."""
    shape = rows.shape
    return np.ascontiguousarray(rows.reshape(n_heads, shape[0] // n_heads // 2, 2, -1).swapaxes(1, 2)).reshape(shape)


class GGUFModel:
    """A Llama / Qwen2 GGUF file: its :attr:`config`, its tensors by Hugging Face name, lazily.

    Opening reads only the header (well under a second); tensors are dequantised on request by
    :meth:`load` / :meth:`state_dict`, or handed out raw by :meth:`quantized`.

    Raises :class:`ModelLoadError` (file missing, truncated, corrupt, metadata missing) and
    :class:`UnsupportedModelError` (architecture, tensor type or tensor not supported) on open, so
    a model that opens is a model that loads.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.file = GGUFFile(path)
        self.config = config_from_gguf(self.file)
        self._infos = self._map_tensors()

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def metadata(self) -> dict[str, MetadataValue]:
        """Every metadata key/value of the file (tokenizer included), decoded."""
        return self.file.metadata

    @property
    def tensor_names(self) -> list[str]:
        """Hugging Face names of all tensors, in file order."""
        return list(self._infos)

    def tensor_info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            raise InputError(f"{self.path.name} has no tensor {name!r}; see GGUFModel.tensor_names")
        return info

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Tensor ``name`` dequantised to ``dtype`` (float32 values, rounded once if narrower)."""
        info = self.tensor_info(name)
        value = dequantize(self.file.data(info.gguf_name), info.type_name, info.shape, dtype)
        if info.rope_heads:
            value = _unpermute_tensor(value, info.rope_heads).contiguous()
        return value

    def quantized(self, name: str) -> QuantizedTensor:
        """The raw blocks of a quantised 2-D tensor (Q4_K, Q6_K, Q8_0, Q5_0, ...)."""
        info = self.tensor_info(name)
        if info.type_name in _FLOAT_TYPES or len(info.shape) != 2:
            raise InputError(
                f"{name} is a {len(info.shape)}-D {info.type_name} tensor, not a quantised matrix; "
                f"use GGUFModel.load({name!r})"
            )
        blocks = self.file.data(info.gguf_name)  # [rows, row_bytes] uint8, read-only map
        if info.rope_heads:
            blocks = _unpermute_blocks(blocks, info.rope_heads)
        fmt = FORMATS[info.type_name]
        rows, cols = info.shape
        return QuantizedTensor(name, info.type_name, (rows, cols), fmt.block_size, fmt.type_size, blocks)

    def iter_tensors(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for every tensor, dequantised one at a time."""
        for name in self._infos:
            yield name, self.load(name, dtype)

    def state_dict(
        self,
        dtype: torch.dtype = torch.bfloat16,
        progress: Callable[[str, int, int], None] | None = None,
    ) -> dict[str, Tensor]:
        """All tensors, dequantised to ``dtype``. Norm weights and biases are small; they follow
        ``dtype`` too. ``progress(name, done, total)`` is called after each tensor."""
        out: dict[str, Tensor] = {}
        total = len(self._infos)
        for done, (name, tensor) in enumerate(self.iter_tensors(dtype), start=1):
            out[name] = tensor
            if progress is not None:
                progress(name, done, total)
        return out

    def _map_tensors(self) -> dict[str, TensorInfo]:
        cfg = self.config
        infos: dict[str, TensorInfo] = {}
        unknown = []
        for entry in self.file.tensors.values():
            name = hf_tensor_name(entry.name)
            if name is None:
                unknown.append(entry.name)
                continue
            if entry.type_name not in SUPPORTED_TYPES:
                raise UnsupportedModelError(
                    f"{self.path.name}: tensor {entry.name} is stored as {entry.type_name}; supported "
                    f"types: {', '.join(SUPPORTED_TYPES)}. Use a GGUF quantised with one of these "
                    f"(e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16)."
                )
            rope_heads = 0
            if cfg.architecture in _PERMUTED_ARCHITECTURES:
                if ".self_attn.q_proj." in name:
                    rope_heads = cfg.num_heads
                elif ".self_attn.k_proj." in name:
                    rope_heads = cfg.num_kv_heads
            infos[name] = TensorInfo(name, entry.name, entry.type_name, entry.shape, entry.nbytes, rope_heads)
        if unknown:
            raise UnsupportedModelError(
                f"{self.path.name}: tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''} are not "
                f"part of a {cfg.architecture} model as verispec implements it "
                f"(supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._check_shapes(infos)
        return infos

    def _check_shapes(self, infos: dict[str, TensorInfo]) -> None:
        cfg = self.config
        q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        expected = {
            "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
            "model.norm.weight": (cfg.hidden_size,),
        }
        if not cfg.tie_word_embeddings:
            expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            expected |= {
                p + "input_layernorm.weight": (cfg.hidden_size,),
                p + "self_attn.q_proj.weight": (q_rows, cfg.hidden_size),
                p + "self_attn.k_proj.weight": (kv_rows, cfg.hidden_size),
                p + "self_attn.v_proj.weight": (kv_rows, cfg.hidden_size),
                p + "self_attn.o_proj.weight": (cfg.hidden_size, q_rows),
                p + "post_attention_layernorm.weight": (cfg.hidden_size,),
                p + "mlp.gate_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.up_proj.weight": (cfg.intermediate_size, cfg.hidden_size),
                p + "mlp.down_proj.weight": (cfg.hidden_size, cfg.intermediate_size),
            }
            if cfg.attention_bias:
                expected |= {
                    p + "self_attn.q_proj.bias": (q_rows,),
                    p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,),
                }
        missing = [n for n in expected if n not in infos]
        if missing:
            raise ModelLoadError(
                f"{self.path.name}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                f"for a {cfg.num_layers}-layer {cfg.architecture} model; the file is incomplete or corrupt"
            )
        for name, shape in expected.items():
            if infos[name].shape != shape:
                raise ModelLoadError(
                    f"{self.path.name}: tensor {name} has shape {infos[name].shape}, the metadata "
                    f"implies {shape}; the file is inconsistent (re-convert it)"
                )


def _int(file: GGUFFile, key: str, default: int | None = None) -> int:
    value = file.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{file.path.name}: metadata key {key} is missing; the GGUF is incomplete")
        return default
    if isinstance(value, np.ndarray):
        raise UnsupportedModelError(
            f"{file.path.name}: {key} varies per layer ({value.tolist()[:4]} ...); per-layer head counts "
            f"are not supported"
        )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{file.path.name}: metadata key {key} should be an integer, got {value!r}")
    return value


def _float(file: GGUFFile, key: str, default: float | None = None) -> float:
    value = file.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{file.path.name}: metadata key {key} is missing; the GGUF is incomplete")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"{file.path.name}: metadata key {key} should be a number, got {value!r}")
    return float(value)


def _rope_scaling(file: GGUFFile, arch: str) -> RopeScaling | None:
    prefix = f"{arch}.rope.scaling."
    kind = file.get(prefix + "type")
    factor = file.get(prefix + "factor")
    if kind is None and file.get(f"{arch}.rope.scale_linear") is not None:  # pre-2024 files
        kind, factor = "linear", file.get(f"{arch}.rope.scale_linear")
    if kind is None or kind == "none":
        return None
    if not isinstance(kind, str) or not isinstance(factor, int | float):
        raise ModelLoadError(f"{file.path.name}: {prefix}type / factor are malformed ({kind!r}, {factor!r})")
    original = file.get(prefix + "original_context_length")
    extra = tuple(
        sorted(
            (key[len(prefix) :], value)
            for key, value in file.metadata.items()
            if key.startswith(prefix)
            and key[len(prefix) :] not in ("type", "factor", "original_context_length")
            and isinstance(value, int | float | bool | str)
        )
    )
    return RopeScaling(kind, float(factor), original if isinstance(original, int) else None, extra)


def _token_id(file: GGUFFile, key: str) -> int | None:
    value = file.get(f"tokenizer.ggml.{key}")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_from_gguf(file: GGUFFile) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file's metadata describes."""
    arch = file.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{file.path.name}: general.architecture is missing; not a model GGUF")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{file.path.name}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _int(file, f"{arch}.embedding_length")
    heads = _int(file, f"{arch}.attention.head_count")
    head_dim = _int(file, f"{arch}.attention.key_length", hidden // heads if heads else 0)
    if _int(file, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{file.path.name}: key and value head sizes differ; not supported")
    if _int(file, f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(
            f"{file.path.name}: RoPE covers {file.get(f'{arch}.rope.dimension_count')} of {head_dim} "
            f"head channels; partial rotary embeddings are not supported"
        )
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{file.path.name}: tensor token_embd.weight is missing; the GGUF is incomplete")
    tokens = file.get("tokenizer.ggml.tokens")
    vocab = _int(file, f"{arch}.vocab_size", embedding.shape[0])
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise ModelLoadError(
            f"{file.path.name}: the tokenizer has {len(tokens)} tokens but the model only {vocab} rows"
        )
    name = file.get("general.name")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int(file, f"{arch}.feed_forward_length"),
            num_layers=_int(file, f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=_int(file, f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=_float(file, f"{arch}.rope.freq_base", 10000.0),  # llama.cpp's default
            rms_norm_eps=_float(file, f"{arch}.attention.layer_norm_rms_epsilon"),
            max_position=_int(file, f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in file.tensors,
            attention_bias="blk.0.attn_q.bias" in file.tensors,
            rope_scaling=_rope_scaling(file, arch),
            bos_token_id=_token_id(file, "bos_token_id"),
            eos_token_id=_token_id(file, "eos_token_id"),
            pad_token_id=_token_id(file, "padding_token_id"),
            name=name if isinstance(name, str) else "",
        )
    except ConfigError as exc:
        raise ModelLoadError(f"{file.path.name}: inconsistent model metadata: {exc}") from exc


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file, reading only its header."""
    return config_from_gguf(GGUFFile(path))


def load_gguf(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """``(config, state_dict)`` of a GGUF model, every tensor dequantised to ``dtype``."""
    model = GGUFModel(path)
    logger.info(
        "loading %s (%s, %d tensors) as %s",
        model.path.name,
        model.config.name,
        len(model.tensor_names),
        dtype,
    )
    return model.config, model.state_dict(dtype)
