"""The memory read bandwidth the kernels can hope for, measured: :func:`read_bandwidth`."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.errors import ConfigError


def probe_buffer(nbytes: int) -> torch.Tensor:
    """A float32 buffer of about ``nbytes`` (ones) to read, on transparent huge pages where the OS
    gives them (:func:`verispec.kernels.hugepages.huge_page_buffer`): the memory at its best, as
    the weights read it where they are mapped by huge pages. On 4 KiB pages the same reads ran
    up to ~10% slower on the Intel Xeon with AMX (``benchmarks/results/file_pages_intel.md``), which
    would price the bandwidth floor too low."""
    from verispec.kernels.hugepages import huge_page_buffer

    return huge_page_buffer(4 * max(nbytes // 4, 64)).view(torch.float32).fill_(1.0)


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 7, buf: torch.Tensor | None = None) -> dict[str, float]:
    """GB/s of reading an ``nbytes`` buffer (:func:`probe_buffer`) once with torch's threads: the
    kernels' ``stream_read`` (64-byte loads with the kernels' prefetch, vectorised for this CPU's
    tier), or torch's sum where the kernels do not build; ``{"median": ..., "best": ...}`` over
    ``reps`` reads after a warm-up. ``buf``: a contiguous float32 buffer to read instead
    (``nbytes`` ignored), for repeated probes."""
    if buf is None:
        buf = probe_buffer(nbytes)
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
