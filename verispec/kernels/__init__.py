"""CPU kernels for linear layers: GGUF Q4_K weights used exactly, per-channel int8, and bf16.

Activations are quantised to int8 in blocks of 64 inputs (like llama.cpp's Q8 activations), the
products are summed exactly in int32 (AVX512-VNNI, or AMX for many rows) and scaled in fp32, and a
pass over 1 to 16 tokens costs about what one token costs (the weights are read once per call),
which keeps speculative verification cheap; row ``i`` of a call does not depend on the other
rows, bit for bit. The C++ sources (``csrc/``) compile on first use and are cached under
``$VERISPEC_HOME/kernels`` (:mod:`verispec.kernels.build`); they need an x86-64 CPU with AVX-512
BF16 / VNNI and AMX (:func:`cpu_supported`), a C++ compiler (g++ >= 11) and ninja, and raise
:class:`~verispec.errors.ConfigError` with the remedy otherwise.

:class:`Bf16Linear` is the bf16 precision's projection on those CPUs: bf16 weights times bf16
activations on AMX with fp32 sums, read at close to memory bandwidth, flat from 1 to 16 rows and
batch-invariant like the others. The rest of a decoder layer has kernels too (``attention_rows``:
attention one query row at a time; ``rms_norm`` with the residual add, ``rotary``, ``silu_mul``),
each computing a row from that row alone in a fixed order; with them
:class:`~verispec.models.transformer.Transformer` built with ``cpu_kernels=True`` makes a whole forward pass
batch-invariant (the loader applies it to bf16, int8 and int4 models on such CPUs).

    from verispec.kernels import Q4KLinear, Int8Linear, Bf16Linear
    q4 = Q4KLinear.from_blocks(blocks, n, k, bias)   # GGUF Q4_K bytes [n, k/256*144] uint8
    i8 = Int8Linear.from_weight(w)                   # w [n, k] float, quantised per row
    b16 = Bf16Linear.from_weight(w)                  # w [n, k] bf16, repacked (no rounding)
    y = q4(x)                                        # x [..., k] bf16/fp32 -> [..., n], same dtype
"""

from verispec.kernels.build import cpu_supported, load, missing_cpu_features
from verispec.kernels.linear import (
    Bf16Linear,
    Int8Linear,
    Q4KLinear,
    q4k_packed_numel,
    quantize_int8,
    reference_bf16_linear,
)

__all__ = [
    "Bf16Linear",
    "Int8Linear",
    "Q4KLinear",
    "cpu_supported",
    "load",
    "missing_cpu_features",
    "q4k_packed_numel",
    "quantize_int8",
    "reference_bf16_linear",
]
