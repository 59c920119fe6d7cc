"""GGML block quantisation formats, dequantised to floating point in torch.

A GGML tensor row of ``n`` values is stored as ``n / block_size`` blocks of ``type_size`` bytes,
each block self-contained (its own scales), so dequantisation is a pure function of one block and
vectorises over all blocks at once. Layouts follow ggml's ``ggml-common.h`` (``block_q4_K`` etc.);
all multi-byte fields are little-endian.

=====  =====  =====  ======================================================================
type   block  bytes  layout (x = dequantised value)
=====  =====  =====  ======================================================================
Q4_0   32     18     f16 d, 16 B nibbles (low nibbles = values 0..15, high = 16..31); x = d*(q-8)
Q4_1   32     20     f16 d, f16 m, 16 B nibbles; x = d*q + m
Q5_0   32     22     f16 d, u32 high bits, 16 B nibbles; q = nibble | bit<<4; x = d*(q-16)
Q5_1   32     24     f16 d, f16 m, u32 high bits, 16 B nibbles; x = d*q + m
Q8_0   32     34     f16 d, 32 x int8 q; x = d*q
Q8_K   256    292    f32 d, 256 x int8 q, 16 x int16 sums (unused here); x = d*q
Q4_K   256    144    f16 d, f16 dmin, 12 B of 8 packed 6-bit (scale, min) pairs, 128 B nibbles;
                     8 sub-blocks of 32; x = (d*scale)*q - (dmin*min)
Q5_K   256    176    like Q4_K plus 32 B of 5th bits (bit j of byte i belongs to sub-block j)
Q6_K   256    210    128 B low nibbles, 64 B 2-bit highs, 16 x int8 scales, f16 d;
                     16 sub-blocks of 16; x = (d*scale)*(q-32)
=====  =====  =====  ======================================================================

Every kernel computes in float32 with the same operations, in the same order, as the numpy
reference in the ``gguf`` package (``gguf.quants.dequantize``), so results are bit-identical to it
(the tests check this on real and synthetic blocks); the cast to bfloat16 / float16, if asked for,
happens last, once (round to nearest even).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InputError, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """Size facts of one GGML storage type: ``block_size`` values take ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int


# Float types are "blocks" of one value.
FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("F32", 1, 4),
        BlockFormat("F16", 1, 2),
        BlockFormat("BF16", 1, 2),
        BlockFormat("Q4_0", 32, 18),
        BlockFormat("Q4_1", 32, 20),
        BlockFormat("Q5_0", 32, 22),
        BlockFormat("Q5_1", 32, 24),
        BlockFormat("Q8_0", 32, 34),
        BlockFormat("Q8_K", 256, 292),
        BlockFormat("Q4_K", 256, 144),
        BlockFormat("Q5_K", 256, 176),
        BlockFormat("Q6_K", 256, 210),
    )
}

#: Storage types this module dequantises, in the order the docs list them.
SUPPORTED_TYPES: tuple[str, ...] = tuple(FORMATS)


def _packed(field: Tensor) -> Tensor:
    """A fresh C-contiguous copy at storage offset 0, so it can be reinterpreted as a wider dtype.
    (``.contiguous()`` is not enough: it returns a one-row slice as is, with its old row stride.)"""
    return field.clone(memory_format=torch.contiguous_format)


def _f16(blocks: Tensor, start: int) -> Tensor:
    """A little-endian float16 field at byte ``start`` of each block: [N, type_size] uint8 -> [N, 1] fp32."""
    return _packed(blocks[:, start : start + 2]).view(torch.float16).float()


# Bit twiddling runs on int32 words of 4 packed bytes: torch's uint8 shifts are not vectorised
# (~40x slower than int32 ones on AVX-512 CPUs), and a byte-wise mask like 0x0F0F0F0F keeps the
# four lanes independent. Little-endian: byte k of a word is bits 8k..8k+7.
_LOW_NIBBLES = 0x0F0F0F0F


