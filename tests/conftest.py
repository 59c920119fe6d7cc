"""Test-session settings shared by every test.

Under pytest-xdist each worker gets its share of the CPU's cores for torch (and the kernels'
OpenMP regions, and the CLI subprocesses the tests start): two workers that each spin two threads
on a 2-core machine run an engine case 6x slower than one worker alone.
"""

from __future__ import annotations

import os


def _threads_per_worker() -> int | None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(workers)))


_THREADS = _threads_per_worker()
if _THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)  # (read when torch is imported, here and in subprocesses)


def pytest_configure(config: object) -> None:
    if _THREADS is not None:
        import torch

        torch.set_num_threads(_THREADS)
