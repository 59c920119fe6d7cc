"""The quantised precisions "int4" and "int8": which projection runs on which kernel, packing, and
the packed-weight cache.

Norms, embeddings, attention and the KV cache stay bf16 in both; only the projections (q/k/v/o,
gate/up/down, the LM head) change, each by the rule below applied to the GGML type the GGUF file
stores it in (:func:`choose_kind`). Both kinds of packed projection quantise their input
activations to int8 in blocks of 64 (W8A8, like llama.cpp's Q8 activations; see
:mod:`verispec.kernels.linear`).

=========  ==========================================  ==========================================
precision  stored as Q4_K                              stored otherwise (Q6_K, Q5_0, Q8_0, F16, ...)
=========  ==========================================  ==========================================
"int4"     ``q4k``: the GGUF blocks repacked, used     ``int8``: per-output-channel int8 of the
           exactly (:class:`~verispec.kernels.Q4KLinear`;  exact (dequantised fp32) weights: a SECOND
           no second quantisation)                     rounding, for these tensors only
"int8"     ``int8`` of the exact weights               ``int8`` of the exact weights
=========  ==========================================  ==========================================

A projection whose input size is not a multiple of 32 (no GGUF K-quant or 32-block type has one)
stays ``dense`` bf16. Q4_K_M files keep Q6_K for the LM head and half of the ``ffn_down`` /
``attn_v`` tensors, so an "int4" Qwen2.5-1.5B runs 169 projections on Q4_K and 29 on int8; the
0.5B file stores nearly everything as Q5_0 or Q8_0 (its hidden size 896 is not a multiple of
Q4_K's 256), so there "int4" is mostly int8. A source without GGUF blocks (a Hugging Face
folder) has no Q4_K tensors: "int4" is refused there, "int8" quantises its floating-point weights.

Packed tensors are cached beside a prepared model, ``<folder>/int4.safetensors`` /
``int8.safetensors`` (only the packed projections: codes, scales, fp32 biases; the rest comes from
``bf16.safetensors``), written once, atomically, under a lock, and memory-mapped afterwards; the
file records the source GGUF's sha256 and the packing format, and is rebuilt when either
changes. A plain ``.gguf`` path is packed at load time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import ConfigError
from verispec.formats.files import ProgressFn, locked
from verispec.formats.gguf import GGUFModel
from verispec.models.config import ModelConfig

logger = logging.getLogger(__name__)

PRECISIONS = ("int4", "int8")
#: Version of the packed layouts (bump when csrc's layouts change: caches then rebuild).
PACK_FORMAT = "verispec.packed/3"  # 3: the integer-kernel layouts (csrc/w8a8.cpp, csrc/q4k.cpp)
INT8_ALIGN = 32


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One projection of the model: where its weights come from and its shape."""

    prefix: str  # module path, e.g. "model.layers.3.mlp.down_proj" or "lm_head"
    source: str  # tensor holding its weights ("model.embed_tokens.weight" for a tied LM head)
    out_features: int
    in_features: int
    bias: bool


def linear_specs(config: ModelConfig) -> list[LinearSpec]:
    """Every projection of a model with ``config``, in module order, the LM head last."""
    c, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv, bias = config.num_heads * d, config.num_kv_heads * d, config.attention_bias
    specs = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, out, inp, has_bias in (
            ("self_attn.q_proj", q, c, bias),
            ("self_attn.k_proj", kv, c, bias),
            ("self_attn.v_proj", kv, c, bias),
            ("self_attn.o_proj", c, q, False),
            ("mlp.gate_proj", f, c, False),
            ("mlp.up_proj", f, c, False),
            ("mlp.down_proj", c, f, False),
        ):
            specs.append(LinearSpec(p + name, p + name + ".weight", out, inp, has_bias))
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    specs.append(LinearSpec("lm_head", head, config.vocab_size, c, False))
    return specs