def _words(byte_field: Tensor) -> Tensor:
    """[N, 4k] uint8 -> [N, k] int32 (a contiguous copy of the field, reinterpreted)."""
    return _packed(byte_field).view(torch.int32)


def _as_bytes(words: Tensor) -> Tensor:
    """[..., k] int32 -> [..., 4k] uint8, the inverse of :func:`_words`."""
    return _packed(words).view(torch.uint8)


def _split_nibbles(qs: Tensor, groups: int) -> Tensor:
    """[N, groups*w] uint8 -> [N, groups*2, w] uint8: per group of w bytes, its low nibbles, then its
    high nibbles (the layout of every GGML 4-bit type)."""
    n = qs.shape[0]
    words = _words(qs).reshape(n, groups, 1, -1)  # [N, groups, 1, w/4]
    shifts = torch.tensor((0, 4), dtype=torch.int32, device=qs.device).reshape(1, 1, 2, 1)
    return _as_bytes((words >> shifts) & _LOW_NIBBLES).reshape(n, groups * 2, -1)


def _bits32(qh: Tensor) -> Tensor:
    """Q5_0 / Q5_1 fifth bits, already shifted: [N, 4] uint8 (a little-endian u32, bit j for value j)
    -> [N, 32] uint8 with value j = 16 * bit j."""
    word = _words(qh)  # [N, 1] int32
    shifts = torch.arange(32, dtype=torch.int32, device=qh.device)
    return (((word >> shifts) & 1) << 4).to(torch.uint8)


def _q4_0(b: Tensor) -> Tensor:
    q = _split_nibbles(b[:, 2:18], 1).reshape(b.shape[0], 32).view(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: Tensor) -> Tensor:
    q = _split_nibbles(b[:, 4:20], 1).reshape(b.shape[0], 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _q5_0(b: Tensor) -> Tensor:
    low = _split_nibbles(b[:, 6:22], 1).reshape(b.shape[0], 32)
    q = (low | _bits32(b[:, 2:6])).view(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: Tensor) -> Tensor:
    low = _split_nibbles(b[:, 8:24], 1).reshape(b.shape[0], 32)
    return _f16(b, 0) * (low | _bits32(b[:, 4:8])).float() + _f16(b, 2)


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:34].view(torch.int8).float() * _f16(b, 0)


def _q8_k(b: Tensor) -> Tensor:
    d = _packed(b[:, 0:4]).view(torch.float32)  # [N, 1]
    return d * b[:, 4:260].view(torch.int8).float()


def _k_scale_min(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, each [N, 8] fp32.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
    mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    words = _words(packed)  # [N, 3] int32: scale bytes, min bytes, shared bytes
    sc_lo, mn_lo, hi = words[:, 0:1], words[:, 1:2], words[:, 2:3]
    six = 0x3F3F3F3F
    top = 0x30303030
    scale = torch.cat((sc_lo & six, (hi & _LOW_NIBBLES) | ((sc_lo >> 2) & top)), dim=1)
    minimum = torch.cat((mn_lo & six, ((hi >> 4) & _LOW_NIBBLES) | ((mn_lo >> 2) & top)), dim=1)
    return _as_bytes(scale).float(), _as_bytes(minimum).float()


def _k_quant(b: Tensor, q: Tensor) -> Tensor:
    """Shared tail of Q4_K / Q5_K: q [N, 8, 32] fp32 -> x [N, 256]."""
    n = b.shape[0]
    scale, minimum = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * scale).reshape(n, 8, 1)
    dm = (_f16(b, 2) * minimum).reshape(n, 8, 1)
    return (d * q - dm).reshape(n, 256)


