"""What do the int8, Q4_K and bf16 vector kernels cost alone, without Python or torch around them?

Builds ``benchmarks/kernel_stream.cpp`` with a tier's compiler flags (the same as the extension's,
:mod:`verispec.kernels.dispatch`; default the tier this CPU runs) against the kernel sources, and
times ``y = x @ W.T`` for M activation rows over enough different [N, K] weight matrices (about
``--mib`` MiB in all) that the weights stream from memory as in a forward pass. Each round runs
every (kind, M) once, in turn; reported is the median over ``--rounds`` rounds of each round's
best of ``--reps`` sweeps: ms per matrix, weight GB/s, and 64-product multiply-add groups per
second (bf16: four 16-lane FMAs count as one group). The default shape is the 1.5B's gate/up projection, [8960 x 1536].
On the amx tier kinds ``q4k-amx`` and ``int8-amx`` time the tile kernels (``amx/q4k.cpp``,
``amx/w8a8.cpp``) on the same weights.

Each round also times the tier's integer multiply instruction alone on the same threads (VPDPBUSD,
VPMADDUBSW or SDOT in a loop of independent chains: ``peak``), and the int8 / Q4_K rows say what
share of it they reach: near 1, the kernel is bound by that instruction; well below 1 while the
GB/s is below the machine's read bandwidth, something else in the kernel binds it. On the avx512 tier
it also times that instruction with the Q4_K epilogue's fp32 multiply-adds interleaved, five per
sixteen (``peak-mixed``): where both share execution pipes this is the Q4_K kernel's own ceiling,
and the q4k rows say their share of it too. Both peaks are the best round's (a capability; a
neighbour busy on one of the cores halves a round's figure).

The weights lie on transparent huge pages where the OS gives them, as the runtime's packed weights
are mapped from their cache files (``--pages small``: 4 KiB pages; ``both``: each case on both).

    python benchmarks/kernel_stream.py [--tier avx512] [--kinds int8,q4k,bf16,int8-amx,q4k-amx] [--shape 8960x1536]
        [--ms 1,8] [--mib 512] [--reps 5] [--rounds 5] [--threads 2] [--pages huge|small|both] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from verispec.cli.doctor import cpu_model
from verispec.kernels import dispatch
from verispec.kernels.build import SOURCE_DIR, compiler, flags_of

HERE = Path(__file__).resolve().parent
LINE = re.compile(r": ([0-9.]+) ms, ([0-9.]+) GB/s, ([0-9.]+) G groups/s")
PEAK = re.compile(r"peak: ([0-9.]+) G groups/s")


def build(tier: dispatch.Tier, out: Path) -> Path:
    cxx = compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler found (install g++)")
    exe = out / f"kernel_stream_{tier.name}"
    cmd = [cxx, *flags_of(tier), "-std=c++17", f"-I{SOURCE_DIR}", f"-I{SOURCE_DIR / 'vec'}"]
    cmd += [str(HERE / "kernel_stream.cpp"), str(SOURCE_DIR / "vec" / "linear.cpp")]
    if tier.name == "amx":  # (the tile kernels: kinds q4k-amx, int8-amx)
        cmd += [str(SOURCE_DIR / "amx" / "q4k.cpp"), str(SOURCE_DIR / "amx" / "w8a8.cpp")]
    cmd += ["-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", default="", help="a tier this CPU runs (default: the one it would use)")
    ap.add_argument("--kinds", default="int8,q4k")
    ap.add_argument("--shape", default="8960x1536", help="N x K of one weight matrix")
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--mib", type=int, default=512, help="weight bytes streamed per sweep, about")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pages", default="huge", help="huge, small or both: the weights' pages (huge: as mapped)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tier = dispatch.by_name(args.tier) if args.tier else dispatch.best()
    if dispatch.missing(tier):
        raise SystemExit(f"this CPU cannot run the {tier.name} tier (it lacks {', '.join(dispatch.missing(tier))})")
    n, k = (int(v) for v in args.shape.lower().split("x"))
    kinds, ms = args.kinds.split(","), [int(v) for v in args.ms.split(",")]
    tile_kinds = [kind for kind in kinds if kind.endswith("-amx")]
    if tile_kinds and tier.name != "amx":
        raise SystemExit(f"kinds {', '.join(tile_kinds)}: the amx tier's tile kernels; the {tier.name} tier has none")
    pages = ["huge", "small"] if args.pages == "both" else [args.pages]
    runs: dict[tuple[str, int, str], list[tuple[float, float, float]]] = {
        (kind, m, p): [] for kind in kinds for m in ms for p in pages
    }
    peaks: list[float] = []
    mixed: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tier, Path(tmp))
        for _ in range(args.rounds):
            out = subprocess.run([str(exe), "peak", "0", "0", "0", "0", "3", str(args.threads)], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
            found_peak = PEAK.search(out)
            assert found_peak, out
            peaks.append(float(found_peak.group(1)))
            out = subprocess.run([str(exe), "peak-mixed", "0", "0", "0", "0", "3", str(args.threads)], check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
            found_mixed = PEAK.search(out)
            assert found_mixed, out
            mixed.append(float(found_mixed.group(1)))
            for (kind, m, page), found_times in runs.items():
                per_matrix = n * k * (144 / 256 if kind.startswith("q4k") else 2 if kind == "bf16" else 1)
                copies = max(1, int(args.mib * 2**20 / per_matrix))
                cmd = [str(exe), kind, str(n), str(k), str(m), str(copies), str(args.reps), str(args.threads)]
                env = {**os.environ, "SMALL_PAGES": "1" if page == "small" else "0"}
                found = LINE.search(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)
                assert found, cmd
                ms_all, gbps, groups = (float(v) for v in found.groups())
                found_times.append((ms_all / copies, gbps, groups))
    # (the best round: a capability, and a neighbour busy on one of the cores halves a round's figure)
    peak = max(peaks)
    peak_q4k = max(mixed)
    print(f"### {cpu_model()}, {tier.name} tier, {args.threads} threads, [{n} x {k}] matrices, "
          f"about {args.mib} MiB per sweep")  # fmt: skip
    if peak > 0:
        print(f"integer multiply peak (the instruction alone, {args.threads} threads): {peak:.2f} G groups/s")
    if peak_q4k > 0:
        share_of_peak = peak_q4k / peak
        print(f"with Q4_K's epilogue FMAs, 5 per 16 multiplies: {peak_q4k:.2f} G groups/s ({share_of_peak:.2f} of it)")
    columns = ["kernel", "M", "pages", "ms per matrix, median [min-max]", "GB/s", "G groups/s", "of the multiply peak"]
    print("| " + " | ".join([*columns, "of the mixed peak"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    results: dict[str, Any] = {
        "cpu": cpu_model(), "tier": tier.name, "threads": args.threads, "n": n, "k": k, "peak": peak,
        "peak_q4k_mixed": peak_q4k, "cases": [],
    }  # fmt: skip
    for (kind, m, page), values in runs.items():
        t = [v[0] for v in values]
        med = statistics.median(t)
        gbps, groups = (statistics.median(v[i] for v in values) for i in (1, 2))
        share = f"{groups / peak:.2f}" if peak > 0 and kind != "bf16" else "-"
        share_mixed = f"{groups / peak_q4k:.2f}" if peak_q4k > 0 and kind.startswith("q4k") else "-"
        spread = f"{med:.3f} [{min(t):.3f}-{max(t):.3f}]"
        print(f"| {kind} | {m} | {page} | {spread} | {gbps:.1f} | {groups:.2f} | {share} | {share_mixed} |")
        results["cases"].append(
            {"kind": kind, "m": m, "pages": page, "ms_median": med, "ms_all": t, "gbps": gbps, "groups": groups}
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
