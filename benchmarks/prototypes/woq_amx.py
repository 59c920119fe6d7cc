"""Prototype: weight-only-quantised linear layers (GGUF Q4_K, per-channel int8) for x86 CPUs whose
cost stays flat from M = 1 to M = 16 tokens per pass.

Why: speculative verification of K draft tokens runs the target over M = K + 1 tokens; it costs
about one decode step only while the linear layers stay memory-bound. torch's weight-only int8/int4
CPU ops (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) are fast at M = 1 but their cost
grows ~linearly with M; bf16 ``F.linear`` is flat (oneDNN uses AMX) but reads 3.6x the bytes of
a Q4_K weight.

How (details in ``woq_amx.cpp``): each 16-row x 32-input weight tile is dequantised ONCE per call
in AVX-512 registers and multiplied against all M <= 16 activation rows with one AMX TDPBF16PS.
For Q4_K the B tile holds the raw 4-bit codes (exact in bf16) and the fp32 sub-block scales and
mins are applied per sub-block in the epilogue, so the weights are used exactly (no bf16
rounding, no re-quantisation: the packing is a byte permutation of the GGUF blocks, same size).
Activations are rounded to bf16; accumulation is fp32. The AMX kernels are batch-invariant: row i
of an M-row call equals the 1-row call on row i, bit for bit, for every M (so a verification pass
and a decode step compute identical logits rows); "avx512" is invariant only among calls with the
same M.

Kernels (``Q4KLinear.__call__(x, kernel=...)``):
    "amx"     exact Q4_K, AMX, M <= 16 per call - flat in M (the recommended verification path)
    "avx512"  exact Q4_K, AVX512-BF16 VDPBF16PS, no AMX - fastest at M = 1, grows with M;
              the fallback for AVX512-BF16 CPUs without AMX
    "auto"    "avx512" for M = 1 and "amx" above (fastest; M = 1 rows then differ from the rows
              of M > 1 calls in the last bits - see the report)
    "amx_bf16w"  alternative design: bf16-rounded Q4_K weights as the AMX A operand
``Int8Linear``: per-channel int8 (the format of ``torch._weight_int8pack_mm``), AMX.

Requirements: x86-64 Linux with AVX512F/BW/BF16 (+ AMX-BF16 for the AMX kernels: Intel Xeon 4th
gen "Sapphire Rapids" or newer); a C++ compiler (g++ >= 11) and ninja at FIRST use (the build,
~40-70 s, is cached by source hash under $VERISPEC_KERNEL_CACHE or ~/.cache/verispec/kernels).
Elsewhere: fall back to dequantise-to-bf16 + ``F.linear`` (see ``cpu_supported``).

    import woq_amx                                   # benchmarks/prototypes on sys.path
    lin = woq_amx.Q4KLinear(blocks, n, k, bias)      # blocks: GGUF Q4_K bytes [n, k/256*144] uint8
    y = lin(x)                                       # x [..., k] fp32/bf16 -> [..., n], same dtype
    python benchmarks/prototypes/woq_amx.py          # self-test against gguf-py's dequantiser
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("woq_amx.cpp")
# -fopenmp is required: at::parallel_for is an inline OpenMP region in the headers, and without it
# every kernel runs on one thread. (The extension then shares torch's bundled libgomp.so.1.)
_FLAGS = [
    "-O3",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mf16c",
    "-mfma",
    "-mamx-tile",
    "-mamx-bf16",
]


class _State:
    ext: ModuleType | None = None
    build_seconds: float | None = None  # wall time of the load() that built (or found) and imported it


_STATE = _State()


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_supported(amx: bool = True) -> bool:
    """True when this CPU has the instructions the kernels use (AMX ones when ``amx``)."""
    need = {"avx512f", "avx512bw", "avx512_bf16", "f16c"} | ({"amx_tile", "amx_bf16"} if amx else set())
    return need <= cpu_flags()


def load(build_dir: str | os.PathLike[str] | None = None, verbose: bool = False) -> ModuleType:
    """Compile (first time; cached in ``build_dir`` keyed by source and flags) and import the kernels."""
    if _STATE.ext is not None:
        return _STATE.ext
    from torch.utils.cpp_extension import load as _load

    build_dir = Path(
        build_dir or os.environ.get("VERISPEC_KERNEL_CACHE", Path.home() / ".cache" / "verispec" / "kernels")
    )
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    _STATE.ext = _load(
        name="verispec_woq_amx",
        sources=[str(_SOURCE)],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    _STATE.build_seconds = time.perf_counter() - t0
    return _STATE.ext


def build_seconds() -> float | None:
    """Wall time load() took (a first build compiles: ~40-80 s; later loads find the cache)."""
    return _STATE.build_seconds


def _chunked(fn, x: Tensor, n: int, max_m: int = 16) -> Tensor:
    """Applies a kernel that takes M <= max_m rows to x [..., K], max_m rows at a time."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= max_m:
        return fn(x2).reshape(*lead, n)
    return torch.cat([fn(x2[i : i + max_m]) for i in range(0, x2.shape[0], max_m)]).reshape(*lead, n)


