"""Time and memory to open a GGUF model and dequantise every tensor, one fresh process per file.

    python benchmarks/gguf_load.py [--dir DIR] [--dtype bfloat16] [--threads 1 2] [--repeat 3]

DIR defaults to $VERISPEC_TEST_GGUF_DIR or /tmp/verispec-models.

Per file, dtype and thread count it prints: header open time, tokenizer build time, full state-dict
dequantisation time (best of --repeat, page cache warm after the first), values per second, and
the process's peak RSS (resident memory high-water mark, which includes the touched pages of the
file mapping) and the size of the dequantised tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def measure(path: str, dtype_name: str, threads: int, repeat: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    from verispec.formats.gguf import GGUFModel
    from verispec.formats.tokenizer import Tokenizer

    t0 = time.perf_counter()
    model = GGUFModel(path)
    opened = time.perf_counter() - t0
    t0 = time.perf_counter()
    Tokenizer.from_gguf(model.file)
    tokenizer = time.perf_counter() - t0
    dtype = getattr(torch, dtype_name)
    best, numel, nbytes = float("inf"), 0, 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        sd = model.state_dict(dtype)
        best = min(best, time.perf_counter() - t0)
        numel = sum(t.numel() for t in sd.values())
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        del sd
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "open_s": opened,
        "tokenizer_s": tokenizer,
        "dequant_s": best,
        "values": numel,
        "tensor_bytes": nbytes,
        "peak_rss_bytes": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.environ.get("VERISPEC_TEST_GGUF_DIR", "/tmp/verispec-models"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, dtype, threads, repeat = args.child
        print(json.dumps(measure(path, dtype, int(threads), int(repeat))))
        return
    files = sorted(Path(args.dir).glob("*.gguf"))
    if not files:
        sys.exit(f"no .gguf files in {args.dir}")
    print(
        f"{'file':44s} {'thr':>3s} {'open s':>7s} {'tok s':>6s} {'dequant s':>9s} {'Mval/s':>7s} "
        f"{'tensors GiB':>11s} {'peak RSS GiB':>12s}"
    )
    for path in files:
        for threads in args.threads:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(path), args.dtype, str(threads), str(args.repeat)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(
                f"{path.name:44s} {threads:3d} {r['open_s']:7.2f} {r['tokenizer_s']:6.2f} "
                f"{r['dequant_s']:9.2f} "
                f"{r['values'] / r['dequant_s'] / 1e6:7.0f} {r['tensor_bytes'] / 2**30:11.2f} "
                f"{r['peak_rss_bytes'] / 2**30:12.2f}"
            )
    print(f"(dtype {args.dtype}; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
