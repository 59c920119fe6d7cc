"""Q4_K blocks made from float weights (the "int4-all" precision's requantisation): the format
ggml reads, padding that adds nothing, and the kernel's arithmetic on padded rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.kernels import q4k_reference, require_kernels
from verispec.formats.requantize import padded_size, quantize_q4k
from verispec.models.quantized import choose_kind


def ggml_weights(blocks: np.ndarray, n: int, k: int) -> np.ndarray:  # [n, k] as ggml dequantises them
    return dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(n, padded_size(k))[:, :k]


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


def test_blocks_are_ggmls_q4k_and_close_to_the_weights() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((40, 896)) * 0.05).astype(np.float32)
    w[3] = 0.0  # a zero row
    w[5] = 0.01  # a constant positive row: no negative minimum
    w[6, :32] = -2.0  # one sub-block far from the rest
    blocks = quantize_q4k(w)
    assert blocks.dtype == np.uint8 and blocks.shape == (40, 4 * 144)  # 896 padded to 1024: 4 super-blocks
    padded = dequantize(blocks, GGMLQuantizationType.Q4_K).reshape(40, 1024)
    assert not padded[:, 896:].any() and not padded[3].any()  # the padding and the zero row stay zero
    got = ggml_weights(blocks, 40, 896)
    assert rel_rms(got, w) < 0.1  # 4-bit codes with 6-bit scales: about 8% of the weights' RMS
    assert np.abs(got[5] - 0.01).max() < 1e-3
    assert rel_rms(got, w) <= rel_rms(ggml_weights(quantize_q4k(w, refine=0), 40, 896), w)  # refining helps


def test_int4_all_requantises_every_decoder_projection_but_the_head() -> None:
    assert choose_kind("int4-all", "Q8_0", 896) == "q4k" and choose_kind("int4-all", "Q4_K", 1536) == "q4k"
    assert choose_kind("int4-all", "Q6_K", 896, head=True) == "int8"  # the LM head as in int4 (it is cut)
    assert choose_kind("int4-all", "F16", 100) == "dense" and choose_kind("int4", "Q8_0", 896) == "int8"


@pytest.mark.parametrize(("n", "k"), [(40, 96), (17, 896), (16, 256)])
def test_a_padded_projection_computes_the_kernels_arithmetic_on_padded_rows(n: int, k: int) -> None:
    require_kernels()
    from verispec.kernels import Q4KLinear
    from verispec.kernels.linear import fuse_linears

    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    lin = Q4KLinear.from_weight(w, bias)
    kp = padded_size(k)  # the fit's 256s; stored: 128s (a last half super-block in a half record)
    assert (lin.in_features, lin.packed_in_features) == (k, -(-k // 128) * 128)
    blocks = quantize_q4k(w.numpy())
    assert torch.equal(lin.dequantize(), torch.from_numpy(ggml_weights(blocks, n, k).copy()))
    x = (torch.randn(7, k, generator=gen) * 2).to(torch.bfloat16)
    y = lin(x)
    ref = q4k_reference(torch.nn.functional.pad(x, (0, kp - k)), blocks, n, kp, bias)
    assert torch.equal(y, ref)  # zero weights times zero activations: the padding adds nothing
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(7)]), y)  # row by row, bit for bit
    if n > 16:  # q/k/v and gate/up fuse as with GGUF blocks
        fused = fuse_linears([Q4KLinear.from_weight(w[:16]), Q4KLinear.from_weight(w[16:])])
        assert fused is not None and torch.equal(fused(x), Q4KLinear.from_weight(w)(x))
    assert quantize_q4k(np.zeros((0, k), dtype=np.float32)).shape == (0, kp // 256 * 144)


@pytest.mark.parametrize("k", [128, 896, 1152])
def test_a_half_record_computes_what_the_whole_padded_record_does(k: int) -> None:
    """K = 256 s + 128: the zero half of the last super-block is not stored, and nothing changes."""
    require_kernels()
    from verispec.kernels import Q4KLinear
    from verispec.kernels.build import load

    gen = torch.Generator().manual_seed(k)
    n, kp = 33, padded_size(k)
    w = torch.randn(n, k, generator=gen) * 0.1
    blocks = torch.from_numpy(quantize_q4k(w.numpy()))
    half = Q4KLinear.from_weight(w)
    whole = Q4KLinear(load().q4k_pack(blocks, n, kp), n, kp)
    assert half.packed_in_features == k and half.q4k.numel() < whole.q4k.numel()
    assert torch.equal(half.dequantize(), whole.dequantize()[:, :k])
    for m in (1, 3, 8, 17):  # one row, a chunk and its rest, more than a chunk
        x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
        assert torch.equal(half(x), whole(torch.nn.functional.pad(x, (0, kp - k))))


def test_packing_refuses_a_half_record_whose_dropped_half_is_not_zero() -> None:
    require_kernels()
    from verispec.kernels.build import load

    w = torch.randn(16, 1024) * 0.1  # weights past input 896
    blocks = torch.from_numpy(quantize_q4k(w.numpy()))
    with pytest.raises(RuntimeError, match="nonzero weights past input 896: pack them with K = 1024"):
        load().q4k_pack(blocks, 16, 896)
    with pytest.raises(RuntimeError, match="multiple of 128"):
        load().q4k_pack(blocks, 16, 960)


@pytest.mark.parametrize(("n", "k"), [(100, 896), (70, 768)])
def test_rows_of_a_q4k_head_are_cut_bit_for_bit(n: int, k: int) -> None:
    """A restricted draft head cut from a Q4_K head: the chosen rows' blocks, repacked exactly."""
    require_kernels()
    from verispec.kernels import Q4KLinear
    from verispec.kernels.linear import q4k_blocks_of_rows, select_rows

    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen) * 0.1
    lin = Q4KLinear.from_weight(w, torch.randn(n, generator=gen))
    ids = torch.tensor([0, 5, 17, 33, 34, 15, n - 1])
    cut = select_rows(lin, ids)
    assert isinstance(cut, Q4KLinear) and (cut.out_features, cut.in_features) == (7, k)
    blocks = quantize_q4k(w.numpy())[ids.numpy()]
    assert torch.equal(q4k_blocks_of_rows(lin, ids)[:, : blocks.shape[1]], torch.from_numpy(blocks))
    assert torch.equal(cut.dequantize(), lin.dequantize()[ids])
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    assert torch.equal(cut(x), lin(x)[:, ids])
