"""Helpers for tests of the int4 / int8 kernels: skip where they cannot run, synthetic Q4_K blocks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest


def require_kernels() -> Any:
    """The compiled kernel module; skips the test (with the reason) on a machine without AVX-512
    BF16 / AMX, a C++ compiler or ninja. A failing build on a capable machine fails the test.

    Call it before anything points ``$VERISPEC_HOME`` elsewhere (e.g. from a module-scoped
    fixture): the build is cached under the home of the first load, and one build per test
    session is enough."""
    from torch.utils.cpp_extension import is_ninja_available

    from verispec.kernels import build

    missing = build.missing_cpu_features()
    if missing:
        pytest.skip(f"the int4/int8 kernels need AVX-512 BF16 and AMX; this CPU lacks {', '.join(missing)}")
    if build.compiler() is None:
        pytest.skip("no C++ compiler to build the int4/int8 kernels (install g++ >= 11)")
    if not is_ninja_available():
        pytest.skip("ninja is not installed (pip install ninja): the int4/int8 kernels cannot be built")
    return build.load()


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
