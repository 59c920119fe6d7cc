"""The int4 (GGUF Q4_K, exact), int8 (per channel, W8A8) and bf16 kernels and the layer operations,
on every instruction-set tier this CPU can execute (each test runs once per tier; a tier the CPU
cannot run is skipped with the reason): lossless packing; Q4_K and int8 results equal to their
plain-torch references bit for bit, for any number of rows; bf16 equal to its tier's summation
order bit for bit; batch invariance; and the errors a machine without the instructions gets."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.kernels import (
    on_tier,
    q4k_blocks,
    q4k_reference,
    q6k_blocks,
    q6k_factors,
    q6k_reference,
    require_kernels,
    w8a8_quantize_reference,
    w8a8_reference,
)
from verispec.config import SamplingParams
from verispec.errors import ConfigError
from verispec.formats.dequant import dequantize
from verispec.kernels.dispatch import TIER_NAMES
from verispec.sampling import build_laws

gq = pytest.importorskip("gguf.quants")

ROWS = (1, 3, 7, 16, 21, 40)  # 21 and 40: more than one 16-row chunk, the last one partial
# int8: VNNI up to 3 rows, AMX above; Q4_K: VNNI up to 16 rows, AMX above; both 16 rows at a time on AMX
W8A8_ROWS = (1, 2, 3, 4, 5, 6, 7, 9, 16, 17, 21, 40)


@pytest.fixture(scope="module", autouse=True, params=TIER_NAMES)
def kernels(request: pytest.FixtureRequest) -> Iterator[object]:
    with on_tier(request.param) as module:
        yield module


def exact_weights(blocks: np.ndarray, n: int, k: int) -> torch.Tensor:  # [n, k] fp32, gguf-py's reference
    return torch.from_numpy(gq.dequantize(blocks, gq.GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(("n", "k"), [(64, 512), (37, 256), (16, 1536)])
def test_q4k_packing_is_lossless(n: int, k: int) -> None:
    from verispec.kernels import Q4KLinear

    blocks = q4k_blocks(n, k, seed=n)
    blocks[0, 0:4] = np.array([0.5, -0.25], dtype=np.float16).view(np.uint8)  # negative dmin, extreme scales
    blocks[1, 4:16] = 0xFF  # every scale / min bit set
    lin = Q4KLinear.from_blocks(blocks, n, k)
    w = lin.dequantize()
    assert torch.equal(w, exact_weights(blocks, n, k))  # bit for bit, gguf-py's dequantiser
    assert torch.equal(w, dequantize(blocks, "Q4_K", (n, k), torch.float32))  # and verispec's
    assert lin.q4k.numel() == -(-n // 16) * 16 * k // 256 * 144  # same bytes, padded to 16 rows


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", W8A8_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_k_quants_compute_the_w8a8_arithmetic_on_the_exact_weights(
    kind: str, m: int, dtype: torch.dtype, bias: bool
) -> None:
    """Bit for bit the plain-torch reference of each format's arithmetic, for any number of rows,
    each row the same as alone. Q4_K: exact integer sums of int8 activations (per 64 inputs) and
    the 4-bit codes, the format's fp32 sub-block factors applied in the same order. Q6_K: exact
    integer sums per 16-input sub-block, scaled and offset in integers, then the fp32 steps per
    block and super-block."""
    from verispec.kernels import Q4KLinear, Q6KLinear

    linear, blocks_of, reference = {
        "Q4_K": (Q4KLinear, q4k_blocks, q4k_reference),
        "Q6_K": (Q6KLinear, q6k_blocks, q6k_reference),
    }[kind]
    n, k = 72, 768  # 72: the last 16-row block is partial
    blocks = blocks_of(n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    b = torch.randn(n, generator=gen) if bias else None
    lin = linear.from_blocks(blocks, n, k, b)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[m // 2] = 0  # an all-zero row: y = bias
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = reference(x, blocks, n, k, b)
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()
    assert torch.equal(y[m // 2], torch.zeros(n, dtype=dtype) if b is None else b.to(dtype))
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(m)]), y)
    if m > 1:  # (m = 1: the zero row alone)
        w = lin.dequantize().double()
        assert rel_err(y, x.double() @ w.T + (0 if b is None else b.double())) < 0.02  # (int8 activations)


@pytest.mark.parametrize(("n", "k"), [(64, 512), (37, 256), (16, 1536)])
def test_q6k_packing_is_lossless(n: int, k: int) -> None:
    """The packed records hold the blocks' weights d * sc * (q - 32) exactly (computed in fp64;
    gguf-py's fp32 dequantiser rounds the product d * sc * q once more, to within an ulp)."""
    from verispec.kernels import Q6KLinear, q6k_packed_numel

    blocks = q6k_blocks(n, k, seed=n)
    blocks[0, 192:208] = np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)  # extreme scales
    blocks[1, :192] = 0xFF  # every code 63
    lin = Q6KLinear.from_blocks(blocks, n, k)
    codes, sc, d = q6k_factors(blocks, n, k)
    exact = (d.double().repeat_interleave(256, 1) * (sc.repeat_interleave(16, 1) * (codes - 32))).float()
    w = lin.dequantize()
    assert torch.equal(w, exact)
    theirs = torch.from_numpy(gq.dequantize(blocks, gq.GGMLQuantizationType.Q6_K).astype(np.float32)).reshape(n, k)
    torch.testing.assert_close(w, theirs, rtol=2.0**-23, atol=0)
    assert lin.q6k.numel() == q6k_packed_numel(n, k) == -(-n // 16) * (k // 256) * 3392
    assert lin.weight_bytes() == lin.q6k.numel()


def test_q6k_projections_fuse_and_cut_bit_for_bit() -> None:
    """Q6_K parts side by side compute what each computes alone, and a cut to some rows (a draft's
    restricted head) computes exactly those rows of the whole."""
    from verispec.kernels import Q6KLinear
    from verispec.kernels.linear import fuse_linears, select_rows

    gen = torch.Generator().manual_seed(5)
    parts = [
        Q6KLinear.from_blocks(q6k_blocks(n, 512, seed=n), n, 512, torch.randn(n, generator=gen)) for n in (32, 16, 21)
    ]
    fused = fuse_linears(parts)
    assert isinstance(fused, Q6KLinear)
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    ids = torch.tensor([20, 0, 17, 5, 31, 16, 2])
    cut = select_rows(parts[0], ids)
    assert isinstance(cut, Q6KLinear) and torch.equal(cut(x), parts[0](x)[:, ids])
    assert torch.equal(cut.dequantize(), parts[0].dequantize()[ids])


def test_q6k_refuses_what_it_cannot_take() -> None:
    from verispec.kernels import Q6KLinear

    kernels = require_kernels()
    lin = Q6KLinear.from_blocks(q6k_blocks(16, 256), 16, 256)
    with pytest.raises(ValueError, match="x must be"):
        lin(torch.randn(2, 128))
    with pytest.raises(ValueError, match="multiple of 256"):
        Q6KLinear(lin.q6k, 16, 128)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.q6k_pack(torch.zeros(16 * 210, dtype=torch.uint8), 16, 128)
    with pytest.raises(RuntimeError, match="packed Q6_K"):
        kernels.q6k_linear(torch.randn(1, 256), lin.q6k[:-1], 16, 256, None)


@pytest.mark.parametrize("m", W8A8_ROWS)
def test_q4k_half_record_is_the_arithmetic_of_the_padded_rows(m: int) -> None:
    """K = 256 s + 128 (a projection requantised from 896 inputs): the last super-block is a half
    record, and the result is the reference's on the weights and activations padded with zeros."""
    from verispec.kernels import Q4KLinear, load

    n, k = 40, 640
    kp = 768
    blocks = q4k_blocks(n, kp, seed=m).reshape(n, kp // 256, 144)
    blocks[:, -1, 4 + 8 : 4 + 12] = 0  # the last super-block's sub-blocks 4-7: scale and min 0 ...
    blocks[:, -1, 4 : 4 + 8] &= 0x3F  # ... (their top bits live in the first eight bytes)
    blocks = blocks.reshape(n, -1)
    gen = torch.Generator().manual_seed(m)
    b = torch.randn(n, generator=gen)
    lin = Q4KLinear(load().q4k_pack(torch.from_numpy(blocks), n, k), n, k, b)
    assert lin.q4k.numel() == 3 * (2 * 2304 + 1280)
    assert torch.equal(lin.dequantize(), exact_weights(blocks, n, kp)[:, :k])
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    ref = q4k_reference(torch.nn.functional.pad(x, (0, kp - k)), blocks, n, kp, b)
    assert torch.equal(lin(x), ref)
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(m)]), ref)


