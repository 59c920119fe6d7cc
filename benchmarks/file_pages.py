"""How a packed cache file's pages are mapped, and what that does to reading it.

A decode pass streams its weights from the mapping of a packed cache file (``int4.safetensors``
and so on); where the filesystem keeps large folios in the page cache (ext4 since Linux 6.16, XFS
since 5.18, ...) those pages can be 2 MiB folios mapped by huge pages, or 4 KiB pages, depending on
how they came into the cache. For one file (``--file``, else the default target's packed int4 file)
this measures, per way of getting its pages, the MiB that huge pages map (``FilePmdMapped`` in
``/proc/self/smaps``) and the kernels' ``stream_read`` GB/s over the mapping (median of ``--reps``,
the ways in turn per round):

- ``written unaligned`` / ``written aligned``: a copy of the file just written (so its pages are
  the writes' folios), unaligned as ``write_tensors`` used to write (header, then each tensor as
  it came) or in 2 MiB-aligned writes (``convert.AlignedWriter``), mapped without advice;
- ``read, no advice`` / ``read, MADV_HUGEPAGE``: the file evicted from the page cache
  (``POSIX_FADV_DONTNEED``) and read back by the mapping's page faults, without and with
  ``hugepages.advise_huge_pages`` (also: seconds to fault it all in);
- ``anonymous 4 KiB`` / ``anonymous huge``: copies in torch's memory and in a huge-page buffer.

With ``--passes N``, also N one-token passes of the default target (int4) after each eviction,
mapped without and with the advice, in turn (``--rounds`` times; medians).

    python benchmarks/file_pages.py [--reps 9] [--rounds 3] [--passes 30] [--threads 2] [--file F]
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import verispec.formats.convert as convert
from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_TARGET, load_model
from verispec.formats.registry import model_dir
from verispec.kernels.bandwidth import read_bandwidth
from verispec.kernels.hugepages import file_huge_mapped, huge_page_buffer


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mapped(path: Path, advise: bool) -> tuple[mmap.mmap, torch.Tensor]:
    """The file mapped as ``convert.load_safetensors`` maps it, as float32 words (whole 64 bytes)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if advise:
        convert.advise_huge_pages(mm)
    words = (len(mm) // 64) * 16
    return mm, torch.from_numpy(np.frombuffer(mm, dtype=np.float32, count=words))


def copy_file(src: Path, dst: Path, aligned: bool) -> None:
    data = memoryview(src.read_bytes())
    with open(dst, "wb") as f:
        if aligned:
            out = convert.AlignedWriter(f)
            out.write(data)
            out.close()
        else:  # the header's 8 + n bytes, then the rest in pieces of 64 MiB from there
            (n,) = np.frombuffer(data[:8], dtype=np.uint64)
            f.write(data[: 8 + int(n)])
            for at in range(8 + int(n), len(data), 64 << 20):
                f.write(data[at : at + (64 << 20)])
        f.flush()
        os.fsync(f.fileno())


@torch.inference_mode()
def pass_ms(passes: int, context: int = 128) -> float:
    """Median ms of ``passes`` one-token passes of the default int4 target after ``context`` cached
    tokens (the first three, which fault the weights in, left out)."""
    model = load_model(DEFAULT_TARGET, dtype="int4").model  # type: ignore[attr-defined]
    cache = model.new_cache(1, context + 1)
    model(torch.arange(context).view(1, -1) + 1000, None, cache, logits_at=torch.tensor([[context - 1]]))
    times = []
    for i in range(passes + 3):
        start = time.perf_counter()
        model(torch.tensor([[1000 + i]]), None, cache)
        times.append(time.perf_counter() - start)
        cache.truncate([context])
    del model, cache
    gc.collect()
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", type=Path, default=None, help="a packed cache file (default: the target's int4)")
    ap.add_argument("--reps", type=int, default=9, help="stream reads per way and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=0, help="one-token passes per arm (0: no passes)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.file is None or args.passes:
        load_model(DEFAULT_TARGET, dtype="int4")  # prepares and packs it where needed
        gc.collect()  # (and lets it go: a mapped file cannot be evicted)
    path = args.file or model_dir(DEFAULT_TARGET) / "int4.safetensors"
    print(f"### {path.name} ({path.stat().st_size / 2**20:.0f} MiB): {machine_line()}, {args.threads} threads")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'none'}; {os.uname().release}")

    results: dict[str, list[float]] = {}
    huge: dict[str, float] = {}
    touch: dict[str, list[float]] = {}

    def measure(name: str, t: torch.Tensor) -> None:
        results.setdefault(name, []).append(read_bandwidth(reps=args.reps, buf=t)["median"])
        if name.startswith(("written", "read")):
            huge[name] = (file_huge_mapped(t.data_ptr()) or 0) / 2**20

    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".file-pages-") as tmp:
        for _ in range(args.rounds):  # each way's mapping is gone before the next one's starts
            for name in ("written unaligned", "written aligned"):
                copy = Path(tmp) / name.split()[1]
                copy.unlink(missing_ok=True)
                copy_file(path, copy, aligned=name == "written aligned")
                measure(name, mapped(copy, advise=False)[1])
            for name, advise in (("read, no advice", False), ("read, MADV_HUGEPAGE", True)):
                gc.collect()
                evict(path)
                t = mapped(path, advise)[1]
                start = time.perf_counter()
                t.sum()
                touch.setdefault(name, []).append(time.perf_counter() - start)
                measure(name, t)
                del t
            small = torch.from_numpy(np.fromfile(path, dtype=np.uint8)[: (path.stat().st_size // 64) * 64])
            measure("anonymous 4 KiB", small.view(torch.float32))
            big = huge_page_buffer(small.nbytes)
            big.copy_(small)
            del small
            measure("anonymous huge", big.view(torch.float32))
            del big
            gc.collect()
    print("| pages | MiB on huge pages | stream_read GB/s (median of rounds) | first touch s |")
    print("|---|---|---|---|")
    for name, gbs in results.items():
        t = f"{statistics.median(touch[name]):.2f}" if name in touch else ""
        h = f"{huge[name]:.0f}" if name in huge else ("all" if name == "anonymous huge" else "")
        print(f"| {name} | {h} | {statistics.median(gbs):.1f} ({', '.join(f'{g:.1f}' for g in gbs)}) | {t} |")

    if args.passes:
        arms: dict[str, list[float]] = {"no advice": [], "MADV_HUGEPAGE": []}
        real = convert.advise_huge_pages  # (the name load_safetensors calls)
        for _ in range(args.rounds):
            for arm, times in arms.items():
                convert.advise_huge_pages = real if arm == "MADV_HUGEPAGE" else (lambda mm: None)
                evict(path)
                times.append(pass_ms(args.passes))
        convert.advise_huge_pages = real
        a, b = (statistics.median(v) for v in arms.values())
        print(
            f"\none-token passes of the int4 target read back after eviction: no advice {a:.2f} ms, "
            f"MADV_HUGEPAGE {b:.2f} ms (x{a / b:.3f}); rounds: "
            + "; ".join(f"{k} " + ", ".join(f"{x:.1f}" for x in v) for k, v in arms.items())
        )


if __name__ == "__main__":
    main()
