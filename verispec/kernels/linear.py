"""Linear layers whose weights stay quantised in memory, run by the integer kernels of this package.

- :class:`Q4KLinear`: GGUF Q4_K weights used EXACTLY: the packed tensor is a byte permutation of
  the file's blocks (same size, 4.5 bits per weight); the kernel multiplies the 4-bit codes and
  applies the fp32 sub-block scales and mins, so no weight is ever re-quantised or rounded.
- :class:`Int8Linear`: symmetric per-output-channel int8, ``w = scale[n] * q[n, k]``, made from
  floating-point weights by :meth:`Int8Linear.from_weight` (one rounding of those weights).

Both quantise their input activations to int8 (W8A8, like llama.cpp's Q8 activations): each row
of ``x`` (bf16 or fp32) in blocks of 64 inputs, ``scale = max|x_block| / 127``, codes
``round_half_even(x * (127 / max|x_block|))``. The products of codes are summed exactly in int32
(VPDPBUSD, VPMADDUBSW or plain C++ by tier; AMX TDPBSUD for many rows), block by block, and the scales are
applied in fp32: ``y = x_q @ W.T + bias`` with ``x_q`` the dequantised activations, returned in
``x``'s dtype. The activations' 8-bit rounding is the one approximation beyond the weights' own
format: at most half a step (``max|x_block| / 254``) per input, uniform and unbiased. Blocks of 64
rather than one scale per row keep outlier channels from spending the 8 bits of a whole row
(Qwen2.5-Coder 0.5B / 1.5B in int8, mean KL of the next-token distribution to bf16's over 420
positions: 0.0023 / 0.0024, against 0.016 / 0.033 with a scale per row and 0.0015 / 0.0013 with
bf16 activations; top-1 agreement 96.4% / 98.6%, against 97.4% / 98.6% with bf16 activations).

Their cost is nearly flat from 1 to 16 rows per call (memory-bound: each weight is read once per
call, and integer products are cheap), and any number of rows works (16 at a time against the
same weights). The integer sums are exact and the fp32 steps are the same code for every row, so
row ``i`` of an ``M``-row call equals the one-row call on row ``i`` bit for bit (batch
invariance), whichever instructions run: a verification pass computes the same logits rows as the
decode steps it stands for.

Weights live in buffers (``q4k``; ``int8`` and ``int8_scale``; ``bias``): a module's
``state_dict()`` is what the runtime caches, and ``Q4KLinear(**tensors)`` rebuilds it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from verispec.kernels.build import load

ROWS = 16  # weight rows per packed block: packed tensors cover N rounded up to a multiple of 16
Q4K_SUPER = 256  # inputs per Q4_K super-block
Q4K_BLOCK_BYTES = 144  # bytes of one GGUF Q4_K block
Q4K_RECORD_BYTES = 2304  # bytes of one packed record (16 rows x one super-block)
Q4K_HALF = 128  # packed Q4_K rows are whole 128s of inputs: a last half super-block has a half record
Q4K_HALF_RECORD_BYTES = 1280  # its bytes (the header and two of the four 64-input quarters)
INT8_ALIGN = 32  # int8 rows need a multiple of this many inputs
BF16_ALIGN = 32  # bf16 kernel rows need a multiple of this many inputs (one AMX step; every tier keeps it)


def _row_blocks(n: int) -> int:
    return -(-n // ROWS)


def q4k_packed_in_features(in_features: int) -> int:
    """The inputs a packed Q4_K matrix of ``in_features`` holds: padded with zero weights to a
    multiple of 128 (a whole super-block of 256, or one and a half record: a ``[N, 896]`` matrix is
    stored as 896 inputs, not the 1024 its requantised blocks cover)."""
    return -(-in_features // Q4K_HALF) * Q4K_HALF


def q4k_packed_numel(out_features: int, in_features: int) -> int:
    """Bytes of the packed form of a ``[out_features, in_features]`` Q4_K matrix: per 16-row block,
    a record per whole super-block and a half record for a last 128 inputs
    (:func:`q4k_packed_in_features`)."""
    k = q4k_packed_in_features(in_features)
    per_block = (k // Q4K_SUPER) * Q4K_RECORD_BYTES + (Q4K_HALF_RECORD_BYTES if k % Q4K_SUPER else 0)
    return _row_blocks(out_features) * per_block


def _check_packed(packed: Tensor, expected: int, kind: str) -> None:
    if packed.dtype != torch.uint8 or packed.numel() != expected:
        raise ValueError(f"packed {kind} must be {expected} uint8 bytes, got {packed.numel()} {packed.dtype}")


def _gguf_rows(blocks: Tensor | np.ndarray, out_features: int, in_features: int, kind: str) -> Tensor:
    """GGUF super-block rows ``[N, K/256 * bytes]`` as a contiguous uint8 tensor (a copy of a
    numpy array: GGUF blocks are often a read-only memory map, which torch will not wrap)."""
    if in_features % Q4K_SUPER:
        raise ValueError(f"GGUF {kind} blocks cover a multiple of 256 inputs, got {in_features}")
    raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)) if isinstance(blocks, np.ndarray) else blocks
    return raw.contiguous().reshape(out_features, -1)


def _flat(x: Tensor) -> Tensor:  # [..., K] -> [M, K]
    return x.reshape(-1, x.shape[-1])


def _check_bias(bias: Tensor | None, n: int) -> Tensor | None:
    if bias is None:
        return None
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return bias.to(torch.float32).contiguous()


class Q4KLinear(nn.Module):
    """``y = x_q @ W.T + bias`` with ``W`` ``[N, K]`` the exact weights of GGUF Q4_K blocks and
    ``x_q`` the activations quantised to int8 per block of 64 inputs (see the module docstring).

    Numerics (``csrc/vec/linear.cpp``, ``csrc/amx/q4k.cpp``; the same bits on every tier): per
    block of 64 inputs (sub-blocks ``j0``, ``j1`` of 32), the
    integer sums ``S_j = p . q_j`` (activation codes times 4-bit weight codes) and ``P_j = sum p``
    are exact; then in fp32, with fused multiply-adds in a fixed order,
    ``t += (S_j0 * ds_j0 + S_j1 * ds_j1) * scale_x - P_j0 * scale_x * dm_j0 - P_j1 * scale_x * dm_j1``
    block by block, and ``y = t + bias``, where ``ds = d * scale`` and ``dm = dmin * min`` are the
    format's exact fp32 factors (``w = ds * q - dm``). :meth:`dequantize` returns the weights bit
    for bit as ggml does.

    ``q4k``: the packed records (uint8, :func:`q4k_packed_numel` bytes), as :meth:`from_blocks`
    (a GGUF's blocks, ``K`` a multiple of 256) or :meth:`from_weight` (float weights requantised)
    makes them. ``K`` must be a multiple of 32; when it is not one of 128 the weights are padded
    with zeros to ``packed_in_features``, the next multiple, and so are the activations in
    :meth:`forward` (adding nothing); a last 128 inputs are half a super-block, whose zero half is
    not stored (:func:`q4k_packed_in_features`). ``N`` is any size.
    """

    kind: ClassVar[str] = "q4k"
    q4k: Tensor
    bias: Tensor | None

    def __init__(self, q4k: Tensor, out_features: int, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        if in_features % INT8_ALIGN:
            raise ValueError(f"Q4_K needs in_features % {INT8_ALIGN} == 0, got {in_features}")
        expected = q4k_packed_numel(out_features, in_features)
        _check_packed(q4k, expected, "Q4_K")
        self.out_features, self.in_features = out_features, in_features
        self.packed_in_features = q4k_packed_in_features(in_features)
        self.register_buffer("q4k", q4k.reshape(-1))
        self.register_buffer("bias", _check_bias(bias, out_features))

    @classmethod
    def from_blocks(cls, blocks: Tensor | np.ndarray, out_features: int, in_features: int,
                    bias: Tensor | None = None) -> Q4KLinear:  # fmt: skip
        """From the GGUF blocks ``[N, K/256 * 144]`` uint8 (rows in the runtime's order)."""
        rows = _gguf_rows(blocks, out_features, in_features, "Q4_K")
        packed = load().q4k_pack(rows, out_features, in_features)
        return cls(packed, out_features, in_features, bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Q4KLinear:
        """From float weights ``[N, K]``, requantised to Q4_K (:mod:`verispec.formats.requantize`:
        a second rounding, for drafts), fitted on ``K`` padded to a multiple of 256 and stored
        padded to one of 128 (:func:`q4k_packed_in_features`)."""
        from verispec.formats.requantize import quantize_q4k

        n, k = weight.shape
        blocks = torch.from_numpy(quantize_q4k(weight.detach().to(torch.float32).cpu().numpy()))
        packed = load().q4k_pack(blocks, n, q4k_packed_in_features(k))
        return cls(packed, n, k, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16/fp32 -> [..., N] same dtype
        if x.shape[-1] != self.in_features:  # (the kernel pads x to packed_in_features itself, so it cannot tell)
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        if x.numel() == 0:  # no rows (e.g. a step where no sequence needs this head)
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y: Tensor = load().q4k_linear(_flat(x), self.q4k, self.out_features, self.packed_in_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by, exactly
        w: Tensor = load().q4k_dequantize(self.q4k, self.out_features, self.packed_in_features)
        return w if self.packed_in_features == self.in_features else w[:, : self.in_features].contiguous()

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (the packed weights and the bias)."""
        return self.q4k.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        padded = "" if self.packed_in_features == self.in_features else f" (padded to {self.packed_in_features})"
        return f"in_features={self.in_features}{padded}, out_features={self.out_features}, Q4_K exact, W8A8"


Q6K_BLOCK_BYTES = 210  # one GGUF block_q6_K (256 weights)
Q6K_RECORD_BYTES = 3392  # one packed Q6_K record: 16 rows x 256 inputs (csrc/common.h)


def q6k_packed_numel(out_features: int, in_features: int) -> int:
    """Bytes of packed Q6_K weights ``[N, K]`` (``K`` a multiple of 256), ``N`` padded to 16 rows."""
    return _row_blocks(out_features) * (in_features // Q4K_SUPER) * Q6K_RECORD_BYTES


class Q6KLinear(nn.Module):
    """``y = x_q @ W.T + bias`` with ``W`` ``[N, K]`` the exact weights of GGUF Q6_K blocks
    (``d * sc * (q - 32)``: 6-bit codes, an int8 scale per 16 inputs and an fp16 ``d`` per 256) and
    ``x_q`` the activations quantised to int8 per block of 64 inputs, as for the other kernels.

    Numerics (``csrc/common.h``, ``csrc/vec/linear.cpp``; the same bits on every tier, amx
    included, which runs the vector kernels): per block of 64 inputs, the integer
    ``I = sum_j sc_j * (p . q_j - 32 * sum p_j)`` over its four 16-input sub-blocks is exact; then in
    fp32 ``t = fma(I, scale_x * d, t)`` block by block (``d`` of the block's super-block, the product
    rounded once), and ``y = t + bias``.
    A Q6_K weight is 0.82 bytes (210 per 256) where the int8 requantisation of the same tensor is
    one byte and a second rounding. :meth:`dequantize` returns the weights exactly.

    ``q6k``: the packed records (uint8, :func:`q6k_packed_numel` bytes), as :meth:`from_blocks`
    makes them from a GGUF's blocks; ``K`` a multiple of 256, ``N`` any size.
    """

    kind: ClassVar[str] = "q6k"
    q6k: Tensor
    bias: Tensor | None

    def __init__(self, q6k: Tensor, out_features: int, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        if in_features % Q4K_SUPER or in_features <= 0:
            raise ValueError(f"Q6_K needs in_features a positive multiple of {Q4K_SUPER}, got {in_features}")
        expected = q6k_packed_numel(out_features, in_features)
        _check_packed(q6k, expected, "Q6_K")
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("q6k", q6k.reshape(-1))
        self.register_buffer("bias", _check_bias(bias, out_features))

    @classmethod
    def from_blocks(cls, blocks: Tensor | np.ndarray, out_features: int, in_features: int,
                    bias: Tensor | None = None) -> Q6KLinear:  # fmt: skip
        """From the GGUF blocks ``[N, K/256 * 210]`` uint8 (rows in the runtime's order)."""
        rows = _gguf_rows(blocks, out_features, in_features, "Q6_K")
        packed = load().q6k_pack(rows, out_features, in_features)
        return cls(packed, out_features, in_features, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16/fp32 -> [..., N] same dtype
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {tuple(x.shape)}")
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y: Tensor = load().q6k_linear(_flat(x), self.q6k, self.out_features, self.in_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by, exactly
        w: Tensor = load().q6k_dequantize(self.q6k, self.out_features, self.in_features)
        return w

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (the packed weights and the bias)."""
        return self.q6k.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q6_K exact, W8A8"


class Int8Linear(nn.Module):
    """``y = x_q @ (scale * q).T + bias``: int8 codes ``q`` ``[N, K]`` with fp32 ``scale`` ``[N]``,
    and ``x_q`` the activations quantised to int8 per block of 64 inputs (W8A8, see the module
    docstring).

    Numerics (``csrc/vec/linear.cpp``, ``csrc/amx/w8a8.cpp``; the same bits on every tier): per
    block ``b`` of 64 inputs of an activation row, with codes
    ``p`` and scale ``scale_x``, ``acc_b = p . q`` is exact in int32; then in fp32, unfused,
    ``t += float(acc_b) * scale_x`` block by block and ``y = (t * scale) + bias``. The weights are
    exactly ``scale * q`` (:meth:`dequantize`).

    ``int8``: the packed codes (:meth:`from_weight` or :meth:`from_codes`; ``q + 128`` stored as
    bytes in 16-row blocks, see :meth:`codes`), ``int8_scale``: the scales padded with zeros to a
    multiple of 16 rows. ``K`` must be a multiple of 32.
    """

    kind: ClassVar[str] = "int8"
    int8: Tensor
    int8_scale: Tensor
    bias: Tensor | None

    def __init__(self, int8: Tensor, int8_scale: Tensor, out_features: int, in_features: int,
                 bias: Tensor | None = None) -> None:  # fmt: skip
        super().__init__()
        if in_features % INT8_ALIGN:
            raise ValueError(f"int8 needs in_features % {INT8_ALIGN} == 0, got {in_features}")
        rows = _row_blocks(out_features) * ROWS
        if int8.dtype != torch.int8 or int8.numel() != rows * in_features:
            raise ValueError(f"packed int8 must be {rows * in_features} int8 codes, got {int8.numel()} {int8.dtype}")
        if int8_scale.numel() != rows:
            raise ValueError(f"int8 scales must be [{rows}] (padded to 16 rows), got {tuple(int8_scale.shape)}")
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("int8", int8.reshape(-1))
        self.register_buffer("int8_scale", int8_scale.to(torch.float32).reshape(-1).contiguous())
        self.register_buffer("bias", _check_bias(bias, out_features))

    @classmethod
    def from_codes(cls, codes: Tensor, scale: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """From int8 codes ``[N, K]`` (-128..127) and fp32 scales ``[N]``: ``w[n, k] = scale[n] * codes[n, k]``."""
        n, k = codes.shape
        if k % INT8_ALIGN:
            raise ValueError(f"int8 needs in_features % {INT8_ALIGN} == 0, got {k}")
        padded = torch.zeros(_row_blocks(n) * ROWS, dtype=torch.float32)
        padded[:n] = scale.to(torch.float32)
        return cls(load().w8a8_pack(codes.contiguous()), padded, n, k, bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Quantise ``weight`` ``[N, K]`` per output row: ``scale = max|w_row| / 127``,
        ``q = round(w / scale)`` (round half to even) in -127..127; all-zero rows get scale 0."""
        codes, scale = quantize_int8(weight)
        return cls.from_codes(codes, scale, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16/fp32 -> [..., N] same dtype
        n, k = self.out_features, self.in_features
        if x.numel() == 0:  # no rows (e.g. a step where no sequence needs this head)
            return x.new_zeros(*x.shape[:-1], n)
        y: Tensor = load().w8a8_linear(_flat(x), self.int8, self.int8_scale, n, k, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def codes(self, ids: Tensor | None = None) -> Tensor:  # [N, K] int8, unpacked (rows ids only: [H, K])
        rows, k = _row_blocks(self.out_features) * ROWS, self.in_features
        # packed index ((nb * K/4 + g) * 16 + r) * 4 + j holds q[16 nb + r, 4 g + j] + 128 as a byte
        packed = self.int8.view(rows // ROWS, k // 4, ROWS, 4)  # [nb, g, r, j]
        if ids is None:
            offset = packed.permute(0, 2, 1, 3).reshape(rows, k)[: self.out_features]
        else:  # (gathered from their row blocks: no pass over the other rows)
            offset = packed[ids // ROWS, :, ids % ROWS, :].reshape(ids.numel(), k)
        return torch.bitwise_xor(offset, -128)  # flipping the top bit subtracts 128 (mod 256)

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by
        return self.codes().to(torch.float32) * self.int8_scale[: self.out_features, None]

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (codes, scales, bias)."""
        return self.int8.numel() + self.int8_scale.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, W8A8"


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` ``[N, K]`` -> (codes ``[N, K]`` int8 in -127..127, scales ``[N]`` fp32), per row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / 127.0  # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


class Bf16Linear(nn.Module):
    """``y = x @ W.T + bias`` for bf16 weights ``W`` ``[N, K]`` and bf16 activations on verispec's
    kernels: the "bf16" precision's projections on the CPU.

    Numerics, by tier (:mod:`verispec.kernels.dispatch`, :attr:`Tier.bf16_order`): on amx, fp32
    sums in the order AMX's TDPBF16PS adds (per step of 32 inputs, the sequential fp32 sums of the
    even- and of the odd-indexed products, then ``C += even + odd``; denormals count as zero,
    ``csrc/amx/bf16.cpp``); on avx512bf16, one fp32 sum per output adding the products of input
    pairs 0-1, 2-3, ... with VDPBF16PS, the odd input's before the even one's, one rounding each,
    denormals as zero (``csrc/vec/dots.h``); on avx512, avx2, neon and portable one fp32 sum per
    output adding the products in input order with one rounding each (``csrc/vec/linear.cpp``, the
    same bits on the four). Then ``+ bias`` in fp32 and one rounding to bf16.
    :func:`reference_bf16_linear` is each arithmetic in plain torch.
    Like torch's own bf16 matmul the weights and activations are used as they are (no extra
    rounding); unlike it, the result of a row never depends on the other rows of the call (batch
    invariance, bit for bit), and the weights are read once per call at close to memory bandwidth
    (20.6 GB/s against torch's 16.6 GB/s for the 1.5B model's LM head on two Sapphire Rapids
    cores, amx tier, ``benchmarks/linear_kernels.py``).

    ``bf16``: the weights in 16-row blocks of input pairs (:meth:`from_weight`; :meth:`unpack`
    undoes it), ``bias``: fp32 or None. ``K`` must be a multiple of 32.
    """

    kind: ClassVar[str] = "bf16"
    bf16: Tensor
    bias: Tensor | None

    def __init__(self, bf16: Tensor, out_features: int, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        if in_features % BF16_ALIGN:
            raise ValueError(f"the bf16 kernel needs in_features % {BF16_ALIGN} == 0, got {in_features}")
        numel = _row_blocks(out_features) * ROWS * in_features
        if bf16.dtype != torch.bfloat16 or bf16.numel() != numel:
            raise ValueError(f"packed bf16 must be {numel} bf16 values, got {bf16.numel()} {bf16.dtype}")
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bf16", bf16.reshape(-1))
        self.register_buffer("bias", _check_bias(bias, out_features))

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Bf16Linear:
        """From ``weight`` ``[N, K]`` (rounded to bf16 if it is not bf16 already)."""
        n, k = weight.shape
        if k % BF16_ALIGN:
            raise ValueError(f"the bf16 kernel needs in_features % {BF16_ALIGN} == 0, got {k}")
        packed = load().bf16_pack(weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous())
        return cls(packed, n, k, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16 -> [..., N] bf16
        n, k = self.out_features, self.in_features
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], n)
        y: Tensor = load().bf16_linear(_flat(x).to(torch.bfloat16), self.bf16, n, k, self.bias)
        return y.view(*x.shape[:-1], n).to(x.dtype)

    def unpack(self, ids: Tensor | None = None) -> Tensor:  # [N, K] bf16 (rows ids only: [H, K])
        rows, k = _row_blocks(self.out_features) * ROWS, self.in_features
        # packed index ((nb * K/2 + g) * 16 + r) * 2 + j holds w[16 nb + r, 2 g + j]
        packed = self.bf16.view(rows // ROWS, k // 2, ROWS, 2)  # [nb, g, r, j]
        if ids is not None:  # (gathered from their row blocks: no pass over the other rows)
            return packed[ids // ROWS, :, ids % ROWS, :].reshape(ids.numel(), k)
        return packed.permute(0, 2, 1, 3).reshape(rows, k)[: self.out_features]

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by
        return self.unpack().to(torch.float32)

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (weights and bias)."""
        return self.bf16.numel() * 2 + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16"


def _flush_denormals(t: Tensor) -> Tensor:
    """``t`` (fp32) with its denormals replaced by zeros of their sign (DAZ / FTZ)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0, t)


def reference_bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, order: str | None = None) -> Tensor:
    """:class:`Bf16Linear`'s arithmetic in plain torch, for tests: ``x`` ``[M, K]`` and ``weight``
    ``[N, K]`` bf16 -> ``[M, N]`` fp32 (before the final rounding to bf16). ``order`` is "amx"
    (TDPBF16PS's), "pairs" (VDPBF16PS's) or "chain" (the other tiers'); by default the selected
    tier's. Slow (one pass over ``[M, N]`` per input)."""
    if order is None:
        from verispec.kernels.dispatch import selected

        order = selected().bf16_order
    if order not in ("chain", "pairs", "amx"):
        raise ValueError(f"order must be 'chain', 'pairs' or 'amx', got {order!r}")
    xf, wf = x.to(torch.float32), weight.to(torch.float32)
    acc = torch.zeros(x.shape[0], weight.shape[0])
    if order == "chain":  # a bf16 x bf16 product is exact in fp32: acc + p is the FMA's one rounding
        for k in range(x.shape[1]):
            acc = acc + xf[:, k, None] * wf[None, :, k]
    elif order == "pairs":
        # In fp64 a product of two bf16 is exact (even one below fp32's normal range, which the FMA
        # keeps too) and acc + p rounded to fp32 is the FMA's one rounding (53 >= 2 x 24 + 2 bits).
        xd, wd = _flush_denormals(xf).double(), _flush_denormals(wf).double()
        for k in range(0, x.shape[1], 2):
            for j in (k + 1, k):
                acc = _flush_denormals((acc.double() + xd[:, j, None] * wd[None, :, j]).float())
    else:
        for s in range(0, x.shape[1], BF16_ALIGN):
            even = torch.zeros_like(acc)
            odd = torch.zeros_like(acc)
            for k in range(s, s + BF16_ALIGN, 2):
                even = even + xf[:, k, None] * wf[None, :, k]
                odd = odd + xf[:, k + 1, None] * wf[None, :, k + 1]
            acc = acc + (even + odd)
    return acc if bias is None else acc + bias.to(torch.float32)


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One projection computing ``parts`` side by side (``y = cat([p(x) for p in parts], -1)``, bit
    for bit), or None when they cannot be fused: they must be of one packed kind (bf16, int8, Q4_K
    or Q6_K) with the same input size, and all but the last must have a multiple of 16 outputs (a
    packed tensor is whole 16-row blocks, so the blocks of the parts are simply concatenated).
    Used for q/k/v and gate/up: one weight stream and one call instead of three or two."""
    kind = type(parts[0])
    if kind not in (Bf16Linear, Int8Linear, Q4KLinear, Q6KLinear) or any(type(p) is not kind for p in parts):
        return None
    shapes = [(int(p.out_features), int(p.in_features)) for p in parts]  # type: ignore[arg-type]
    if len({k for _, k in shapes}) != 1 or any(n % ROWS for n, _ in shapes[:-1]):
        return None
    n, k = sum(n for n, _ in shapes), shapes[0][1]
    biases: list[Tensor | None] = [getattr(p, "bias", None) for p in parts]
    bias: Tensor | None = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [b if b is not None else torch.zeros(size) for b, (size, _) in zip(biases, shapes, strict=True)]
        )
    if kind is Bf16Linear:
        return Bf16Linear(cat_adjacent([_buffer(p, "bf16") for p in parts]), n, k, bias)
    if kind is Int8Linear:
        codes, scales = (cat_adjacent([_buffer(p, name) for p in parts]) for name in ("int8", "int8_scale"))
        return Int8Linear(codes, scales, n, k, bias)
    if kind is Q6KLinear:
        return Q6KLinear(cat_adjacent([_buffer(p, "q6k") for p in parts]), n, k, bias)
    return Q4KLinear(cat_adjacent([_buffer(p, "q4k") for p in parts]), n, k, bias)


def cat_adjacent(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts)`` of contiguous 1-D tensors of one dtype: where they lie back to back in
    one storage (the codes of q / k / v or gate / up in a packed cache file's mapping,
    ``formats.packing._layout``), a view spanning them, no copy; else a copy."""
    first = parts[0]
    storage, end = first.untyped_storage(), first.storage_offset()
    for p in parts:
        same_storage = p.untyped_storage().data_ptr() == storage.data_ptr()
        if p.dtype != first.dtype or not p.is_contiguous() or not same_storage or p.storage_offset() != end:
            return torch.cat(parts)
        end += p.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def _buffer(module: nn.Module, name: str) -> Tensor:
    value = getattr(module, name)
    assert isinstance(value, Tensor)
    return value


def _q4k_block_offsets(k: int) -> Tensor:
    """``[16, S, 144]`` int64: where byte j of the GGUF block of row r (of a 16-row block), super-block
    s, lies in that row block's packed records (``csrc/vec/pack.cpp``'s ``q4k_pack`` read
    backwards), for ``k`` packed inputs; -1 for the codes a half record leaves out."""
    supers = -(-k // Q4K_SUPER)
    out = torch.full((ROWS, supers, Q4K_BLOCK_BYTES), -1, dtype=torch.int64)
    for r in range(ROWS):
        head = [2 * r, 2 * r + 1, 32 + 2 * r, 33 + 2 * r]  # d, dmin (fp16 each)
        head += [64 + 64 * word + 4 * r + b for word in range(3) for b in range(4)]  # 12 bytes of scales, mins
        for sb in range(supers):
            base = sb * Q4K_RECORD_BYTES
            quarters = 4 if (sb + 1) * Q4K_SUPER <= k else 2
            codes = [256 + 512 * i + 64 * g + 4 * r + b for i in range(quarters) for g in range(8) for b in range(4)]
            out[r, sb, : 16 + len(codes)] = torch.tensor([base + o for o in head + codes])
    return out


def q4k_blocks_of_rows(linear: Q4KLinear, ids: Tensor) -> Tensor:
    """The GGUF Q4_K blocks ``[H, S * 144]`` uint8 of ``linear``'s rows ``ids`` (``[H]`` int64) over
    its ``packed_in_features`` (S super-blocks; the codes a half record leaves out as zeros),
    exactly the bytes it was packed from."""
    k = linear.packed_in_features
    per_block = q4k_packed_numel(ROWS, k)
    offsets = _q4k_block_offsets(k)  # [16, S, 144]
    at = offsets[ids % ROWS] + (ids // ROWS * per_block)[:, None, None]  # [H, S, 144]
    source = torch.cat([linear.q4k, linear.q4k.new_zeros(1)])  # (index -1 of a left-out code: the zero at the end)
    at = torch.where(offsets[ids % ROWS] < 0, source.numel() - 1, at)
    return source[at].reshape(ids.numel(), -1)


def select_rows(linear: nn.Module, ids: Tensor) -> nn.Module | None:
    """A projection computing only the outputs ``ids`` (``[H]`` int64) of ``linear``, bit for bit
    those of the whole one (every kind's output row depends on its weights alone), or None for a
    module of another kind. Used for a draft LM head restricted to part of the vocabulary."""
    full_bias = getattr(linear, "bias", None)
    bias = None if full_bias is None else full_bias.index_select(0, ids)
    if isinstance(linear, Bf16Linear):
        return Bf16Linear.from_weight(linear.unpack(ids), bias)
    if isinstance(linear, Int8Linear):
        scale = linear.int8_scale[: linear.out_features].index_select(0, ids)
        return Int8Linear.from_codes(linear.codes(ids), scale, bias)
    if isinstance(linear, Q4KLinear):
        h = ids.numel()
        packed = load().q4k_pack(q4k_blocks_of_rows(linear, ids).contiguous(), h, linear.packed_in_features)
        return Q4KLinear(packed, h, linear.in_features, bias)
    if isinstance(linear, Q6KLinear):
        return Q6KLinear(q6k_records_of_rows(linear, ids), ids.numel(), linear.in_features, bias)
    return None


def native_projection(module: nn.Module) -> Any:
    """The kernels' ``Projection`` of a packed projection (what ``Layers`` runs, and the greedy
    drafting loop's heads: ``csrc/bindings.cpp``), or None for a module of another kind."""
    if isinstance(module, Bf16Linear):
        return load().Projection(0, module.bf16, None, module.bias, module.out_features, module.in_features)
    if isinstance(module, Int8Linear):
        return load().Projection(1, module.int8, module.int8_scale, module.bias, module.out_features,
                                 module.in_features)  # fmt: skip
    if isinstance(module, Q4KLinear):
        return load().Projection(2, module.q4k, None, module.bias, module.out_features, module.packed_in_features)
    if isinstance(module, Q6KLinear):
        return load().Projection(3, module.q6k, None, module.bias, module.out_features, module.in_features)
    return None


def _q6k_lane_bytes() -> tuple[Tensor, Tensor]:
    """Where row ``r`` (lane r of 16) of a packed Q6_K record keeps its 210 bytes: at ``base + r *
    stride`` (its d: 2 bytes at 2r; its 16 scales at 64 + 16j + r; its codes: 4 bytes at 4r of
    each of the 48 groups of 64 bytes; csrc/common.h)."""
    base = [0, 1] + [64 + 16 * j for j in range(16)]
    stride = [2, 2] + [1] * 16
    for group in range(48):
        start = 320 + 64 * group
        base += [start + c for c in range(4)]
        stride += [4] * 4
    return torch.tensor(base), torch.tensor(stride)


def q6k_records_of_rows(linear: Q6KLinear, ids: Tensor) -> Tensor:
    """Packed Q6_K records of rows ``ids`` of ``linear`` (in that order), byte for byte its own:
    each row's bytes move from its lane of its records to its new lane."""
    base, stride = _q6k_lane_bytes()  # [210]
    nsb, h = linear.in_features // Q4K_SUPER, ids.numel()
    old = linear.q6k.view(-1, nsb, Q6K_RECORD_BYTES)  # [blocks, super-blocks, bytes]
    lanes = base + (ids % ROWS)[:, None] * stride  # [H, 210]
    rows = old[(ids // ROWS)[:, None, None], torch.arange(nsb)[None, :, None], lanes[:, None, :]]  # [H, S, 210]
    new = torch.zeros(_row_blocks(h), nsb, Q6K_RECORD_BYTES, dtype=torch.uint8)
    at = torch.arange(h)
    new[
        (at // ROWS)[:, None, None],
        torch.arange(nsb)[None, :, None],
        (base + (at % ROWS)[:, None] * stride)[:, None, :],
    ] = rows
    return new.reshape(-1)
