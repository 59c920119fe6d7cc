"""Packing a model's projections into the layouts of the quantised precisions, and the packed-weight
cache (:mod:`verispec.models.quantized` says which projection gets which kernel).

Packed tensors are cached beside a prepared model, ``<folder>/int4.safetensors`` /
``int4-all.safetensors`` / ``int8.safetensors`` / ``bf16-packed.safetensors`` (the bf16 kernel's
layout, where bf16 runs on the kernels; only the packed projections: codes, scales, fp32 biases;
the rest comes from ``bf16.safetensors``), written once, atomically, under a lock, and
memory-mapped afterwards; the file records the source GGUF's sha256 and the packing format (and
for int4-all the requantisation's), and is rebuilt when one changes. A plain ``.gguf`` path is
packed at load time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import ConfigError
from verispec.formats.files import ProgressFn, locked
from verispec.formats.gguf import GGUFModel
from verispec.models.config import ModelConfig
from verispec.models.quantized import PACK_FORMAT, choose_kind, linear_specs, native_q6k

logger = logging.getLogger(__name__)


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
    """``{projection prefix: kind}`` for ``precision`` (see :func:`choose_kind`; "bf16": the bf16
    kernel's layout for every projection whose input size it takes, the LM head included)."""
    if precision == "bf16":
        from verispec.kernels.linear import BF16_ALIGN

        return {s.prefix: "bf16" if s.in_features % BF16_ALIGN == 0 else "dense" for s in linear_specs(config)}
    kinds = {
        s.prefix: choose_kind(precision, source.stored_type(s.source), s.in_features, s.prefix == "lm_head")
        for s in linear_specs(config)
    }
    if precision == "int4" and "q4k" not in kinds.values():
        raise ConfigError(
            "dtype int4 runs the GGUF's Q4_K weights as they are stored, and this model has none (it is not a "
            "GGUF file, or one quantised another way); use int8 or bf16"
        )
    return kinds


#: Buffers of a packed projection other than its codes (they follow all the codes in a cache file).
SMALL_BUFFERS = ("int8_scale", "bias")


def _layout(config: ModelConfig, kinds: Mapping[str, str]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the packed projections consist of, in writing order:
    the codes of every projection in module order, back to back, then their scales and biases. So
    q / k / v and gate / up lie one after another in the file, and their fused projection is a view
    of its mapping (:func:`verispec.kernels.linear.fuse_linears`), not a copy made at load."""
    from verispec.kernels.linear import ROWS, q4k_packed_numel, q6k_packed_numel

    codes: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    small: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for s in linear_specs(config):
        kind, rows = kinds[s.prefix], -(-s.out_features // ROWS) * ROWS
        if kind == "q4k":
            codes.append((s.prefix + ".q4k", torch.uint8, (q4k_packed_numel(s.out_features, s.in_features),)))
        elif kind == "q6k":
            codes.append((s.prefix + ".q6k", torch.uint8, (q6k_packed_numel(s.out_features, s.in_features),)))
        elif kind == "bf16":
            codes.append((s.prefix + ".bf16", torch.bfloat16, (rows * s.in_features,)))
        elif kind == "int8":
            codes.append((s.prefix + ".int8", torch.int8, (rows * s.in_features,)))
            small.append((s.prefix + ".int8_scale", torch.float32, (rows,)))
        if kind != "dense" and s.bias:
            small.append((s.prefix + ".bias", torch.float32, (s.out_features,)))
    return codes + small


def _packed_tensors(
    source: WeightSource, config: ModelConfig, kinds: Mapping[str, str], progress: ProgressFn | None
) -> Iterator[tuple[str, Tensor]]:
    """The tensors of :func:`_layout`, in its order, made one projection at a time (the small ones
    held back until every projection's codes are out)."""
    from verispec.kernels import Bf16Linear, Int8Linear, Q4KLinear, Q6KLinear

    specs = [s for s in linear_specs(config) if kinds[s.prefix] != "dense"]
    small: list[tuple[str, Tensor]] = []
    for done, s in enumerate(specs, start=1):
        bias = source.float32(s.prefix + ".bias") if s.bias else None
        if kinds[s.prefix] == "q4k" and source.stored_type(s.source) == "Q4_K":
            module: torch.nn.Module = Q4KLinear.from_blocks(
                source.blocks(s.source), s.out_features, s.in_features, bias
            )
        elif kinds[s.prefix] == "q4k":  # "int4-all": requantised
            module = Q4KLinear.from_weight(source.float32(s.source), bias)
        elif kinds[s.prefix] == "bf16":  # (a state dict's bf16 values as they are: no fp32 copy)
            weight = source.state[s.source] if source.state is not None else source.float32(s.source)
            module = Bf16Linear.from_weight(weight, bias)
        elif kinds[s.prefix] == "q6k":
            module = Q6KLinear.from_blocks(source.blocks(s.source), s.out_features, s.in_features, bias)
        else:
            module = Int8Linear.from_weight(source.float32(s.source), bias)
        for name, tensor in module.state_dict().items():
            if name in SMALL_BUFFERS:
                small.append((f"{s.prefix}.{name}", tensor))
            else:
                yield f"{s.prefix}.{name}", tensor
        if progress is not None:
            progress("pack", done, len(specs))
    yield from small


def pack(
    source: WeightSource, config: ModelConfig, precision: str, progress: ProgressFn | None = None
) -> dict[str, Tensor]:
    """The packed projections of a model (in memory), by state-dict name."""
    kinds = plan(source, config, precision)
    return dict(_packed_tensors(source, config, kinds, progress))


def cache_path(folder: Path, precision: str) -> Path:
    """The packed cache file of ``precision`` ("bf16": the bf16 kernel's layout, beside the
    prepared model's own ``bf16.safetensors``)."""
    return folder / ("bf16-packed.safetensors" if precision == "bf16" else f"{precision}.safetensors")


def load_or_pack(
    folder: Path, gguf_path: Path, source_sha256: str, config: ModelConfig, precision: str,
    progress: ProgressFn | None = None, source: WeightSource | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """The packed projections of the prepared model in ``folder``, from its cache file, which is
    (re)built from ``gguf_path`` (or ``source``: "bf16" packs the prepared bf16 weights) first when
    missing or stale (see the module docstring)."""
    from verispec.formats.convert import load_safetensors, read_metadata, write_tensors
    from verispec.formats.requantize import REQUANTIZE_FORMAT

    path = cache_path(folder, precision)
    wanted: dict[str, str | None] = {"packing": PACK_FORMAT, "precision": precision, "source_sha256": source_sha256}
    if precision == "int4-all":  # its requantised blocks change with the fit
        wanted["requantize"] = REQUANTIZE_FORMAT
    wanted["q6k"] = "native" if native_q6k() and precision not in ("int8", "bf16") else None  # (None: no entry)

    def fresh() -> bool:
        meta = read_metadata(path)
        return meta is not None and all(meta.get(k) == v for k, v in wanted.items())

    if not fresh():
        with locked(folder.parent / f".{folder.name}.{precision}.lock"):
            if not fresh():  # another process may have built it while we waited
                start = time.perf_counter()
                logger.warning("packing %s weights of %s once into %s", precision, folder.name, path.name)
                from verispec.formats.registry import check_space

                weights = source or WeightSource(gguf=GGUFModel(gguf_path))
                kinds = plan(weights, config, precision)
                layout = _layout(config, kinds)
                size = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in layout)
                check_space(folder, size, f"the {precision} weights of {folder.name} packed for the kernels")
                tensors = _packed_tensors(weights, config, kinds, progress)
                metadata = {k: v for k, v in wanted.items() if v is not None}
                write_tensors(path, layout, tensors, metadata=metadata)
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