class Q4KLinear:
    """A linear layer whose weight is GGUF Q4_K blocks, repacked for the kernels (same bytes)."""

    def __init__(
        self,
        blocks: Tensor,
        out_features: int,
        in_features: int,
        bias: Tensor | None = None,
        with_rows_layout: bool = False,
    ):
        ext, blocks = load(), blocks.contiguous()
        self.out_features, self.in_features = out_features, in_features
        self.packed = ext.pack_q4k(blocks, out_features, in_features)  # uint8 [N/16 * K/256 * 2304]
        # only for the alternative "amx_bf16w" kernel (a second copy; benchmarks only)
        self.packed_rows = ext.pack_q4k_rows(blocks, out_features, in_features) if with_rows_layout else None
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: Tensor, kernel: str = "amx") -> Tensor:  # [..., K] fp32/bf16 -> [..., N] same dtype
        ext = load()
        n, k, b = self.out_features, self.in_features, self.bias
        if kernel == "auto":
            kernel = "avx512" if x.numel() == k else "amx"
        if kernel == "amx":
            return _chunked(lambda x2: ext.q4k_linear_amx(x2, self.packed, n, k, b), x, n)
        if kernel == "avx512":
            return _chunked(lambda x2: ext.q4k_linear_avx512(x2, self.packed, n, k, b), x, n, max_m=8)
        if kernel == "amx_bf16w":
            assert self.packed_rows is not None, "construct with with_rows_layout=True"
            return _chunked(lambda x2: ext.q4k_linear_amx_bf16w(x2, self.packed_rows, n, k, b), x, n)
        raise ValueError(f"unknown kernel {kernel!r}")

    def dequantize(self) -> Tensor:  # [N, K] fp32: the exact weights the kernels multiply by
        return load().q4k_dequant(self.packed, self.out_features, self.in_features)


class Int8Linear:
    """Per-output-channel symmetric int8 weight (w = scale[n] * q[n, k]), repacked for AMX."""

    def __init__(self, q: Tensor, scales: Tensor, bias: Tensor | None = None):
        self.packed = load().pack_int8(q)  # int8 [N*K]
        self.scales = scales.float().contiguous()  # [N]
        self.out_features, self.in_features = q.shape
        self.bias = None if bias is None else bias.float().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        ext = load()
        return _chunked(lambda x2: ext.int8_linear_amx(x2, self.packed, self.scales, self.bias), x, self.out_features)


def _selftest(seed: int = 0) -> None:
    """Checks the kernels against gguf-py's reference dequantiser on random Q4_K blocks:
    packing is lossless (bit-identical fp32 weights), results match x_bf16 @ W in fp64 to fp32
    rounding, and every kernel is batch-invariant."""
    import numpy as np
    from gguf.quants import GGMLQuantizationType, dequantize

    gen = torch.Generator().manual_seed(seed)
    n, k = 64, 512
    blocks = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n * k // 256, 2, generator=gen) + 0.5) * 2.0**-8
    blocks[:, 0:4] = d.to(torch.float16).view(torch.uint8)
    blocks = blocks.reshape(n, -1)
    ref = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType.Q4_K).astype(np.float32))
    lin = Q4KLinear(blocks, n, k, bias=torch.randn(n, generator=gen), with_rows_layout=True)
    assert torch.equal(lin.dequantize(), ref), "packed weights differ from gguf-py's dequantisation"
    kernels = ["amx", "avx512", "amx_bf16w"] if cpu_supported(amx=True) else ["avx512"]
    for m in (1, 3, 16, 21):
        x = torch.randn(m, k, generator=gen)
        exact = x.to(torch.bfloat16).double() @ ref.double().T + lin.bias.double()
        for kern in kernels:
            y = lin(x, kern)
            rel = ((y.double() - exact).abs().max() / exact.abs().max()).item()
            tol = 4e-3 if kern == "amx_bf16w" else 1e-5  # bf16-rounded weights vs exact
            assert rel < tol, (kern, m, rel)
            rows = torch.cat([lin(x[i : i + 1], kern) for i in range(m)])
            same = torch.equal(y, rows)
            assert same or kern == "avx512", (kern, m, "not batch-invariant")
            print(f"M={m:2d} {kern:9s} max rel err {rel:.1e}  row-by-row identical: {same}")
    print("ok")


if __name__ == "__main__":
    _selftest()
