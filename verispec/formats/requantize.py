"""GGUF Q4_K blocks made from floating-point weights, for drafts (the "int4-all" precision).

A draft's precision changes only how often its tokens are accepted, never the law of the output,
so a draft may be quantised further than its file stores it: the projections a Q4_K_M file keeps
in Q5_0 / Q8_0 / Q6_K (or a file keeps in F16) are requantised here to Q4_K, which verispec's
kernels read at about half the bytes of int8. Rows whose input size is not a multiple of the
format's 256 are padded with zero weights to one (:class:`verispec.kernels.Q4KLinear` pads the
activations alike; zero weights and zero activations add nothing).

The fit is llama.cpp's format with a simpler fit than its search (``make_qkx2_quants``): per
sub-block of 32 weights ``w ~ ds * q - dm`` with ``q`` in 0..15, first ``ds = (max - min) / 15`` and
``dm = -min`` (``min`` at most 0), then a few rounds of least squares of ``ds``, ``dm`` for the codes
found (about 8% less error than min-max alone on the 0.5B draft); the eight ``ds`` and ``dm`` of a
super-block are stored as 6-bit multiples of the fp16 ``d = max ds / 63`` and ``dmin = max dm / 63``
(ggml-common.h ``block_q4_K``, ggml-quants.c ``quantize_row_q4_K_ref``), and the codes are rounded
against the stored factors. Relative RMS error on the 0.5B's projections: about 0.075-0.087
(Q8_0 about 0.005).
"""

from __future__ import annotations

import numpy as np

SUPER = 256  # inputs per super-block
BLOCK_BYTES = 144  # bytes of one block_q4_K
REFINE = 2  # least-squares rounds after the min-max fit (more gain little: 0.0745 -> 0.0742 at 4)
#: Version of the fit (recorded in the packed cache: a cache from another fit is rebuilt).
REQUANTIZE_FORMAT = f"minmax+lsq{REFINE}/1"


def padded_size(in_features: int) -> int:
    """``in_features`` rounded up to a whole number of super-blocks."""
    return -(-in_features // SUPER) * SUPER


def _round(x: np.ndarray, scale: np.ndarray, shift: np.ndarray) -> tuple[np.ndarray, ...]:
    """The stored form of sub-block factors ``scale``, ``shift`` ``[N, S, 8]`` for weights ``x``
    ``[N, S, 8, 32]``: fp16 ``d``, ``dmin`` ``[N, S]``, 6-bit ``sc``, ``mn`` ``[N, S, 8]`` and the
    codes ``q`` ``[N, S, 8, 32]`` rounded against the stored factors."""
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # [N, S]
    dmin = (shift.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]  # [N, S, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0).astype(np.uint8)  # [N, S, 8]
        mn = np.where(dmin32 > 0, np.clip(np.rint(shift / dmin32), 0, 63), 0).astype(np.uint8)
        ds, dm = d32 * sc, dmin32 * mn  # the stored factors, exact in fp32 as the kernels use them
        q = np.where(ds[..., None] > 0, np.clip(np.rint((x + dm[..., None]) / ds[..., None]), 0, 15), 0)
    return d, dmin, sc, mn, q.astype(np.uint8)


def quantize_q4k(weight: np.ndarray, refine: int = REFINE) -> np.ndarray:
    """Q4_K blocks ``[N, K'/256 * 144]`` uint8 of ``weight`` ``[N, K]`` (any float dtype; ``K'`` is
    :func:`padded_size` of ``K``, the padding zero weights); ``refine`` rounds of least squares
    after the min-max fit."""
    n, k = weight.shape
    kp = padded_size(k)
    w = np.zeros((n, kp), dtype=np.float32)
    w[:, :k] = weight
    x = w.reshape(n, kp // SUPER, 8, 32)  # [N, S, 8, 32]: super-blocks, sub-blocks, weights
    lo = np.minimum(x.min(axis=-1), 0.0)  # [N, S, 8]
    hi = np.maximum(x.max(axis=-1), lo)
    scale, shift = (hi - lo) / 15.0, -lo  # the fit's ds and dm, before 6-bit rounding
    for step in range(refine + 1):
        d, dmin, sc, mn, q = _round(x, scale, shift)
        if step == refine:
            break
        # least squares of w ~ a q - b per sub-block for these codes (a, b >= 0), then round again
        qf = q.astype(np.float32)
        qm, wm = qf.mean(axis=-1), x.mean(axis=-1)
        var = (qf * qf).mean(axis=-1) - qm * qm
        cov = (qf * x).mean(axis=-1) - qm * wm
        with np.errstate(divide="ignore", invalid="ignore"):
            a = np.where(var > 0, np.maximum(cov / var, 0.0), scale)
        scale, shift = a, np.maximum(a * qm - wm, 0.0)
    blocks = np.empty((n, kp // SUPER, BLOCK_BYTES), dtype=np.uint8)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, kp // SUPER, 2)
    blocks[..., 2:4] = dmin.view(np.uint8).reshape(n, kp // SUPER, 2)
    # the 12 scale bytes (get_scale_min_k4's packing): bytes 0-3 scale j & 63 with bits 4-5 of
    # scale j + 4 on top, bytes 4-7 the same for the mins, bytes 8-11 the low nibbles of scale and
    # min j + 4
    blocks[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    blocks[..., 8:12] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    blocks[..., 12:16] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    # byte 32i + l of the codes: weight 64i + l (sub-block 2i) low, 64i + 32 + l (2i + 1) high
    pairs = q.reshape(n, kp // SUPER, 4, 2, 32)
    blocks[..., 16:] = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n, kp // SUPER, 128)
    return blocks.reshape(n, kp // SUPER * BLOCK_BYTES)
