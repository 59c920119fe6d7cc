"""Test-session settings shared by every test.

``VERISPEC_HUGE_PAGES`` is put back as the session found it after every test: ``verispec serve``
run in-process (a live server fixture) sets it (a server moves its weights onto huge pages), which
would make every later load in that worker copy its weights.

Under pytest-xdist each worker gets its share of the CPU's cores for torch (and the kernels'
OpenMP regions, and the CLI subprocesses the tests start): two workers that each spin two threads
on a 2-core machine run an engine case 6x slower than one worker alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


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


_HUGE_PAGES = "VERISPEC_HUGE_PAGES"  # (verispec.kernels.hugepages.HUGE_PAGES_ENV; importing it imports torch)
_HUGE_PAGES_AT_START = os.environ.get(_HUGE_PAGES)


@pytest.fixture(autouse=True)
def _huge_pages_setting_restored() -> Iterator[None]:
    yield
    if _HUGE_PAGES_AT_START is None:
        os.environ.pop(_HUGE_PAGES, None)
    else:
        os.environ[_HUGE_PAGES] = _HUGE_PAGES_AT_START