def test_q4k_half_records_on_every_engine() -> None:
    """The whole-record copy (q4k_whole_records) holds the same weights, and every engine gives
    the vector kernels' bits on a matrix ending in a half record (the tiles, on the amx tier, read
    the half records as they are; a tier without tiles refuses them as for whole records)."""
    from verispec.kernels import Q4KLinear

    kernels = require_kernels()
    gen = torch.Generator().manual_seed(7)
    n, k = 40, 896
    half = Q4KLinear.from_weight(torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen))
    whole = kernels.q4k_whole_records(half.q4k, n, k)
    assert whole.numel() == 3 * 4 * 2304
    assert torch.equal(kernels.q4k_dequantize(whole, n, k + 128)[:, :k], half.dequantize())
    with pytest.raises(RuntimeError, match="whole records already"):
        kernels.q4k_whole_records(whole, n, k + 128)
    for m in (1, 16, 17, 40):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        vectors = kernels.q4k_linear(x, half.q4k, n, k, half.bias, 1)
        assert torch.equal(kernels.q4k_linear(x, half.q4k, n, k, half.bias, 0), vectors)
        assert torch.equal(kernels.q4k_linear(x, whole, n, k + 128, half.bias, 1), vectors)
        if kernels.tier() == "amx":
            assert torch.equal(kernels.q4k_linear(x, half.q4k, n, k, half.bias, 2), vectors)
        else:
            with pytest.raises(RuntimeError, match="AMX is not available"):
                kernels.q4k_linear(x, half.q4k, n, k, half.bias, 2)
    if kernels.tier() == "amx":  # a half record alone, and after one whole record
        for k in (128, 384):
            lin = Q4KLinear.from_weight(torch.randn(n, k, generator=gen) * 0.1)
            for m in (1, 6, 8, 16, 17, 24):
                x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                vectors = kernels.q4k_linear(x, lin.q4k, n, k, None, 1)
                assert torch.equal(kernels.q4k_linear(x, lin.q4k, n, k, None, 2), vectors), (k, m)


@pytest.mark.parametrize("m", (1, 5, 40))
def test_q4k_error_is_the_activation_rounding(m: int) -> None:
    """Against ``x @ W_exact.T`` (gguf-py's weights) the error is at most half an activation step
    per input: |y - x @ W.T| <= sum_k scale_x(k) / 2 * |W[n, k]| (+ fp32 rounding)."""
    from verispec.kernels import Q4KLinear

    n, k = 40, 512
    blocks = q4k_blocks(n, k, seed=m)
    lin = Q4KLinear.from_blocks(blocks, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 3] *= 30  # an outlier channel: only its block's step grows
    w = exact_weights(blocks, n, k).double()
    err = (lin(x).double() - x.double() @ w.T).abs()
    step = w8a8_quantize_reference(x)[1].double().repeat_interleave(64, dim=1)
    assert (err <= (step / 2) @ w.abs().T * (1 + 1e-4) + 1e-5).all()


@pytest.mark.parametrize("kind", ["q4k", "int8"])
def test_engines_agree_bit_for_bit(kind: str) -> None:
    """The vector kernels and (on the amx tier) AMX tiles, chosen by the number of rows, give
    identical results at every M; a tier without tiles refuses to be forced onto them."""
    from verispec.kernels import Int8Linear, Q4KLinear

    kernels = require_kernels()
    gen = torch.Generator().manual_seed(0)
    for n, k in [(40, 256), (33, 1024)] + ([(16, 4864), (24, 96)] if kind == "int8" else []):
        if kind == "q4k":
            lin = Q4KLinear.from_blocks(q4k_blocks(n, k, seed=k), n, k, torch.randn(n, generator=gen))

            def run(x: torch.Tensor, engine: int, lin: Q4KLinear = lin, n: int = n, k: int = k) -> torch.Tensor:
                return kernels.q4k_linear(x, lin.q4k, n, k, lin.bias, engine)

        else:
            lin8 = Int8Linear.from_weight(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))

            def run(x: torch.Tensor, engine: int, lin: Int8Linear = lin8, n: int = n, k: int = k) -> torch.Tensor:
                return kernels.w8a8_linear(x, lin.int8, lin.int8_scale, n, k, lin.bias, engine)

        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 19, 40):  # (the tiles' paths: 1-8 rows, 9-16, both)
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            auto, vectors = run(x, 0), run(x, 1)
            assert torch.equal(auto, vectors), (n, k, m)
            if kernels.tier() == "amx":
                assert torch.equal(auto, run(x, 2)), (n, k, m)
            else:
                with pytest.raises(RuntimeError, match="AMX is not available"):
                    run(x, 2)


