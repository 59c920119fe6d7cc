"""GGML dequantisation in torch equals gguf's numpy reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf import quants as gq  # noqa: E402

from verispec.errors import InputError, UnsupportedModelError  # noqa: E402
from verispec.formats.dequant import FORMATS, SUPPORTED_TYPES, dequantize, dequantize_blocks  # noqa: E402

QUANTISED = [t for t in SUPPORTED_TYPES if t not in ("F32", "F16", "BF16")]


def random_blocks(type_name: str, n: int, seed: int = 0) -> np.ndarray:
    """n random blocks [n, type_size] uint8 whose float scale fields are finite."""
    rng = np.random.default_rng(seed)
    size = FORMATS[type_name].type_size
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def f16(k: int) -> np.ndarray:
        # Scales over the whole float16 range, subnormals included.
        return (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-7, 3, (n, k))).astype(np.float16).view(np.uint8)

    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        raw[:, 0:2] = f16(1)
    elif type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
        raw[:, 0:4] = f16(2)
    elif type_name == "Q6_K":
        raw[:, 208:210] = f16(1)
    elif type_name == "Q8_K":
        raw[:, 0:4] = rng.standard_normal((n, 1)).astype(np.float32).view(np.uint8)
    return raw


def reference(rows: np.ndarray, type_name: str) -> np.ndarray:
    if type_name == "Q8_K":  # not in gguf.quants; ggml's dequantize_row_q8_K: y = d * q
        blocks = rows.reshape(-1, 292)
        d = blocks[:, 0:4].copy().view(np.float32)
        return (d * blocks[:, 4:260].view(np.int8).astype(np.float32)).reshape(rows.shape[0], -1)
    return gq.dequantize(rows, GGMLQuantizationType[type_name]).astype(np.float32)


def same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    return np.array_equal(a.numpy().view(np.uint32), np.ascontiguousarray(b, dtype=np.float32).view(np.uint32))


def test_block_sizes_match_ggml() -> None:
    for name, fmt in FORMATS.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (fmt.block_size, fmt.type_size)


@pytest.mark.parametrize("type_name", QUANTISED)
def test_random_blocks_bit_exact(type_name: str) -> None:
    fmt = FORMATS[type_name]
    raw = random_blocks(type_name, 3000, seed=len(type_name))
    rows = raw.reshape(30, -1)  # 30 rows of 100 blocks
    shape = (30, 100 * fmt.block_size)
    # A chunk size that is not a multiple of the rows exercises the chunk seams.
    ours = dequantize(rows, type_name, shape, chunk_values=7 * fmt.block_size + 1)
    assert ours.shape == shape and ours.dtype == torch.float32
    assert same_bits(ours, reference(rows, type_name))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantised_real_values_round_trip(type_name: str) -> None:
    rng = np.random.default_rng(1)
    values = (rng.standard_normal((48, 256)) * np.exp(rng.standard_normal((48, 1)))).astype(np.float32)
    values[3] = 0.0  # all-zero block: d = 0
    qtype = GGMLQuantizationType[type_name]
    stored = gq.quantize(values, qtype)
    ours = dequantize(stored, type_name, values.shape)
    assert same_bits(ours, gq.dequantize(stored, qtype))
    # ... and it is a quantisation of values: error within a 4-bit step of each row's largest value.
    scale = torch.from_numpy(np.abs(values).max(axis=1, keepdims=True))
    assert bool(((ours - torch.from_numpy(values)).abs() <= scale / 7).all())


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_types(type_name: str) -> None:
    rng = np.random.default_rng(2)
    values = rng.standard_normal((8, 40)).astype(np.float32)
    if type_name == "F32":
        stored, expect = values, values
    elif type_name == "F16":
        stored = values.astype(np.float16)
        expect = stored.astype(np.float32)
    else:
        stored = gq.quantize(values, GGMLQuantizationType.BF16)
        expect = gq.dequantize(stored, GGMLQuantizationType.BF16)
    assert same_bits(dequantize(stored, type_name, (8, 40)), expect)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_narrow_dtype_is_one_rounding_of_fp32(dtype: torch.dtype) -> None:
    raw = random_blocks("Q6_K", 64).reshape(8, -1)
    fp32 = dequantize(raw, "Q6_K", (8, 2048))
    narrow = dequantize(raw, "Q6_K", (8, 2048), dtype=dtype, chunk_values=1000)
    assert narrow.dtype == dtype
    assert torch.equal(narrow, fp32.to(dtype))


def test_dequantize_blocks_shape_and_errors() -> None:
    raw = torch.from_numpy(random_blocks("Q4_K", 5))
    assert dequantize_blocks(raw, "Q4_K").shape == (5, 256)
    with pytest.raises(InputError, match="144"):
        dequantize_blocks(raw[:, :100], "Q4_K")
    with pytest.raises(InputError, match="bytes"):
        dequantize(np.zeros(100, np.uint8), "Q8_0", (1, 32))


@pytest.mark.parametrize("type_name", ["Q2_K", "IQ4_NL", "TQ1_0"])
def test_unsupported_type_names_type_and_supported_list(type_name: str) -> None:
    with pytest.raises(UnsupportedModelError, match=type_name) as info:
        dequantize(np.zeros(1024, np.uint8), type_name, (1, 256))
    assert "Q4_K" in str(info.value) and "Q6_K" in str(info.value)
