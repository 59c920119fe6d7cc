"""The int4 (GGUF Q4_K, exact) and int8 (per channel) AMX kernels: lossless packing, results equal
to ``x_bf16 @ W_exact`` up to fp32 rounding for any number of rows, batch invariance, and the
errors a machine without the instructions gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels import q4k_blocks, require_kernels
from verispec.errors import ConfigError
from verispec.models.quants import dequantize

gq = pytest.importorskip("gguf.quants")

ROWS = (1, 3, 16, 21, 40)  # 21 and 40: more than one 16-row chunk, the last one partial


@pytest.fixture(scope="module", autouse=True)
def kernels() -> object:
    return require_kernels()


def exact_weights(blocks: np.ndarray, n: int, k: int) -> torch.Tensor:  # [n, k] fp32, gguf-py's reference
    return torch.from_numpy(gq.dequantize(blocks, gq.GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # fp64
    y = x.to(torch.bfloat16).double() @ w.double().T
    return y if bias is None else y + bias.double()


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


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [True, False])
def test_q4k_matches_the_exact_weights(m: int, bias: bool) -> None:
    from verispec.kernels import Q4KLinear

    n, k = 72, 768  # 72: the last 16-row block is partial
    blocks = q4k_blocks(n, k, seed=1)
    gen = torch.Generator().manual_seed(m)
    b = torch.randn(n, generator=gen) if bias else None
    lin = Q4KLinear.from_blocks(blocks, n, k, b)
    x = torch.randn(m, k, generator=gen)
    ref = reference(x, exact_weights(blocks, n, k), b)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel_err(y, ref) < 2e-6  # fp32 rounding of sums of 768 terms
    yb = lin(x.to(torch.bfloat16))  # bf16 in, bf16 out: the fp32 result rounded once
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


@pytest.mark.parametrize("m", ROWS)
def test_int8_matches_its_weights(m: int) -> None:
    from verispec.kernels import Int8Linear

    n, k = 40, 96  # k % 64 == 32: the single-step tail
    gen = torch.Generator().manual_seed(m)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    lin = Int8Linear.from_weight(w, b)
    codes, scale = lin.codes(), lin.int8_scale[:n]
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert torch.equal(lin.dequantize(), codes.float() * scale[:, None])
    assert ((lin.dequantize() - w).abs() <= scale[:, None] * (0.5 + 1e-5)).all()  # one rounding
    x = torch.randn(m, k, generator=gen)
    assert rel_err(lin(x), reference(x, lin.dequantize(), b)) < 2e-6


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
    from verispec.kernels import Int8Linear, Q4KLinear

    with pytest.raises(ValueError, match="256"):
        Q4KLinear(torch.zeros(10, dtype=torch.uint8), 16, 100)
    with pytest.raises(ValueError, match="uint8 bytes"):
        Q4KLinear(torch.zeros(10, dtype=torch.uint8), 16, 256)
    with pytest.raises(ValueError, match=r"multiple|% 32"):
        Int8Linear.from_weight(torch.randn(16, 40))
    lin = Q4KLinear.from_blocks(q4k_blocks(16, 256), 16, 256)
    with pytest.raises(RuntimeError, match=r"\[M, 256\]"):
        lin(torch.randn(2, 128))


def test_a_cpu_without_the_instructions_gets_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.kernels import build
    from verispec.models.loader import check_precision

    monkeypatch.setattr(build._STATE, "module", None)
    monkeypatch.setattr(build, "missing_cpu_features", lambda: ["amx_tile", "amx_bf16"])
    for call in (build.load, lambda: check_precision("int4", "cpu")):
        with pytest.raises(ConfigError, match=r"lacks amx_tile, amx_bf16: use --dtype bf16"):
            call()
    check_precision("bf16", "cpu")  # the dense precisions need nothing
    monkeypatch.setattr(build, "missing_cpu_features", lambda: [])
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(ConfigError, match=r"no C\+\+ compiler was found.*--dtype bf16"):
        build.load()
    with pytest.raises(ConfigError, match="CPU only"):
        check_precision("int8", "cuda")