@pytest.mark.parametrize(("n", "k", "cols"), [(40, 512, 512), (33, 896, 896), (24, 768, 640)])
def test_q4k_prefill_is_bf16_tiles_on_the_weights_rounded_to_bf16(n: int, k: int, cols: int) -> None:
    """A prompt's Q4_K projection on the amx tier (csrc/amx/prefill.cpp): gguf-py's exact weights
    rounded to bf16 (nearest even), times the bf16 activations in TDPBF16PS's order (the bf16
    kernel's reference), bit for bit; a row's result does not depend on the other rows. Half
    records (K = 896) and activations narrower than the padded weights (640 of 768) included.
    Every other tier refuses the call."""
    from verispec.kernels import Q4KLinear
    from verispec.kernels.linear import reference_bf16_linear

    kernels = require_kernels()
    kb = -(-k // 256) * 256  # the GGUF blocks cover whole super-blocks
    blocks = q4k_blocks(n, kb, seed=k).reshape(n, kb // 256, 144)
    if kb != k:  # the padding's sub-blocks weigh nothing (scale and min 0), as a requantised file's
        blocks[:, -1, 4 + 8 : 4 + 12] = 0
        blocks[:, -1, 4 : 4 + 8] &= 0x3F
    blocks = blocks.reshape(n, -1)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    lin = Q4KLinear(kernels.q4k_pack(torch.from_numpy(blocks), n, k), n, k, bias)
    x = torch.randn(72, cols, generator=gen).to(torch.bfloat16)
    if not kernels.prefill_available():
        with pytest.raises(RuntimeError, match="need the amx tier"):
            kernels.q4k_prefill_linear(x, lin.q4k, n, k, bias)
        return
    w16 = exact_weights(blocks, n, kb)[:, :k].to(torch.bfloat16)
    padded = torch.nn.functional.pad(x, (0, k - cols))
    for m in (*ROWS, 72):  # (from 32 rows two chunks of 16 go with two row blocks at a time: amx/bf16.cpp)
        y = kernels.q4k_prefill_linear(x[:m], lin.q4k, n, k, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        assert torch.equal(y, reference_bf16_linear(padded[:m], w16, bias, order="amx").to(torch.bfloat16)), m
        rows = [kernels.q4k_prefill_linear(x[i : i + 1], lin.q4k, n, k, bias) for i in range(m)]
        assert torch.equal(y, torch.cat(rows)), m
    with pytest.raises(RuntimeError, match="must be bf16"):
        kernels.q4k_prefill_linear(x.float(), lin.q4k, n, k, bias)
    with pytest.raises(RuntimeError, match="packed Q4_K"):
        kernels.q4k_prefill_linear(x, lin.q4k[:-1], n, k, bias)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (33, 256)])
def test_int8_prefill_is_bf16_tiles_on_the_weights_rounded_to_bf16(n: int, k: int) -> None:
    """A prompt's int8 projection on the amx tier: the weights scale * codes (fp32, one rounding)
    rounded to bf16, times the bf16 activations in TDPBF16PS's order, bit for bit, extreme codes
    included; rows independent of each other. Every other tier refuses the call."""
    from verispec.kernels import Int8Linear
    from verispec.kernels.linear import reference_bf16_linear

    kernels = require_kernels()
    gen = torch.Generator().manual_seed(k)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :3] = torch.tensor([-128, 127, 0], dtype=torch.int8)
    lin = Int8Linear.from_codes(codes, torch.rand(n, generator=gen) * 0.01, torch.randn(n, generator=gen))
    x = torch.randn(72, k, generator=gen).to(torch.bfloat16)

    def run(rows: torch.Tensor) -> torch.Tensor:
        return kernels.int8_prefill_linear(rows, lin.int8, lin.int8_scale, n, k, lin.bias)  # type: ignore[no-any-return]

    if not kernels.prefill_available():
        with pytest.raises(RuntimeError, match="need the amx tier"):
            run(x)
        return
    w16 = (codes.float() * lin.int8_scale[:n, None]).to(torch.bfloat16)
    for m in (*ROWS, 72):
        y = run(x[:m])
        assert torch.equal(y, reference_bf16_linear(x[:m], w16, lin.bias, order="amx").to(torch.bfloat16)), m
        assert torch.equal(y, torch.cat([run(x[i : i + 1]) for i in range(m)])), m
    with pytest.raises(RuntimeError, match="packed int8"):
        kernels.int8_prefill_linear(x, lin.int8[:-1], lin.int8_scale, n, k, None)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (16, 256), (3, 32)])
