"""CPU kernels for a decoder layer: GGUF Q4_K weights used exactly, per-channel int8, and bf16,
plus attention, RMSNorm, RoPE and SwiGLU, in seven instruction-set tiers picked at load time.

Activations of the int8 and Q4_K projections are quantised to int8 in blocks of 64 inputs (like
llama.cpp's Q8 activations), the products are summed exactly in int32 and scaled in fp32, and a
pass over 1 to 16 tokens reads the weights once, which keeps speculative verification cheap; row
``i`` of a call does not depend on the other rows, bit for bit. The tiers
(:mod:`verispec.kernels.dispatch`): ``amx`` (Intel Xeon 4th gen+: AMX tiles for many rows and for
bf16), ``avx512bf16`` (AMD Zen 4/5: ``avx512`` with VDPBF16PS for bf16), ``avx512`` (AVX-512
VNNI: Intel Ice Lake+), ``avx2vnni`` (AVX2 + AVX-VNNI: Intel
Core 12th gen+ client CPUs), ``avx2`` (AVX2 + FMA: every x86-64 CPU of the last ten years), ``neon``
(AArch64 with the dot product extension: Graviton 2+, Ampere, Neoverse) and ``portable`` (plain
C++: any CPU); the fastest this CPU executes is used, ``$VERISPEC_ISA`` forces a lower one. int8
and int4 results are the same on every tier; bf16 is the same on all but amx and avx512bf16
(which add in AMX's order, or in VDPBF16PS's pairs). The C++ sources
(``csrc/``) compile on first use, one module per tier, cached under ``$VERISPEC_HOME/kernels``
(:mod:`verispec.kernels.build`); they need a C++ compiler (g++ >= 11) and ninja, and raise
:class:`~verispec.errors.ConfigError` with the remedy otherwise.

:class:`Bf16Linear` is the bf16 precision's projection: bf16 weights times bf16 activations with
fp32 sums, read at close to memory bandwidth and batch-invariant like the others. The rest of a
decoder layer has kernels too (``attention_rows``: attention one query row at a time;
``rms_norm`` with the residual add, ``rotary``, ``silu_mul``), each computing a row from that row
alone in a fixed order; with them :class:`~verispec.models.transformer.Transformer` built with
``cpu_kernels=True`` makes a whole forward pass batch-invariant (the loader applies it to bf16,
int8 and int4 models).

    from verispec.kernels import Q4KLinear, Int8Linear, Bf16Linear
    q4 = Q4KLinear.from_blocks(blocks, n, k, bias)   # GGUF Q4_K bytes [n, k/256*144] uint8
    i8 = Int8Linear.from_weight(w)                   # w [n, k] float, quantised per row
    b16 = Bf16Linear.from_weight(w)                  # w [n, k] bf16, repacked (no rounding)
    y = q4(x)                                        # x [..., k] bf16/fp32 -> [..., n], same dtype
"""

from verispec.kernels.build import load
from verispec.kernels.dispatch import ISA_ENV, TIER_NAMES, missing, runnable, selected
from verispec.kernels.linear import (
    Bf16Linear,
    Int8Linear,
    Q4KLinear,
    Q6KLinear,
    q4k_packed_numel,
    q6k_packed_numel,
    quantize_int8,
    reference_bf16_linear,
)

__all__ = [
    "ISA_ENV",
    "TIER_NAMES",
    "Bf16Linear",
    "Int8Linear",
    "Q4KLinear",
    "Q6KLinear",
    "load",
    "missing",
    "q4k_packed_numel",
    "q6k_packed_numel",
    "quantize_int8",
    "reference_bf16_linear",
    "runnable",
    "selected",
]
