"""Helpers for tests of the int4 / int8 kernels: skip where they cannot run, synthetic Q4_K blocks,
plain-torch references of the kernels' arithmetic."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch


def require_kernels(tier: str | None = None) -> Any:
    """The compiled kernel module of ``tier`` (default: the selected one, ``$VERISPEC_ISA`` or the
    fastest this CPU runs); skips the test (with the reason) on a machine that cannot execute that
    tier, or without a C++ compiler or ninja. A failing build on a capable machine fails the test.

    Call it before anything points ``$VERISPEC_HOME`` elsewhere (e.g. from a module-scoped
    fixture): the build is cached under the home of the first load, and one build per test
    session is enough."""
    from torch.utils.cpp_extension import is_ninja_available

    from verispec.errors import ConfigError
    from verispec.kernels import build, dispatch

    try:
        chosen = dispatch.by_name(tier) if tier else dispatch.selected()
    except ConfigError as exc:
        pytest.skip(str(exc))
    missing = dispatch.missing(chosen)
    if missing:
        elsewhere = " (tests/unit/test_kernel_neon.py tests them under qemu-user)" if chosen.name == "neon" else ""
        pytest.skip(f"the {chosen.name} kernels cannot run on this CPU: it lacks {', '.join(missing)}{elsewhere}")
    if build.compiler() is None:
        pytest.skip("no C++ compiler to build the kernels (install g++ >= 11)")
    if not is_ninja_available():
        pytest.skip("ninja is not installed (pip install ninja): the kernels cannot be built")
    return build.load(tier=chosen.name)


@contextmanager
def on_tier(tier: str) -> Iterator[Any]:
    """``$VERISPEC_ISA`` set to ``tier`` for the block (the kernel module of that tier yielded;
    skips where this CPU cannot run it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_ISA", tier)
        yield require_kernels(tier)


def q4k_blocks(n: int, k: int, seed: int = 0, d: float = 2.0**-10) -> np.ndarray:
    """Well-formed random GGUF Q4_K blocks ``[n, k/256 * 144]`` uint8: random codes and 6-bit
    scale/min bytes, fp16 ``d`` around ``d`` and ``dmin`` around ``7.5 d`` (weights of either
    sign, magnitude about ``d * 32 * 7.5``)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    scale = d * (0.5 + rng.random((n, k // 256)))
    blocks[..., 0:2] = scale.astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:4] = (7.5 * scale * (0.5 + rng.random((n, k // 256)))).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def w8a8_quantize_reference(x: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` quantised as the W8A8 kernel does, per block of ``block`` inputs of a row (the
    last one shorter): codes ``round_half_even(x * (127 / amax))`` ``[M, K]`` (as float) and scales
    ``amax / 127`` ``[M, ceil(K / block)]``."""
    xf = x.to(torch.float32)
    codes, scales = [], []
    for b0 in range(0, xf.shape[1], block):
        xb = xf[:, b0 : b0 + block]
        amax = xb.abs().amax(dim=1)
        # (127 / amax as a true division: torch's scalar / tensor is reciprocal-then-multiply)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        codes.append(torch.round(xb * inv[:, None]).clamp(-127, 127))
        scales.append(amax / 127.0)
    return torch.cat(codes, dim=1), torch.stack(scales, dim=1)


def w8a8_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The W8A8 arithmetic of :class:`verispec.kernels.Int8Linear` in plain torch: ``x`` ``[M, K]``
    quantised per block of 64 inputs (:func:`w8a8_quantize_reference`), exact integer products of
    each block with ``codes`` ``[N, K]``, summed in fp32 block by block after scaling by the block's
    activation scale, then ``* scale + bias`` in fp32; returned in ``x``'s dtype."""
    q, xscale = w8a8_quantize_reference(x)
    t = torch.zeros(x.shape[0], codes.shape[0])
    for b, b0 in enumerate(range(0, x.shape[1], 64)):
        acc = q[:, b0 : b0 + 64].to(torch.int64) @ codes[:, b0 : b0 + 64].to(torch.int64).T  # exact
        t = t + acc.to(torch.float32) * xscale[:, b, None]
    y = t * scale.to(torch.float32)[None, :]
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


def q4k_factors(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_K blocks ``[n, k/256 * 144]`` -> codes ``[n, k]`` (0..15), ``ds = d * scale`` and
    ``dm = dmin * min`` per sub-block of 32 inputs ``[n, k/32]`` (fp32, exact), so that the weights
    are ``ds * codes - dm`` sub-block by sub-block (ggml's ``dequantize_row_q4_K``)."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n, k // 256, 144)
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, S, 1]
    dmin = b[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = b[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)  # [n, S, 4, 2, 32]: sub-blocks 2i, 2i + 1
    ds = (d * sc.astype(np.float32)).reshape(n, k // 32)
    dm = (dmin * mn.astype(np.float32)).reshape(n, k // 32)
    return torch.from_numpy(codes.astype(np.int64)), torch.from_numpy(ds), torch.from_numpy(dm)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once, as an FMA instruction computes it: the product is exact in
    fp64, the sum is rounded to fp64 and then to fp32 (a double rounding that differs from the
    single one only when the fp64 sum lands exactly halfway between two fp32 values after its own
    rounding: about once in 2^28 operations, and not in these tests' data)."""
    return (a.double() * b.double() + c.double()).to(torch.float32)


def q4k_reference(x: torch.Tensor, blocks: np.ndarray, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The arithmetic of :class:`verispec.kernels.Q4KLinear` in plain torch: ``x`` ``[M, k]``
    quantised per block of 64 inputs (:func:`w8a8_quantize_reference`); per block ``b`` (sub-blocks
    ``2b``, ``2b + 1``), exact integer sums ``S_j = p . codes`` and ``P_j = sum p``, then in fp32
    ``u = fma(S_1, ds_1, S_0 * ds_0)``, ``t = fma(-P_1 sx, dm_1, fma(-P_0 sx, dm_0, fma(u, sx, t)))``
    block by block (``sx`` the block's activation scale); ``y = t + bias`` in ``x``'s dtype."""
    codes, ds, dm = q4k_factors(blocks, n, k)
    q, xscale = w8a8_quantize_reference(x)
    qi = q.to(torch.int64)
    t = torch.zeros(x.shape[0], n)
    for b in range(k // 64):
        sx = xscale[:, b, None]
        s0, s1 = (qi[:, j * 32 : j * 32 + 32] @ codes[:, j * 32 : j * 32 + 32].T for j in (2 * b, 2 * b + 1))
        a0, a1 = (qi[:, j * 32 : j * 32 + 32].sum(1, keepdim=True).to(torch.float32) * sx for j in (2 * b, 2 * b + 1))
        u = fma(s1.to(torch.float32), ds[:, 2 * b + 1], s0.to(torch.float32) * ds[:, 2 * b])
        t = fma(-a1, dm[:, 2 * b + 1], fma(-a0, dm[:, 2 * b], fma(u, sx, t)))
    return (t if bias is None else t + bias.to(torch.float32)).to(x.dtype)


def q6k_blocks(n: int, k: int, seed: int = 0, d: float = 2.0**-12) -> np.ndarray:
    """Well-formed random GGUF Q6_K blocks ``[n, k/256 * 210]`` uint8: random codes and int8
    scales (any bytes are valid), fp16 ``d`` around ``d`` of either sign."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, 210), dtype=np.uint8)
    scale = d * (0.5 + rng.random((n, k // 256))) * rng.choice([-1.0, 1.0], size=(n, k // 256))
    blocks[..., 208:210] = scale.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(n, -1)


def q6k_factors(blocks: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes ``q`` ``[n, k]`` (0..63), scales ``sc`` ``[n, k / 16]`` and ``d`` ``[n, k / 256]`` fp32
    of Q6_K blocks, decoded as ggml's dequantize_row_q6_K reads them."""
    b = blocks.reshape(n, k // 256, 210).astype(np.int64)
    ql, qh = b[..., :128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)  # [n, S, half, ...]
    codes = np.zeros((n, k // 256, 2, 4, 32), dtype=np.int64)
    for c in range(4):
        low = ql[..., 32 * (c & 1) : 32 * (c & 1) + 32]
        codes[..., c, :] = ((low >> 4) if c >= 2 else low) & 0x0F | (((qh >> (2 * c)) & 3) << 4)
    sc = blocks.reshape(n, k // 256, 210)[..., 192:208].view(np.int8).astype(np.int64).reshape(n, -1)
    d = blocks.reshape(n, k // 256, 210)[..., 208:210].copy().view(np.float16).astype(np.float32).reshape(n, -1)
    return torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(sc), torch.from_numpy(d)


def q6k_reference(x: torch.Tensor, blocks: np.ndarray, n: int, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The arithmetic of :class:`verispec.kernels.Q6KLinear` in plain torch: ``x`` ``[M, k]``
    quantised per block of 64 inputs (:func:`w8a8_quantize_reference`); per block ``b`` the exact
    integer ``I = sum_j sc_j (p_j . q_j - 32 sum p_j)`` over its four 16-input sub-blocks, then in
    fp32 ``t = fma(I, sx_b * d, t)`` (``d`` of the block's super-block), ``y = t + bias`` in ``x``'s
    dtype."""
    codes, sc, d = q6k_factors(blocks, n, k)
    q, xscale = w8a8_quantize_reference(x)
    qi = q.to(torch.int64)
    t = torch.zeros(x.shape[0], n)
    for b in range(k // 64):
        total = torch.zeros(x.shape[0], n, dtype=torch.int64)
        for j in range(4 * b, 4 * b + 4):
            p = qi[:, 16 * j : 16 * j + 16]
            total += sc[:, j] * (p @ codes[:, 16 * j : 16 * j + 16].T - 32 * p.sum(1, keepdim=True))
        t = fma(total.to(torch.float32), xscale[:, b, None] * d[:, b // 4], t)
    return (t if bias is None else t + bias.to(torch.float32)).to(x.dtype)
