"""What does the attention kernel cost per decoder layer, by new tokens and keys in the cache?

:func:`verispec.kernels` ``attention_rows`` (the runtime's attention, one fixed order of
operations per query row: batch-invariant) on the shapes of one decoder layer of a model
(Qwen2.5-1.5B: 12 query heads on 2 key/value heads of 128; 0.5B: 14 on 2 of 64), bf16, batch 1,
causal over a cache of ``span`` keys, for T = 1, 5, 8 new tokens. Each repetition (after waiting
for other processes to go quiet) times every (T, span) once, in turn; reported is the median
[min-max] over ``--reps`` repetitions of the mean over ``--calls`` calls, in microseconds per
layer, and that times the model's layers in ms per pass.

    python benchmarks/attention_rows.py [--model 1.5b] [--ts 1,5,8] [--spans 128,512,1024,2048]
        [--reps 7] [--calls 50] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from decode_speed import wait_until_quiet  # benchmarks/ is on the path when this script runs

from verispec.kernels.build import load

# name -> (layers, query heads, key/value heads, head size)
MODELS: dict[str, tuple[int, int, int, int]] = {"0.5b": (24, 14, 2, 64), "1.5b": (28, 12, 2, 128)}


def inputs(model: str, t: int, span: int) -> tuple[torch.Tensor, ...]:
    _, h, hkv, d = MODELS[model]
    gen = torch.Generator().manual_seed(span + t)
    q = torch.randn(1, t, h, d, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, hkv, span, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    visible = torch.ones(1, t, span, dtype=torch.bool)
    for i in range(t):  # causal: new token i sees the cache and the new tokens up to itself
        visible[0, i, span - t + i + 1 :] = False
    return q, k, v, visible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1.5b", choices=sorted(MODELS))
    ap.add_argument("--ts", default="1,5,8")
    ap.add_argument("--spans", default="128,512,1024,2048")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait for the machine to go quiet")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = load()
    layers, _, _, d = MODELS[args.model]
    grid = [(int(t), int(s)) for t in args.ts.split(",") for s in args.spans.split(",")]
    cases = {key: inputs(args.model, *key) for key in grid}
    times: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
    for rep in range(args.reps + 1):
        wait_until_quiet(args.max_wait)
        for key, (q, k, v, visible) in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                ops.attention_rows(q, k, v, visible, d**-0.5)
            if rep > 0:  # the first round warms up
                times[key].append((time.perf_counter() - t0) / args.calls * 1e6)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model} layer shapes, bf16")
    print(f"### attention_rows: us per layer, median [min-max] over {args.reps} repetitions (x{layers} layers)")
    print("| T | span | us per layer | ms per pass |")
    print("|---|---|---|---|")
    results: dict[str, Any] = {"model": args.model, "threads": args.threads, "cases": []}
    for (t, span), values in times.items():
        med = statistics.median(values)
        print(f"| {t} | {span} | {med:.1f} [{min(values):.1f}-{max(values):.1f}] | {med * layers / 1e3:.2f} |")
        results["cases"].append({"t": t, "span": span, "us_median": med, "us_min": min(values), "us_max": max(values)})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
