"""CPU kernels for quantised linear layers: GGUF Q4_K weights used exactly, and per-channel int8.

Activations are quantised to int8 in blocks of 64 inputs (like llama.cpp's Q8 activations), the
products are summed exactly in int32 (AVX512-VNNI, or AMX for many rows) and scaled in fp32, and a
pass over 1 to 16 tokens costs about what one token costs (the weights are read once per call),
which keeps speculative verification cheap; row ``i`` of a call does not depend on the other
rows, bit for bit. The C++ sources (``csrc/``) compile on first use and are cached under
``$VERISPEC_HOME/kernels`` (:mod:`verispec.kernels.build`); they need an x86-64 CPU with AVX-512
BF16 / VNNI and AMX (:func:`cpu_supported`), a C++ compiler (g++ >= 11) and ninja, and raise
:class:`~verispec.errors.ConfigError` with the remedy otherwise.

    from verispec.kernels import Q4KLinear, Int8Linear
    q4 = Q4KLinear.from_blocks(blocks, n, k, bias)   # GGUF Q4_K bytes [n, k/256*144] uint8
    i8 = Int8Linear.from_weight(w)                   # w [n, k] float, quantised per row
    y = q4(x)                                        # x [..., k] bf16/fp32 -> [..., n], same dtype
"""

from verispec.kernels.build import cpu_supported, load, missing_cpu_features
from verispec.kernels.linear import Int8Linear, Q4KLinear, q4k_packed_numel, quantize_int8

__all__ = [
    "Int8Linear",
    "Q4KLinear",
    "cpu_supported",
    "load",
    "missing_cpu_features",
    "q4k_packed_numel",
    "quantize_int8",
]