def test_int8_packing_is_lossless(n: int, k: int) -> None:
    from verispec.kernels import Int8Linear

    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = torch.rand(n, generator=gen)
    lin = Int8Linear.from_codes(codes, scale)
    assert torch.equal(lin.codes(), codes)
    ids = torch.tensor([n - 1, 0, n // 2, 0])  # rows gathered from their blocks, in any order, repeated
    assert torch.equal(lin.codes(ids), codes[ids])
    assert torch.equal(lin.dequantize(), codes.float() * scale[:, None])
    assert lin.int8.numel() == -(-n // 16) * 16 * k and not lin.int8_scale[n:].any()


def test_int8_weights_are_rounded_once() -> None:
    from verispec.kernels import Int8Linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen)
    w[3] = 0  # an all-zero row: scale 0
    lin = Int8Linear.from_weight(w)
    codes, scale = lin.codes(), lin.int8_scale[:40]
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127 and scale[3] == 0
    assert ((lin.dequantize() - w).abs() <= scale[:, None] * (0.5 + 1e-5)).all()


@pytest.mark.parametrize("m", W8A8_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_is_w8a8(m: int, dtype: torch.dtype, bias: bool) -> None:
    """The kernel computes exactly the W8A8 arithmetic of the plain-torch reference: integer sums
    of int8 activations (quantised per 64 inputs) and int8 weights, then the same fp32 steps."""
    from verispec.kernels import Int8Linear

    n, k = 40, 224  # 40: the last 16-row block is partial; 224 % 64 == 32: a short last block
    gen = torch.Generator().manual_seed(m)
    lin = Int8Linear.from_weight(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x[m // 2] = 0  # an all-zero row: scale 0, y = bias
    y = lin(x)
    assert y.dtype == dtype and y.shape == (m, n)
    ref = w8a8_reference(x, lin.codes(), lin.int8_scale[:n], lin.bias)
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()
    assert torch.equal(y[m // 2], torch.zeros(n, dtype=dtype) if lin.bias is None else lin.bias.to(dtype))


def test_int8_activation_quantisation_matches_the_reference() -> None:
    kernels = require_kernels()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 160, generator=gen) * torch.logspace(-3, 3, 7)[:, None]  # scales per 64, 64, 32
    x[2] = 0
    x[3, 64:67] = torch.tensor([-127.0, 2.5, -3.5])  # block 1 of row 3 has scale 1: ties round to even
    x[3, 67:128] = torch.rand(61, generator=gen)
    x[4, 128:] = 0  # one all-zero block
    q, scale, sums = kernels.w8a8_quantize(x)
    ref, ref_scale = w8a8_quantize_reference(x)
    assert torch.equal(q, ref.to(torch.int8)) and torch.equal(scale, ref_scale) and scale.shape == (7, 3)
    assert torch.equal(sums, ref.reshape(7, 5, 32).sum(2).to(torch.int32)) and int(q.abs().max()) == 127
    assert q[3, 64:67].tolist() == [-127, 2, -4] and scale[3, 1] == 1
    assert not q[2].any() and not scale[2].any() and scale[4, 2] == 0 and scale[4, 1] > 0


def test_int8_extreme_codes_do_not_overflow() -> None:
    """Full-scale codes of one sign over a long row: the largest sums the format allows are exact."""
    from verispec.kernels import Int8Linear

    n, k = 20, 8960
    codes = torch.full((n, k), -128, dtype=torch.int8)
    codes[1::2] = 127
    lin = Int8Linear.from_codes(codes, torch.full((n,), 2.0**-7))
    x = torch.full((3, k), -1.0)
    x[1] = 1.0
    y = lin(x)
    assert torch.equal(y, w8a8_reference(x, codes, lin.int8_scale[:n], None))
    assert y[0, 0].item() == pytest.approx(128 * k * 2.0**-7, rel=1e-6)
    assert y[1, 1].item() == pytest.approx(127 * k * 2.0**-7, rel=1e-6)


@pytest.mark.parametrize("m", (1, 5, 40))
def test_int8_error_is_the_activation_rounding(m: int) -> None:
    """Against the exact product with the same weights, the error is bounded by half an activation
    step per element: |y - x @ W.T| <= sum_k scale_x(k) / 2 * |W[n, k]| (+ fp32 rounding)."""
    from verispec.kernels import Int8Linear

    n, k = 48, 512
    gen = torch.Generator().manual_seed(m)
    lin = Int8Linear.from_weight(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    x[:, 7] *= 50  # an outlier channel: only its block's step grows
    w = lin.dequantize().double()
    err = (lin(x).double() - x.double() @ w.T).abs()
    step = w8a8_quantize_reference(x)[1].double().repeat_interleave(64, dim=1)  # [m, k]: scale_x of each input
    bound = (step / 2) @ w.abs().T
    assert (err <= bound * (1 + 1e-4) + 1e-4).all()
    assert rel_err(lin(x), x.double() @ w.T) < 0.05  # typical: a few per mille (more with the outlier)


@pytest.mark.parametrize("kind", ["q4k", "int8"])
def test_rows_do_not_depend_on_the_other_rows(kind: str) -> None:
    """Batch invariance: row i of an M-row call equals the 1-row call on row i, bit for bit."""
    from verispec.kernels import Int8Linear, Q4KLinear

    n, k = 48, 512
    blocks = q4k_blocks(n, k, seed=3)
    lin = Q4KLinear.from_blocks(blocks, n, k) if kind == "q4k" else Int8Linear.from_weight(exact_weights(blocks, n, k))
    gen = torch.Generator().manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        rows = torch.cat([lin(x[i : i + 1]) for i in range(m)])
        assert torch.equal(lin(x), rows), m
    x3 = torch.randn(2, 5, k, generator=gen)  # any leading dims
    assert lin(x3).shape == (2, 5, n) and torch.equal(lin(x3)[1], lin(x3[1]))


def test_shapes_are_checked() -> None:
    from verispec.kernels import Int8Linear, Q4KLinear, load

    with pytest.raises(ValueError, match="% 32"):
        Q4KLinear(torch.zeros(10, dtype=torch.uint8), 16, 100)
    with pytest.raises(ValueError, match="multiple of 256"):  # GGUF blocks cover whole super-blocks
        Q4KLinear.from_blocks(q4k_blocks(16, 256), 16, 224)
    with pytest.raises(ValueError, match="uint8 bytes"):
        Q4KLinear(torch.zeros(10, dtype=torch.uint8), 16, 256)
    with pytest.raises(ValueError, match=r"multiple|% 32"):
        Int8Linear.from_weight(torch.randn(16, 40))
    lin = Q4KLinear.from_blocks(q4k_blocks(16, 256), 16, 256)
    with pytest.raises(ValueError, match=r"\[\.\.\., 256\]"):
        lin(torch.randn(2, 128))
    with pytest.raises(RuntimeError, match=r"\[M, 256\]"):  # the kernel itself: narrower by a super-block or more
        load().q4k_linear(torch.randn(2, 0), lin.q4k, 16, 256, None)


def test_the_layer_loop_refuses_projections_that_do_not_fit() -> None:
    """``Layers`` (every decoder layer in one call, its kernels on raw pointers) checks each packed
    projection against its bytes and each layer against the model's shapes when it is made: a
    wrong size is an error there, never a read past a buffer in the loop."""
    from verispec.kernels import Int8Linear, load

    ops = load()
    c, heads, kv_heads, d, f = 64, 2, 1, 32, 64  # q 64 wide, k and v 32 each

    def proj(n: int, k: int, packed_n: int | None = None) -> object:
        lin = Int8Linear.from_weight(torch.randn(packed_n or n, k))
        return ops.Projection(1, lin.int8, lin.int8_scale, None, n, k)

    norm = torch.ones(c, dtype=torch.bfloat16)

    def layers(o: object, post: torch.Tensor = norm) -> object:
        layer = ([proj(128, c)], o, [proj(2 * f, c)], proj(c, f), post, norm)
        return ops.Layers([layer], heads, kv_heads, d, c, f, 1e-6)

    layers(proj(c, heads * d))  # the shapes that fit
    with pytest.raises(RuntimeError, match=r"packed int8 has \d+ elements, expected \d+"):
        proj(48, c, packed_n=16)
    lin = Int8Linear.from_weight(torch.randn(16, c))
    with pytest.raises(RuntimeError, match="needs its scales"):
        ops.Projection(1, lin.int8, None, None, 16, c)
    with pytest.raises(RuntimeError, match=r"o must be \[64 x 64\], got \[32 x 64\]"):
        layers(proj(32, heads * d))
    with pytest.raises(RuntimeError, match=r"a norm's weight must be \[64\]"):
        layers(proj(c, heads * d), post=torch.ones(32, dtype=torch.bfloat16))


def test_a_cpu_without_the_instructions_gets_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.formats.loader import bf16_kernel_usable, check_precision
    from verispec.kernels import build, dispatch

    monkeypatch.setattr(build._STATE, "modules", {})
    monkeypatch.setattr(build._STATE, "by_env", {})
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))  # a Zen 3
    monkeypatch.setenv("VERISPEC_ISA", "amx")
    for call in (build.load, lambda: check_precision("int4", "cpu")):
        with pytest.raises(ConfigError, match=r"VERISPEC_ISA=amx needs .* lacks avx512f.*choose one of avx2, portable"):
            call()
    monkeypatch.setenv("VERISPEC_ISA", "sse9")
    for call in (build.load, bf16_kernel_usable, lambda: check_precision("int8", "cpu")):  # an error, not a fallback
        with pytest.raises(ConfigError, match="must be one of amx, avx512bf16, avx512, avx2vnni, avx2, neon, portable"):
            call()
    monkeypatch.delenv("VERISPEC_ISA")
    assert dispatch.selected().name == "avx2" and [t.name for t in dispatch.runnable()] == ["avx2", "portable"]
    with pytest.raises(ConfigError, match="the amx kernels need a CPU with"):
        build.load(tier="amx")
    check_precision("bf16", "cpu")  # the dense precisions need nothing
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(ConfigError, match=r"no C\+\+ compiler was found.*--dtype bf16"):
        build.load()
    with pytest.raises(ConfigError, match="CPU only"):
        check_precision("int8", "cuda")


def test_no_rows_give_no_rows() -> None:
    """A pass where no sequence needs a projection (an empty batch slice) returns an empty result."""
    from verispec.kernels import Int8Linear, Q4KLinear

    for lin in (Q4KLinear.from_blocks(q4k_blocks(16, 256), 16, 256), Int8Linear.from_weight(torch.randn(16, 256))):
        for shape in ((0, 256), (2, 0, 256)):
            y = lin(torch.randn(*shape, dtype=torch.bfloat16))
            assert y.shape == (*shape[:-1], 16) and y.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ bf16


@pytest.mark.parametrize(("n", "k"), [(40, 64), (37, 96), (16, 1536)])
def test_bf16_packing_is_lossless(n: int, k: int) -> None:
    from verispec.kernels import Bf16Linear

    w = torch.randn(n, k).to(torch.bfloat16)
    lin = Bf16Linear.from_weight(w)
    assert torch.equal(lin.unpack(), w) and torch.equal(lin.dequantize(), w.float())
    ids = torch.tensor([n - 1, 0, n // 2, 0])  # rows gathered from their blocks, in any order, repeated
    assert torch.equal(lin.unpack(ids), w[ids])
    assert lin.bf16.numel() == -(-n // 16) * 16 * k
    assert lin.weight_bytes() == lin.bf16.numel() * 2


@pytest.mark.parametrize("m", (1, 2, 5, 9, 16, 17, 40))
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_is_the_tier_arithmetic(m: int, bias: bool) -> None:
    """Bit for bit the plain-torch reference of the tier's summation order (amx: TDPBF16PS's, per
    32 inputs, even and odd products summed apart, then added; avx512bf16: one sum per output by
    input pairs, odd before even; the others: one sum per output in input order), with activations
    whose outliers make the order matter, and a last 16-row block that is partial."""
    from verispec.kernels import Bf16Linear, reference_bf16_linear

    n, k = 50, 160
    gen = torch.Generator().manual_seed(m)
    w = (0.05 * torch.randn(n, k, generator=gen)).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen) * torch.where(torch.rand(m, k, generator=gen) < 0.1, 30.0, 1.0)
    x = x.to(torch.bfloat16)
    b = torch.randn(n, generator=gen) if bias else None
    lin = Bf16Linear.from_weight(w, b)
    ref = reference_bf16_linear(x, w, b)  # [m, n] fp32
    assert torch.equal(load_fp32(lin, x), ref)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref.to(torch.bfloat16))
    # and it is the product itself, up to fp32 rounding of the sums
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert ((ref.double() - exact).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


def test_bf16_pairs_count_denormals_as_zero() -> None:
    """The avx512bf16 tier (VDPBF16PS): bf16 inputs and fp32 sums below fp32's normal range count
    as zero, and a product that small still adds exactly to a larger sum (one rounding, an FMA);
    its plain-torch reference says so bit for bit, and the reference without the flushes (the
    negative control) does not."""
    from verispec.kernels import Bf16Linear, reference_bf16_linear
    from verispec.kernels.dispatch import selected

    if selected().bf16_order != "pairs":
        pytest.skip(f"the {selected().name} tier does not sum bf16 in VDPBF16PS's pairs")
    n, k = 16, 64
    tiny = torch.finfo(torch.float32).tiny  # 2^-126
    w, x = torch.ones(n, k), torch.zeros(3, k)
    x[0, 0], w[:, 0] = tiny / 4, 2.0**100  # a denormal input: 0, not 2^-28
    x[1, 2:4], w[:, 2:4] = 2.0**-70, 2.0**-70  # products of 2^-140: denormal sums, 0 each time
    x[2, 5], w[:, 5] = 1.0, 1.5 * tiny  # the odd input first: a normal sum of 1.5 tiny,
    x[2, 4], w[:, 4] = 1.0, -tiny  # then its even one: 0.5 tiny, denormal, so 0
    w, x = w.to(torch.bfloat16), x.to(torch.bfloat16)
    y = load_fp32(Bf16Linear.from_weight(w), x)
    ref = reference_bf16_linear(x, w, order="pairs")
    assert torch.equal(y, ref)
    assert torch.equal(ref, torch.zeros(3, n))
    kept = reference_bf16_linear(x, w, order="chain")  # denormals kept: the control differs
    assert not torch.equal(kept, ref)


def load_fp32(lin: object, x: torch.Tensor) -> torch.Tensor:
    """The bf16 kernel's fp32 result before the final rounding."""
    from verispec.kernels import load

    return load().bf16_linear(x, lin.bf16, lin.out_features, lin.in_features, lin.bias, True)  # type: ignore[attr-defined]


def test_bf16_rows_do_not_depend_on_the_other_rows() -> None:
    from verispec.kernels import Bf16Linear

    n, k = 72, 256
    gen = torch.Generator().manual_seed(5)
    lin = Bf16Linear.from_weight(torch.randn(n, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        assert torch.equal(lin(x), torch.cat([lin(x[i : i + 1]) for i in range(m)])), m
    assert lin(torch.randn(0, k, dtype=torch.bfloat16)).shape == (0, n)


def test_bf16_shapes_are_checked() -> None:
    from verispec.kernels import Bf16Linear

    with pytest.raises(ValueError, match="% 32"):
        Bf16Linear.from_weight(torch.randn(16, 40))
    with pytest.raises(ValueError, match="bf16 values"):
        Bf16Linear(torch.zeros(10, dtype=torch.bfloat16), 16, 64)
    lin = Bf16Linear.from_weight(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match=r"\[M, 64\]"):
        lin(torch.randn(2, 32, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------ layer ops


def test_rotary_is_the_torch_formula_bit_for_bit() -> None:
    from verispec.kernels import load
    from verispec.models.rope import apply_rotary

    gen = torch.Generator().manual_seed(0)
    m, heads, d = 7, 3, 64
    x = torch.randn(m, heads * d + 32, generator=gen).to(torch.bfloat16)[:, 32:]  # strided rows, like a q/k/v slice
    cos, sin = (torch.randn(m, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    ours = load().rotary(x, cos, sin, heads, d)  # [M, heads, d]
    theirs = apply_rotary(x.reshape(1, m, heads, d), cos[None, :, None], sin[None, :, None])[0]
    assert torch.equal(ours, theirs)


def test_rms_norm_with_the_residual_add() -> None:
    from verispec.kernels import load

    gen = torch.Generator().manual_seed(1)
    m, c, eps = 5, 200, 1e-6  # 200: a partial last vector
    h = (3 * torch.randn(m, c, generator=gen)).to(torch.bfloat16)
    delta = torch.randn(m, c, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(c, generator=gen)).to(torch.bfloat16)
    expect_h = h + delta  # bf16 add, rounded
    x32 = expect_h.float()
    expect = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(torch.bfloat16)
    got = load().rms_norm(h, delta, w, eps)
    assert torch.equal(h, expect_h)  # updated in place
    diff = (got.float() - expect.float()).abs()
    assert (diff <= 2**-7 * expect.float().abs() + 1e-6).all()  # one bf16 ulp at most (rsqrt / sum order)
    assert (diff == 0).float().mean() > 0.95
    rows = torch.cat([load().rms_norm(h[i : i + 1].clone(), None, w, eps) for i in range(m)])
    assert torch.equal(load().rms_norm(h.clone(), None, w, eps), rows)  # batch-invariant


def test_silu_mul() -> None:
    from verispec.kernels import load

    gen = torch.Generator().manual_seed(2)
    gate_up = (4 * torch.randn(6, 2 * 136, generator=gen)).to(torch.bfloat16)
    gate, up = gate_up[:, :136], gate_up[:, 136:]
    got = load().silu_mul(gate, up)
    expect = torch.nn.functional.silu(gate) * up
    diff = (got.float() - expect.float()).abs()
    assert (diff <= 2**-7 * expect.float().abs() + 1e-30).all() and (diff == 0).float().mean() > 0.95


def greedy_reference(
    scores: torch.Tensor,
    ids: torch.Tensor,
    more: torch.Tensor | None,
    more_ids: torch.Tensor | None,
    blocked: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``greedy_pick`` gives, in torch: the columns merged in id order (blocked ones -inf), the
    first largest (the smallest id), its softmax probability; no token for a NaN or no finite max."""
    x, names = scores.float(), ids
    if more is not None and more_ids is not None:
        own = more.float().masked_fill(blocked, float("-inf")) if blocked is not None else more.float()
        names = torch.cat([ids, more_ids])
        order = names.argsort(stable=True)
        x, names = torch.cat([x, own], dim=1)[:, order], names[order]
    top = x.amax(dim=1)
    ok = torch.isfinite(top) & ~x.isnan().any(dim=1)
    picked = torch.where(ok, names[x.argmax(dim=1)], -1)
    return picked, torch.softmax(x, dim=1).amax(dim=1), ok  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_greedy_pick_is_the_first_largest_score_and_its_probability(dtype: torch.dtype) -> None:
    """One or two segments of scores, each named by ascending ids (the second's interleaved with
    the first's), blocked columns, ties (scores rounded to few values), rows of one to a few
    hundred columns (partial vectors), and rows without a greedy token: a NaN (anywhere, also in
    a block of 16), +inf, every score -inf; a -inf score alone is an ordinary one."""
    from verispec.kernels import load

    gen = torch.Generator().manual_seed(5)
    for trial in range(60):
        a, w, e = 4, int(torch.randint(1, 300, (1,), generator=gen)), int(torch.randint(0, 40, (1,), generator=gen))
        names = torch.randperm(w + e, generator=gen)
        ids, more_ids = names[:w].sort().values, names[w:].sort().values
        scores = (4 * torch.randn(a, w, generator=gen)).to(dtype)
        more = (4 * torch.randn(a, e, generator=gen)).to(dtype) if e else None
        if trial % 2:  # ties
            scores = scores.round()
            more = more.round() if more is not None else None
        blocked = torch.rand(a, e, generator=gen) < 0.5 if e and trial % 3 else None
        scores[0, int(torch.randint(0, w, (1,), generator=gen))] = float("-inf")
        if trial % 4 == 0:
            scores[1, int(torch.randint(0, w, (1,), generator=gen))] = float("nan")
            scores[2] = float("-inf")
            if more is not None:
                more[2] = float("-inf")
            scores[3, int(torch.randint(0, w, (1,), generator=gen))] = float("inf")
        got = load().greedy_pick(scores, ids, more, more_ids if e else None, blocked)
        want = greedy_reference(scores, ids, more, more_ids if e else None, blocked)
        assert torch.equal(got[2], want[2]) and torch.equal(got[0], want[0]), trial
        torch.testing.assert_close(got[1][want[2]], want[1][want[2]], rtol=2e-6, atol=0)
    assert torch.equal(load().greedy_pick(torch.tensor([[0.0, 2.0, 2.0]]))[0], torch.tensor([1]))  # (ids: columns)


def test_the_greedy_pick_refuses_what_it_cannot_read() -> None:
    from verispec.kernels import load

    ops = load()
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        ops.greedy_pick(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="ids must be"):
        ops.greedy_pick(torch.zeros(2, 8), torch.arange(7))
    with pytest.raises(RuntimeError, match="second segment needs its ids"):
        ops.greedy_pick(torch.zeros(2, 8), None, torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="belong to a second segment"):
        ops.greedy_pick(torch.zeros(2, 8), None, None, None, torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="blocked columns"):
        ops.greedy_pick(
            torch.zeros(2, 8), None, torch.zeros(2, 3), torch.arange(3), torch.zeros(2, 2, dtype=torch.bool)
        )


# (temperature, top_k, top_p, min_p)
SAMPLE_RULES = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.95, 0.0), (0.8, 20, 0.9, 0.05), (1.3, 5, 1.0, 0.0), (0.5, 0, 0.5, 0.1)]
SAMPLE_RULES += [(1.0, 0, 0.99, 0.0), (2.0, 3, 1.0, 0.2), (1.0, 400, 0.8, 0.0)]


@pytest.mark.parametrize("rule", SAMPLE_RULES)
def test_the_sampled_pick_is_build_laws_law_and_draws_from_it(rule: tuple[float, int, float, float]) -> None:
    """``sampled_pick`` applies temperature, top-k, top-p and min-p as ``build_laws`` does: the
    same support and the same law up to fp32 rounding (rows of a few to ~33k columns, partial
    vectors, -inf columns, ties, a row whose nucleus is one token), and the column it picks is
    the inverse CDF of the law it returns at its uniform (the token is drawn from that law)."""
    from verispec.kernels import load

    gen = torch.Generator().manual_seed(11)
    t, k, p, min_p = rule
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)] * 4
    for w in (3, 17, 301, 33000):
        x = (4 * torch.randn(4, w, generator=gen)).to(torch.bfloat16).float()
        x[1, ::7] = float("-inf")
        x[2] = x[2].round()  # ties
        x[3, 0] = 40.0  # one token holds the mass
        want = build_laws(x, params).probs
        u = torch.rand(4, dtype=torch.float64, generator=gen)
        column, law, ok = load().sampled_pick(x, torch.tensor([rule] * 4, dtype=torch.float64), u)
        assert bool(ok.all())
        assert torch.equal(law > 0, want > 0), (w, rule)
        torch.testing.assert_close(law, want, rtol=2e-6, atol=1e-7)
        cdf = law.double().cumsum(1)
        assert torch.equal(column, torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0])


def test_the_sampled_pick_has_no_law_where_build_laws_has_none() -> None:
    """A NaN (in a whole vector or the last columns), +inf, every score -inf, or a temperature so
    low that the largest score overflows: no law (ok False, column -1, a zero law); u just below 1
    picks the last column of positive mass, never one of mass 0."""
    from verispec.kernels import load

    x = torch.randn(5, 40)
    x[0, 3], x[1, 38], x[2, 7], x[3] = float("nan"), float("nan"), float("inf"), float("-inf")
    x[4] = 1e30
    rules = torch.tensor([[1.0, 0, 1.0, 0.0]] * 4 + [[1e-10, 0, 1.0, 0.0]], dtype=torch.float64)
    column, law, ok = load().sampled_pick(x, rules, torch.full((5,), 0.5, dtype=torch.float64))
    assert not bool(ok.any()) and bool((column == -1).all()) and not bool(law.any())
    x = torch.tensor([[0.0, 1.0, float("-inf"), float("-inf")]])
    column, _, _ = load().sampled_pick(x, torch.tensor([[1.0, 0, 1.0, 0.0]], dtype=torch.float64),
                                        torch.tensor([1 - 2**-53], dtype=torch.float64))  # fmt: skip
    assert column.tolist() == [1]


def test_the_sampled_pick_refuses_what_it_cannot_read() -> None:
    from verispec.kernels import load

    ops = load()
    x, u = torch.zeros(2, 8), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.sampled_pick(x.bfloat16(), torch.ones(2, 4, dtype=torch.float64), u)
    with pytest.raises(RuntimeError, match=r"\[A, 4\] float64"):
        ops.sampled_pick(x, torch.ones(2, 3, dtype=torch.float64), u)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.sampled_pick(x, torch.tensor([[1.0, 0, 1.5, 0.0]] * 2, dtype=torch.float64), u)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        ops.sampled_pick(x, torch.tensor([[0.0, 0, 1.0, 0.0]] * 2, dtype=torch.float64), u)


def test_a_projection_runs_without_pythons_lock() -> None:
    """The kernels' entry points release the GIL (``py::call_guard``): while one thread is inside
    a projection of ~0.1 s or more, another thread's Python keeps running (what keeps a server's
    event loop answering while the engine computes). Held, the other thread would stop for the
    whole call; released, its longest pause is a scheduler's slice."""
    import itertools
    import threading
    import time

    from verispec.kernels import load

    ops = load()
    gen = torch.Generator().manual_seed(3)
    n = k = 2048
    packed = ops.bf16_pack(torch.randn(n, k, generator=gen).to(torch.bfloat16))
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16)
    start = time.perf_counter()
    ops.bf16_linear(x, packed, n, k, None)
    rows = int(64 * max(1.0, 0.15 / (time.perf_counter() - start)))  # a call of ~0.15 s
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    span: list[float] = []

    def call() -> None:
        span.append(time.perf_counter())
        ops.bf16_linear(x, packed, n, k, None)
        span.append(time.perf_counter())

    ticks: list[float] = []
    worker = threading.Thread(target=call)
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    begin, end = span
    inside = [begin, *(t for t in ticks if begin < t < end), end]
    longest = max(b - a for a, b in itertools.pairwise(inside))
    assert longest < 0.5 * (end - begin), (longest, end - begin, len(inside))


def test_layer_ops_split_over_threads_equal_one_thread() -> None:
    """The activation quantisation (by blocks, with a Q4_K input padded to whole super-blocks too),
    SwiGLU (by columns), RMSNorm and RoPE (by rows) split their work over threads once it is large
    enough: the same bits as on one thread, and the quantisation still equal to its reference."""
    from verispec.kernels import Int8Linear, Q4KLinear, load

    kernels = load()
    gen = torch.Generator().manual_seed(4)
    lin8 = Int8Linear.from_weight(torch.randn(48, 8960, generator=gen))
    lin4 = Q4KLinear.from_blocks(q4k_blocks(48, 8960, seed=4), 48, 8960, None)
    padded = Q4KLinear.from_weight(torch.randn(32, 8928, generator=gen) * 0.1)  # inputs padded to 8960
    xs = [torch.randn(m, 8960, generator=gen).to(torch.bfloat16) for m in (1, 3, 8)]
    gate_up = [(4 * torch.randn(m, 2 * 9000, generator=gen)).to(torch.bfloat16) for m in (1, 8)]  # a last piece of 40
    h, delta = (torch.randn(8, 1536, generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(1536, generator=gen).to(torch.bfloat16)
    x_rope, cos, sin = (torch.randn(8, n, generator=gen).to(torch.bfloat16) for n in (1536, 128, 128))

    def run() -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for x in xs:
            out += [*kernels.w8a8_quantize(x), lin8(x), lin4(x), padded(x[:, :8928])]
        out += [kernels.silu_mul(gu[:, :9000], gu[:, 9000:]) for gu in gate_up]
        h_copy = h.clone()
        out += [kernels.rms_norm(h_copy, delta, w, 1e-6), h_copy, kernels.rotary(x_rope, cos, sin, 12, 128)]
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        torch.set_num_threads(4)
        split = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, split, strict=True))
    for x in xs:
        q, scale = kernels.w8a8_quantize(x)[:2]
        ref, ref_scale = w8a8_quantize_reference(x.float())
        assert torch.equal(q, ref.to(torch.int8)) and torch.equal(scale, ref_scale)


def test_fused_projections_equal_the_parts() -> None:
    from verispec.kernels import Bf16Linear, Int8Linear, Q4KLinear
    from verispec.kernels.linear import fuse_linears

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    sizes = (32, 16, 20)
    for make in (
        lambda n, b: Bf16Linear.from_weight(torch.randn(n, 256, generator=gen), b),
        lambda n, b: Int8Linear.from_weight(torch.randn(n, 256, generator=gen), b),
        lambda n, b: Q4KLinear.from_blocks(q4k_blocks(n, 256, seed=n), n, 256, b),
    ):
        parts = [make(n, torch.randn(n, generator=gen) if i != 1 else None) for i, n in enumerate(sizes)]
        fused = fuse_linears(parts)
        assert fused is not None and fused.out_features == sum(sizes)
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))
    mixed = [Bf16Linear.from_weight(torch.randn(16, 256)), Int8Linear.from_weight(torch.randn(16, 256))]
    assert fuse_linears(mixed) is None  # different kinds
    assert (
        fuse_linears([Bf16Linear.from_weight(torch.randn(20, 256)), Bf16Linear.from_weight(torch.randn(16, 256))])
        is None
    )


@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_the_amx_attention_scores_are_the_bf16_dot_products_in_amx_order(d: int) -> None:
    """The amx tier's attention scores (csrc/amx/attention_tiles.cpp): each query row's dot
    products with the keys in TDPBF16PS's order (the bf16 kernel's reference), bit for bit, with
    several query tiles and key counts that end inside a tile. Other tiers refuse the call."""
    from verispec.kernels.linear import reference_bf16_linear

    kernels = require_kernels()
    gen = torch.Generator().manual_seed(d)
    q = (2 * torch.randn(40, d, generator=gen)).to(torch.bfloat16)
    k = (2 * torch.randn(83, d, generator=gen)).to(torch.bfloat16)
    if kernels.tier() != "amx" or not kernels.amx_available():
        with pytest.raises(RuntimeError, match="need the amx tier"):
            kernels.attention_scores(q, k)
        return
    for m, n in ((1, 1), (6, 16), (17, 83), (40, 50)):
        assert torch.equal(kernels.attention_scores(q[:m], k[:n]), reference_bf16_linear(q[:m], k[:n], order="amx"))


# (batch, new tokens, query heads, key/value heads, head size, span): head sizes with unrolled loops
# (64, 128, 256) and without (16, 48: a last block of 16 columns); up to 9 query heads per key/value
# head (more than the kernel attends together) and groups that a split of the rows cuts; on the amx
# tier (scores on tiles for head sizes 32 to 128) more than 16 rows per key/value head (several
# query tiles) and spans that end inside a block of 16 keys
ATTENTION_SHAPES = [
    (1, 1, 12, 2, 128, 70),
    (1, 5, 12, 2, 128, 40),
    (2, 8, 12, 2, 128, 75),
    (1, 5, 8, 1, 32, 41),
    (2, 3, 4, 2, 64, 37),
    (1, 2, 9, 1, 256, 20),
    (2, 2, 6, 3, 48, 25),
    (1, 3, 14, 2, 16, 33),
    (3, 1, 5, 5, 128, 18),
]


def attention_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    b, t, h, hkv, d, span = shape
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(b, t, h, d, generator=gen)).to(dtype)
    k = (2 * torch.randn(b, hkv, span, d, generator=gen)).to(dtype)
    v = torch.randn(b, hkv, span, d, generator=gen).to(dtype)
    visible = torch.rand(b, t, span, generator=gen) < 0.8
    visible[..., 0] = True
    if b * t > 1:
        visible[-1, -1, :] = False  # a row that sees nothing: zeros
    return q, k, v, visible


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_is_softmax_attention(kernels: object, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Against float64 softmax attention over the visible keys, each query head on its key/value head."""
    q, k, v, visible = attention_inputs(shape, dtype, seed=sum(shape))
    d, group = shape[4], shape[2] // shape[3]
    got = kernels.attention_rows(q, k, v, visible, d**-0.5)  # type: ignore[attr-defined]
    kk, vv = (x.double().repeat_interleave(group, dim=1) for x in (k, v))  # [B, H, span, D]
    scores = torch.einsum("bthd,bhsd->bths", q.double(), kk) * d**-0.5
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    expect = torch.einsum("bths,bhsd->bthd", torch.softmax(scores, -1).nan_to_num(0.0), vv)
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), expect, atol=tol, rtol=tol)
    if shape[0] * shape[1] > 1:
        assert (got[-1, -1] == 0).all()


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_attention_depends_on_its_visible_keys_in_order_not_on_where_they_lie(
    kernels: object, d: int, dtype: torch.dtype
) -> None:
    """A token tree verified in one pass: each node sees the prompt and its ancestors, which lie
    among the other nodes; decoding the same path as a chain puts the same keys and values side by
    side. Each node's output must be the chain's last row, bit for bit (greedy tree speculation
    equals plain decoding), while the other nodes, which see other keys, share its pass. (Paths
    cross a block of 16 positions in one layout and not in the other; bf16 outputs hide most fp32
    differences, so 40 draws: a kernel that summed by position failed about 1 node in 70.)"""
    heads, kv_heads, prompt, span = 12, 2, 44, 60
    parents = [-1, 0, 0, 1, 2, 2, 3, 5, 4, 8, 7]  # nodes at positions prompt, prompt + 1, ...
    t = len(parents)
    paths = []
    for node in range(t):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths.append(path)
    visible = torch.zeros(1, t, span, dtype=torch.bool)
    for node, path in enumerate(paths):
        visible[0, node, :prompt] = True
        visible[0, node, [prompt + p for p in path]] = True
    attend = kernels.attention_rows  # type: ignore[attr-defined]
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        q = (2 * torch.randn(1, t, heads, d, generator=gen)).to(dtype)
        k = (2 * torch.randn(1, kv_heads, span, d, generator=gen)).to(dtype)
        v = torch.randn(1, kv_heads, span, d, generator=gen).to(dtype)
        tree = attend(q, k, v, visible, d**-0.5)
        for node, path in enumerate(paths):
            order = list(range(prompt)) + [prompt + p for p in path]  # the chain's cache: the path after the prompt
            everything = torch.ones(1, 1, len(order), dtype=torch.bool)
            chain = attend(q[:, node : node + 1], k[:, :, order], v[:, :, order], everything, d**-0.5)
            assert torch.equal(chain[0, 0], tree[0, node]), (seed, node)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp32 outputs show every rounding
def test_attention_rows_do_not_depend_on_the_other_rows(
    kernels: object, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Each new token's rows equal a call with that token alone, each batch row a call with it alone, and
    each query head a call with that head alone on its key/value head, bit for bit (the kernel attends
    several query heads together: that must not change a bit)."""
    q, k, v, visible = attention_inputs(shape, dtype, seed=7)
    attend = kernels.attention_rows  # type: ignore[attr-defined]
    whole = attend(q, k, v, visible, 0.1)
    group = shape[2] // shape[3]
    for h in range(q.shape[2]):
        kv = slice(h // group, h // group + 1)
        assert torch.equal(attend(q[:, :, h : h + 1], k[:, kv], v[:, kv], visible, 0.1), whole[:, :, h : h + 1]), h
    for t in range(q.shape[1]):
        assert torch.equal(attend(q[:, t : t + 1], k, v, visible[:, t : t + 1], 0.1), whole[:, t : t + 1])
    for b in range(q.shape[0]):
        assert torch.equal(attend(q[b : b + 1], k[b : b + 1], v[b : b + 1], visible[b : b + 1], 0.1), whole[b : b + 1])
