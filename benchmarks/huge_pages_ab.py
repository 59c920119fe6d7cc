"""Weights on transparent huge pages against torch's small pages, side by side in one process.

Loads each model of the default pair twice, once with its packed weights moved to huge pages
(``VERISPEC_HUGE_PAGES=1``, :mod:`verispec.kernels.hugepages`) and once as loaded by default
(mapped from the packed cache file, or torch's allocation for what was computed at load: 4 KiB
pages unless the OS backs them otherwise), and times decode passes over T new
tokens after ``--context`` cached ones, the two copies in alternating order per round; before
that, the kernels' ``stream_read`` over ``--read-mib`` on each kind of page. Prints medians and
the ratio, with the machine's transparent-huge-page setting and how much anonymous memory the
kernel backed with huge pages. Outputs of the two copies are compared (they must be equal).

    python benchmarks/huge_pages_ab.py [--widths 1,5] [--rounds 30] [--context 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import verispec.kernels.hugepages as hugepages
from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from verispec.kernels import load


def thp_setting() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text().strip() if path.exists() else "unknown"


def anon_huge_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def read_gbs(buf: torch.Tensor, reps: int) -> float:
    reader = load().stream_read
    reader(buf)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        reader(buf)
        times.append(time.perf_counter() - start)
    return buf.nbytes / statistics.median(times) / 1e9


def load_both(spec: str, dtype: str) -> tuple[Any, Any]:
    """The model loaded with its weights moved to huge pages, and as loaded by default."""
    os.environ[hugepages.HUGE_PAGES_ENV] = "1"
    start = time.perf_counter()
    huge = load_model(spec, dtype=dtype).model  # type: ignore[arg-type]
    huge_s = time.perf_counter() - start
    os.environ[hugepages.HUGE_PAGES_ENV] = "0"
    start = time.perf_counter()
    small = load_model(spec, dtype=dtype).model  # type: ignore[arg-type]
    print(f"{spec} {dtype}: loaded in {huge_s:.2f} s with huge pages, {time.perf_counter() - start:.2f} s without")
    return huge, small


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-mib", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"### Huge pages against small: {machine_line()}; transparent huge pages: {thp_setting()}")

    nbytes = args.read_mib << 20
    small_buf = torch.ones(nbytes // 4, dtype=torch.float32)
    huge_buf = hugepages.huge_page_buffer(nbytes).view(torch.float32)
    huge_buf.fill_(1.0)
    reads: dict[str, list[float]] = {"small": [], "huge": []}
    for _ in range(8):
        reads["small"].append(read_gbs(small_buf, 5))
        reads["huge"].append(read_gbs(huge_buf, 5))
    print(f"stream_read {args.read_mib} MiB, 8 rounds, GB/s: small {' '.join(f'{x:.1f}' for x in reads['small'])}; "
          f"huge {' '.join(f'{x:.1f}' for x in reads['huge'])}")  # fmt: skip
    del small_buf, huge_buf

    print("| model | T | small pages ms | huge pages ms | small / huge |\n|---|---|---|---|---|")
    for spec, dtype in ((DEFAULT_TARGET, "int4"), (DEFAULT_DRAFT, "int4-all")):
        models = dict(zip(("huge", "small"), load_both(spec, dtype), strict=True))
        vocab = models["huge"].config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
        caches = {}
        for name, model in models.items():
            caches[name] = model.new_cache(1, args.context + max(widths))
            model(prompt, None, caches[name], logits_at=torch.tensor([[args.context - 1]]))
        times: dict[tuple[str, int], list[float]] = {(n, t): [] for n in models for t in widths}
        for r in range(args.rounds + 1):
            for t in widths:
                tokens = torch.randint(0, vocab, (1, t), generator=gen)
                outs = {}
                for name in list(models) if r % 2 else list(models)[::-1]:
                    model, cache = models[name], caches[name]
                    start = time.perf_counter()
                    outs[name] = model(tokens, None, cache)
                    elapsed = time.perf_counter() - start
                    cache.truncate([args.context], [0])
                    if r:  # (round 0 warms up)
                        times[(name, t)].append(elapsed)
                assert torch.equal(outs["huge"], outs["small"]), "the two copies disagree"
        for t in widths:
            small, huge = (statistics.median(times[(n, t)]) * 1e3 for n in ("small", "huge"))
            print(f"| {spec} {dtype} | {t} | {small:.2f} | {huge:.2f} | **{small / huge:.2f}** |")
        del models, caches
    print(f"anonymous memory on huge pages at the end: {anon_huge_mib():.0f} MiB")


if __name__ == "__main__":
    main()
