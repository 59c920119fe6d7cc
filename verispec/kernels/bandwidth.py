"""The memory read bandwidth the kernels can hope for, measured: :func:`read_bandwidth`."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.errors import ConfigError


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 7, buf: torch.Tensor | None = None) -> dict[str, float]:
    """GB/s of reading an ``nbytes`` buffer once with torch's threads: the kernels' ``stream_read``
    (64-byte loads with the kernels' prefetch, vectorised for this CPU's tier), or torch's sum where
    the kernels do not build; ``{"median": ..., "best": ...}`` over ``reps`` reads after a warm-up.
    ``buf``: a contiguous float32 buffer to read instead (``nbytes`` ignored), for repeated probes."""
    if buf is None:
        buf = torch.ones(max(nbytes // 4, 64), dtype=torch.float32)
    try:
        from verispec.kernels.build import load

        reader = load().stream_read
        read = lambda: reader(buf)  # noqa: E731
    except ConfigError:
        read = buf.sum
    read()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        read()
        times.append(time.perf_counter() - start)
    return {"median": buf.nbytes / statistics.median(times) / 1e9, "best": buf.nbytes / min(times) / 1e9}