def _q4_k(b: Tensor) -> Tensor:
    return _k_quant(b, _split_nibbles(b[:, 16:144], 4).float())


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    low = _split_nibbles(b[:, 48:176], 4)  # [N, 8, 32]
    shifts = torch.arange(8, dtype=torch.int32, device=b.device).reshape(1, 8, 1)
    high = _as_bytes(((_words(b[:, 16:48]).reshape(n, 1, 8) >> shifts) & 0x01010101) << 4)  # [N, 8, 32]
    return _k_quant(b, (low | high).float())


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    low = _split_nibbles(b[:, 0:128], 2).reshape(n, 8, 32)
    shifts = torch.tensor((0, 2, 4, 6), dtype=torch.int32, device=b.device).reshape(1, 1, 4, 1)
    words = _words(b[:, 128:192]).reshape(n, 2, 1, 8)
    high = _as_bytes(((words >> shifts) & 0x03030303) << 4).reshape(n, 8, 32)
    q = ((low | high).view(torch.int8) - 32).reshape(n, 16, 16).float()
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    return (d * q).reshape(n, 256)


def _f32(b: Tensor) -> Tensor:
    return _packed(b).view(torch.float32)


def _f16_values(b: Tensor) -> Tensor:
    return _packed(b).view(torch.float16).float()


def _bf16(b: Tensor) -> Tensor:
    return _packed(b).view(torch.bfloat16).float()


_KERNELS: dict[str, Callable[[Tensor], Tensor]] = {
    "F32": _f32,
    "F16": _f16_values,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q8_K": _q8_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def block_format(type_name: str) -> BlockFormat:
    """The :class:`BlockFormat` of a supported type; :class:`UnsupportedModelError` for any other."""
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise UnsupportedModelError(
            f"GGML tensor type {type_name} is not supported; supported types: "
            f"{', '.join(SUPPORTED_TYPES)}. Use a GGUF quantised with one of these "
            f"(e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0, F16)."
        )
    return fmt


def dequantize_blocks(blocks: Tensor, type_name: str) -> Tensor:
    """Dequantise whole blocks: [N, type_size] uint8 -> [N, block_size] fp32."""
    fmt = block_format(type_name)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != fmt.type_size:
        raise InputError(
            f"{type_name} blocks must be a [N, {fmt.type_size}] uint8 tensor, got {tuple(blocks.shape)} {blocks.dtype}"
        )
    return _KERNELS[type_name](blocks)


def dequantize(
    data: np.ndarray,
    type_name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    chunk_values: int = 1 << 20,
) -> Tensor:
    """Dequantise a stored tensor to a new torch tensor of ``shape`` and ``dtype``.

    ``data`` holds the tensor's bytes (any shape, C order, e.g. a read-only memory map: it is only
    read). Work proceeds in chunks of about ``chunk_values`` values, so the float32 temporaries stay
    cache-sized and the peak memory is the output plus a few MiB.
    """
    fmt = block_format(type_name)
    numel = 1
    for dim in shape:
        numel *= dim
    if numel % fmt.block_size != 0:
        raise InputError(f"{numel} values are not a whole number of {type_name} blocks of {fmt.block_size}")
    n_blocks = numel // fmt.block_size
    flat = data.reshape(-1).view(np.uint8)
    if flat.size != n_blocks * fmt.type_size:
        raise InputError(f"{type_name} tensor of shape {shape} needs {n_blocks * fmt.type_size} bytes, got {flat.size}")
    raw = flat.reshape(n_blocks, fmt.type_size)  # [n_blocks, type_size] uint8
    out = torch.empty(n_blocks, fmt.block_size, dtype=dtype)  # [n_blocks, block_size]
    kernel = _KERNELS[type_name]
    step = max(1, chunk_values // fmt.block_size)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        # Copy the chunk's bytes out of the (read-only) map: torch wants writable memory, and the
        # copy is 2-8x smaller than the values it becomes.
        blocks = torch.from_numpy(np.array(raw[start:stop], copy=True))
        out[start:stop] = kernel(blocks)
    return out.reshape(shape)
