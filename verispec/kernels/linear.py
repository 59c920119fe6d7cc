"""Linear layers whose weights stay quantised in memory, run by the AMX kernels of this package.

- :class:`Q4KLinear`: GGUF Q4_K weights used EXACTLY: the packed tensor is a byte permutation of
  the file's blocks (same size, 4.5 bits per weight) and the kernel applies the fp32 scales and
  mins, so ``forward`` computes ``x_bf16 @ dequantise(Q4_K).T`` with fp32 sums. No second
  quantisation.
- :class:`Int8Linear`: symmetric per-output-channel int8, ``w = scale[n] * q[n, k]``, made from
  floating-point weights by :meth:`Int8Linear.from_weight` (one rounding of those weights).

Both take activations ``[..., K]`` in bf16 or fp32 (rounded to bf16 for the multiply), accumulate
in fp32, add the fp32 bias and return ``[..., N]`` in the activations' dtype. Their cost is flat
from 1 to 16 rows per call (the weights are unpacked once per call, see ``csrc/q4k.cpp``) and any
number of rows works (16 at a time against the same unpacked weights). Row ``i`` of an ``M``-row
call equals the one-row call on row ``i`` bit for bit (batch invariance), so a verification pass
computes the same logits rows as the decode steps it stands for.

Weights live in buffers (``q4k``; ``int8`` and ``int8_scale``; ``bias``): a module's
``state_dict()`` is what the runtime caches, and ``Q4KLinear(**tensors)`` rebuilds it.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from verispec.kernels.build import load

ROWS = 16  # weight rows per packed block: packed tensors cover N rounded up to a multiple of 16
Q4K_SUPER = 256  # inputs per Q4_K super-block
Q4K_BLOCK_BYTES = 144  # bytes of one GGUF Q4_K block
Q4K_RECORD_BYTES = 2304  # bytes of one packed record (16 rows x one super-block)
INT8_ALIGN = 32  # int8 rows need a multiple of this many inputs


def _row_blocks(n: int) -> int:
    return -(-n // ROWS)


def q4k_packed_numel(out_features: int, in_features: int) -> int:
    """Bytes of the packed form of a ``[out_features, in_features]`` Q4_K matrix."""
    return _row_blocks(out_features) * (in_features // Q4K_SUPER) * Q4K_RECORD_BYTES


def _flat(x: Tensor) -> Tensor:  # [..., K] -> [M, K]
    return x.reshape(-1, x.shape[-1])


def _check_bias(bias: Tensor | None, n: int) -> Tensor | None:
    if bias is None:
        return None
    if tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    return bias.to(torch.float32).contiguous()


class Q4KLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` ``[N, K]`` the exact weights of GGUF Q4_K blocks.

    ``q4k``: the packed records (uint8, :func:`q4k_packed_numel` bytes), as :meth:`from_blocks`
    makes them. ``K`` must be a multiple of 256 (the format's super-block); ``N`` is any size.
    """

    kind: ClassVar[str] = "q4k"
    q4k: Tensor
    bias: Tensor | None

    def __init__(self, q4k: Tensor, out_features: int, in_features: int, bias: Tensor | None = None) -> None:
        super().__init__()
        if in_features % Q4K_SUPER:
            raise ValueError(f"Q4_K needs in_features % 256 == 0, got {in_features}")
        expected = q4k_packed_numel(out_features, in_features)
        if q4k.dtype != torch.uint8 or q4k.numel() != expected:
            raise ValueError(f"packed Q4_K must be {expected} uint8 bytes, got {q4k.numel()} {q4k.dtype}")
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("q4k", q4k.reshape(-1))
        self.register_buffer("bias", _check_bias(bias, out_features))

    @classmethod
    def from_blocks(cls, blocks: Tensor | np.ndarray, out_features: int, in_features: int,
                    bias: Tensor | None = None) -> Q4KLinear:  # fmt: skip
        """From the GGUF blocks ``[N, K/256 * 144]`` uint8 (rows in the runtime's order)."""
        # (a copy: GGUF blocks are often a read-only memory map, which torch will not wrap)
        raw = torch.from_numpy(np.array(blocks, dtype=np.uint8)) if isinstance(blocks, np.ndarray) else blocks
        packed = load().q4k_pack(raw.contiguous().reshape(out_features, -1), out_features, in_features)
        return cls(packed, out_features, in_features, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16/fp32 -> [..., N] same dtype
        y: Tensor = load().q4k_linear(_flat(x), self.q4k, self.out_features, self.in_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by, exactly
        w: Tensor = load().q4k_dequantize(self.q4k, self.out_features, self.in_features)
        return w

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (the packed weights and the bias)."""
        return self.q4k.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q4_K exact"


class Int8Linear(nn.Module):
    """``y = (x @ q.T) * scale + bias`` with int8 codes ``q`` ``[N, K]`` and fp32 ``scale`` ``[N]``.

    ``int8``: the packed codes (:meth:`from_weight` or :meth:`from_codes`), ``int8_scale``: the
    scales padded with zeros to a multiple of 16 rows. ``K`` must be a multiple of 32.
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
        """From int8 codes ``[N, K]`` and fp32 scales ``[N]``: ``w[n, k] = scale[n] * codes[n, k]``."""
        n, k = codes.shape
        if k % INT8_ALIGN:
            raise ValueError(f"int8 needs in_features % {INT8_ALIGN} == 0, got {k}")
        padded = torch.zeros(_row_blocks(n) * ROWS, dtype=torch.float32)
        padded[:n] = scale.to(torch.float32)
        return cls(load().int8_pack(codes.contiguous()), padded, n, k, bias)

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None) -> Int8Linear:
        """Quantise ``weight`` ``[N, K]`` per output row: ``scale = max|w_row| / 127``,
        ``q = round(w / scale)`` (round half to even) in -127..127; all-zero rows get scale 0."""
        codes, scale = quantize_int8(weight)
        return cls.from_codes(codes, scale, bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., K] bf16/fp32 -> [..., N] same dtype
        n, k = self.out_features, self.in_features
        y: Tensor = load().int8_linear(_flat(x), self.int8, self.int8_scale, n, k, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def codes(self) -> Tensor:  # [N, K] int8, unpacked
        rows, k = _row_blocks(self.out_features) * ROWS, self.in_features
        # packed index ((nb * K/32 + t) * 16 + p) * 32 + b holds q[16 nb + b // 2, 32 t + 2 p + b % 2]
        packed = self.int8.view(rows // ROWS, k // 32, 16, ROWS, 2)  # [nb, t, p, r, 2]
        return packed.permute(0, 3, 1, 2, 4).reshape(rows, k)[: self.out_features]

    def dequantize(self) -> Tensor:  # [N, K] fp32: the weights forward() multiplies by
        return self.codes().to(torch.float32) * self.int8_scale[: self.out_features, None]

    def weight_bytes(self) -> int:
        """Bytes one forward pass streams (codes, scales, bias)."""
        return self.int8.numel() + self.int8_scale.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` ``[N, K]`` -> (codes ``[N, K]`` int8 in -127..127, scales ``[N]`` fp32), per row."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=1) / 127.0  # [N]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale
