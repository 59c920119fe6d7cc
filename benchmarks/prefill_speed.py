"""How fast a prompt is fed: verispec's prefill path against its decoding path and llama.cpp, in one run.

For each prompt length of ``--lengths`` (random token ids) and each model of ``--roles`` (the
default pair, ``--precision``): the prompt fed in chunks of ``--chunk`` tokens as the engine feeds
it, once with ``forward(prefill=...)`` as the engine sets it (pieces of ``PREFILL_MIN_TOKENS`` or
more on the prefill path) and once on the decoding path (every piece as a verification pass
computes it: this release's prefill before the prefill path), alternating, ``--reps`` times each;
the median tokens/s of each, and their ratio. With llama.cpp built (``../shared/tools/build-llamacpp.sh``),
``llama-bench -p LENGTH -n 0`` on the same GGUF and threads (its prompt processing, one pass of
LENGTH tokens, median of 3; with ``--repack 0`` where its default dies, and marked so), and
verispec's prefill path over it.

    python benchmarks/prefill_speed.py [--lengths 128,512,2048] [--roles target,draft]
        [--precision int4] [--chunk 512] [--threads 2] [--reps 3] [--no-llama] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from verispec.cli.doctor import machine_line
from verispec.formats.loader import load_model
from verispec.formats.registry import DEFAULT_DRAFT, DEFAULT_TARGET, GGUF_FILE, model_dir
from verispec.models.transformer import PREFILL_MIN_TOKENS

LLAMA_CPP_BIN = Path.home() / ".cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def feed(model: Any, prompt: torch.Tensor, chunk: int, prefill_path: bool) -> float:
    """Seconds to feed ``prompt`` ``[1, P]`` into a fresh cache in chunks, the logits of the last token out."""
    cache = model.new_cache(1, prompt.shape[1] + 1)
    cache.add_sequence()
    start = time.perf_counter()
    for offset in range(0, prompt.shape[1], chunk):
        piece = prompt[:, offset : offset + chunk]
        prefill = prefill_path and piece.shape[1] >= PREFILL_MIN_TOKENS
        model.forward(piece, None, cache, logits_at=torch.tensor([[piece.shape[1] - 1]]), prefill=prefill)
    return time.perf_counter() - start


def llama_bench(gguf: Path, length: int, threads: int, binary: Path) -> tuple[float | None, bool]:
    """llama.cpp's prompt processing, tokens/s (``llama-bench -p LENGTH -n 0``, median of 3) or None,
    and whether it ran with its default weight repacking: where that path dies (its AMX path on a
    machine whose worker threads lack the AMX permission), it runs again with ``--repack 0``."""
    for repack in (True, False):
        cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(length), "-n", "0", "-r", "3", "-o", "json"]
        run = subprocess.run([*cmd, *([] if repack else ["--repack", "0"])], check=False, capture_output=True,
                             text=True, timeout=1800)  # fmt: skip
        if run.returncode == 0:
            rows = json.loads(run.stdout)
            return (float(rows[0]["avg_ts"]) if rows else None), repack
    return None, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--roles", default="target,draft")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP_BIN)
    ap.add_argument("--no-llama", dest="llama", action="store_false")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(v) for v in args.lengths.split(",")]
    machine = machine_line()
    print(machine)
    bench = args.llama_cpp / "llama-bench"
    if args.llama and not bench.exists():
        print(f"llama.cpp is not built ({bench} missing: ../shared/tools/build-llamacpp.sh); its rows are skipped")
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for role in args.roles.split(","):
        name = DEFAULT_TARGET if role == "target" else DEFAULT_DRAFT
        model = load_model(name, dtype=args.precision).model
        vocab = model.config.vocab_size
        for length in lengths:
            prompt = torch.randint(100, min(vocab, 30000), (1, length), generator=gen)
            feed(model, prompt[:, : min(length, args.chunk)], args.chunk, True)  # warm-up
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.reps):
                for path in (True, False):
                    times[path].append(feed(model, prompt, args.chunk, path))
            prefill, decoding = (length / statistics.median(times[p]) for p in (True, False))
            peer, repack = None, True
            if args.llama and bench.exists():
                peer, repack = llama_bench(model_dir(name) / GGUF_FILE, length, args.threads, bench)
            rows.append({"role": role, "model": name, "length": length, "prefill_tps": prefill,
                         "decoding_path_tps": decoding, "llama_cpp_pp_tps": peer, "llama_cpp_repack": repack,
                         "times": {"prefill": times[True], "decoding_path": times[False]}})  # fmt: skip
            said = f", llama.cpp pp {peer:.0f}{'' if repack else ' (--repack 0: its default died)'}" if peer else ""
            print(
                f"{role} {length}: prefill path {prefill:.0f} tokens/s, decoding path {decoding:.0f}{said}", flush=True
            )
    print(f"\n{machine}, {args.precision}, chunks of {args.chunk}, {args.threads} threads\n")
    print("| model | prompt tokens | prefill path (tokens/s) | decoding path | ratio | llama.cpp pp | over llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peer = r["llama_cpp_pp_tps"]
        mark = "" if r["llama_cpp_repack"] else " (--repack 0)"
        versus = f"{peer:.0f}{mark} | {r['prefill_tps'] / peer:.2f}" if peer else "- | -"
        print(f"| {r['role']} | {r['length']} | {r['prefill_tps']:.0f} | {r['decoding_path_tps']:.0f} | "
              f"{r['prefill_tps'] / r['decoding_path_tps']:.2f} | {versus} |")  # fmt: skip
    if args.json is not None:
        payload = {"machine": machine, "precision": args.precision, "chunk": args.chunk, "threads": args.threads,
                   "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