def choose_kind(precision: str, stored_type: str, in_features: int) -> str:
    """ "q4k", "int8" or "dense" for a projection stored as ``stored_type`` (see the module table)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"quantised precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "int4" and stored_type == "Q4_K":
        return "q4k"
    return "int8" if in_features % INT8_ALIGN == 0 else "dense"


class WeightSource:
    """Where packing reads weights: a GGUF file (raw blocks and exact fp32 values) or a state dict."""

    def __init__(self, gguf: GGUFModel | None = None, state_dict: Mapping[str, Tensor] | None = None) -> None:
        assert (gguf is None) != (state_dict is None)
        self.gguf = gguf
        self.state = state_dict

    def stored_type(self, name: str) -> str:
        if self.gguf is not None:
            return self.gguf.tensor_info(name).type_name
        assert self.state is not None
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}.get(self.state[name].dtype, "?")

    def blocks(self, name: str) -> np.ndarray:  # [rows, row_bytes] uint8
        assert self.gguf is not None
        return self.gguf.quantized(name).blocks

    def float32(self, name: str) -> Tensor:
        if self.gguf is not None:
            return self.gguf.load(name, torch.float32)
        assert self.state is not None
        return self.state[name].to(torch.float32)


def plan(source: WeightSource, config: ModelConfig, precision: str) -> dict[str, str]:
    """``{projection prefix: kind}`` for ``precision`` (see :func:`choose_kind`)."""
    kinds = {
        s.prefix: choose_kind(precision, source.stored_type(s.source), s.in_features) for s in linear_specs(config)
    }
    if precision == "int4" and "q4k" not in kinds.values():
        raise ConfigError(
            "dtype int4 runs the GGUF's Q4_K weights as they are stored, and this model has none (it is not a "
            "GGUF file, or one quantised another way); use int8 or bf16"
        )
    return kinds


def _layout(config: ModelConfig, kinds: Mapping[str, str]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the packed projections consist of, in writing order."""
    from verispec.kernels.linear import ROWS, q4k_packed_numel

    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for s in linear_specs(config):
        kind, rows = kinds[s.prefix], -(-s.out_features // ROWS) * ROWS
        if kind == "q4k":
            entries.append((s.prefix + ".q4k", torch.uint8, (q4k_packed_numel(s.out_features, s.in_features),)))
        elif kind == "int8":
            entries.append((s.prefix + ".int8", torch.int8, (rows * s.in_features,)))
            entries.append((s.prefix + ".int8_scale", torch.float32, (rows,)))
        if kind != "dense" and s.bias:
            entries.append((s.prefix + ".bias", torch.float32, (s.out_features,)))
    return entries


def _packed_tensors(
    source: WeightSource, config: ModelConfig, kinds: Mapping[str, str], progress: ProgressFn | None
) -> Iterator[tuple[str, Tensor]]:
    """The tensors of :func:`_layout`, in its order, made one projection at a time."""
    from verispec.kernels import Int8Linear, Q4KLinear

    specs = [s for s in linear_specs(config) if kinds[s.prefix] != "dense"]
    for done, s in enumerate(specs, start=1):
        bias = source.float32(s.prefix + ".bias") if s.bias else None
        if kinds[s.prefix] == "q4k":
            module: torch.nn.Module = Q4KLinear.from_blocks(
                source.blocks(s.source), s.out_features, s.in_features, bias
            )
        else:
            module = Int8Linear.from_weight(source.float32(s.source), bias)
        for name, tensor in module.state_dict().items():
            yield f"{s.prefix}.{name}", tensor
        if progress is not None:
            progress("pack", done, len(specs))


def pack(
    source: WeightSource, config: ModelConfig, precision: str, progress: ProgressFn | None = None
) -> dict[str, Tensor]:
    """The packed projections of a model (in memory), by state-dict name."""
    kinds = plan(source, config, precision)
    return dict(_packed_tensors(source, config, kinds, progress))


def cache_path(folder: Path, precision: str) -> Path:
    return folder / f"{precision}.safetensors"


def load_or_pack(
    folder: Path, gguf_path: Path, source_sha256: str, config: ModelConfig, precision: str,
    progress: ProgressFn | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """The packed projections of the prepared model in ``folder``, from its cache file, which is
    (re)built from ``gguf_path`` first when missing or stale (see the module docstring)."""
    from verispec.formats.convert import load_safetensors, read_metadata, write_tensors

    path = cache_path(folder, precision)
    wanted = {"packing": PACK_FORMAT, "precision": precision, "source_sha256": source_sha256}

    def fresh() -> bool:
        meta = read_metadata(path)
        return meta is not None and all(meta.get(k) == v for k, v in wanted.items())

    if not fresh():
        with locked(folder.parent / f".{folder.name}.{precision}.lock"):
            if not fresh():  # another process may have built it while we waited
                start = time.perf_counter()
                logger.warning("packing %s weights of %s once into %s", precision, folder.name, path.name)
                source = WeightSource(gguf=GGUFModel(gguf_path))
                kinds = plan(source, config, precision)
                tensors = _packed_tensors(source, config, kinds, progress)
                write_tensors(path, _layout(config, kinds), tensors, metadata=wanted)
                logger.warning("packed in %.1f s", time.perf_counter() - start)
    return load_safetensors(path)


def packed_prefixes(packed: Mapping[str, Tensor]) -> set[str]:
    """The projections (module paths) a dict of packed tensors holds."""
    return {name.rpartition(".")[0] for name in packed}


def merge(dense: Mapping[str, Tensor], packed: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The state dict of a quantised model: ``dense`` (embeddings, norms, dense projections) without
    the weights and biases of the projections ``packed`` holds, plus ``packed``."""
    prefixes = packed_prefixes(packed)
    keep = {k: v for k, v in dense.items() if k.rpartition(".")[0] not in prefixes}
    return keep | dict(packed)
