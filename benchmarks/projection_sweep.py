"""What do all the projections of a model's decoder layers cost per pass, kernel by kernel?

For the decoder-layer projections of Qwen2.5-0.5B (24 layers: gate/up [4864 x 896], down
[896 x 4864], fused q/k/v [1152 x 896], o [896 x 896]; 358 M weights) and Qwen2.5-1.5B (28 layers:
[8960 x 1536] x 2, [1536 x 8960], [2048 x 1536], [1536 x 1536]; 1.30 G weights), every layer with
its own random weights, so that a sweep streams them from memory as a forward pass does, this
times one sweep ``y = x @ W.T`` over every matrix for M = 1, 2, 5, 8, 16 activation rows:

  bf16       :func:`verispec.models.linear.dense_linear` (torch.mv / mm on bf16 weights)
  int8pack   ``torch._weight_int8pack_mm`` (per-channel int8 weights, bf16 activations)
  int8       :class:`verispec.kernels.Int8Linear` (the runtime's int8 projections)
  q4k        :class:`verispec.kernels.Q4KLinear` on random well-formed Q4_K blocks (models whose
             input sizes are multiples of 256 only: the 1.5B)

Each repetition (after waiting for other processes to go quiet) runs every (M, kernel) once, in a
rotating order, so a busy moment of the shared machine hits them alike; reported is the median
[min-max] over ``--reps`` sweeps in ms, next to the floor of the weight bytes over the read
bandwidth measured here (a 1 GiB stream, median).

    python benchmarks/projection_sweep.py [--models 0.5b,1.5b] [--ms 1,2,5,8,16] [--reps 7]
        [--only bf16,int8] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from decode_speed import wait_until_quiet  # benchmarks/ is on the path when this script runs

from verispec.kernels import Int8Linear, Q4KLinear
from verispec.kernels.bandwidth import read_bandwidth
from verispec.models.linear import dense_linear

# name -> (layers, [(out_features, in_features), ...] per layer)
MODELS: dict[str, tuple[int, list[tuple[int, int]]]] = {
    "0.5b": (24, [(4864, 896), (4864, 896), (896, 4864), (1152, 896), (896, 896)]),
    "1.5b": (28, [(8960, 1536), (8960, 1536), (1536, 8960), (2048, 1536), (1536, 1536)]),
}
CANDIDATES = ("bf16", "int8pack", "int8", "q4k")
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8pack": 1.0, "int8": 1.0, "q4k": 144 / 256}


def random_q4k_blocks(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random well-formed Q4_K blocks ``[n, k/256*144]``: fp16 d, dmin in [2^-10, 2^-7)."""
    b = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n * k // 256, 2, generator=gen) * 7 + 1) * 2.0**-10
    b[:, 0:4] = d.to(torch.float16).view(torch.uint8)
    return b.reshape(n, -1)


class Weights:
    """Every projection of one model for the chosen candidates: ``fns(x_by_k)`` runs a sweep."""

    def __init__(self, model: str, names: list[str], gen: torch.Generator) -> None:
        layers, shapes = MODELS[model]
        self.names = [n for n in names if n != "q4k" or all(k % 256 == 0 for _, k in shapes)]
        self.numel = layers * sum(n * k for n, k in shapes)
        self.mats: dict[str, list[Any]] = {name: [] for name in self.names}
        for _ in range(layers):
            for n, k in shapes:
                w = torch.randn(n, k, generator=gen) * 0.02
                if "bf16" in self.names:
                    self.mats["bf16"].append(w.to(torch.bfloat16))
                if "int8pack" in self.names or "int8" in self.names:
                    lin = Int8Linear.from_weight(w)
                    if "int8" in self.names:
                        self.mats["int8"].append(lin)
                    if "int8pack" in self.names:
                        scale = lin.int8_scale[:n].to(torch.bfloat16)
                        self.mats["int8pack"].append((lin.codes().contiguous(), scale))
                if "q4k" in self.names:
                    self.mats["q4k"].append(Q4KLinear.from_blocks(random_q4k_blocks(n, k, gen), n, k))
        self.in_features = [k for _ in range(layers) for _, k in shapes]

    def sweeps(self, m: int, gen: torch.Generator) -> dict[str, Callable[[], None]]:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in set(self.in_features)}
        pairs = list(zip(self.in_features, range(len(self.in_features)), strict=True))

        def bf16() -> None:
            for k, i in pairs:
                dense_linear(xs[k], self.mats["bf16"][i])

        def int8pack() -> None:
            for k, i in pairs:
                q, s = self.mats["int8pack"][i]
                torch._weight_int8pack_mm(xs[k], q, s)

        def module(name: str) -> Callable[[], None]:
            def sweep() -> None:
                for k, i in pairs:
                    self.mats[name][i](xs[k])

            return sweep

        table = {"bf16": bf16, "int8pack": int8pack, "int8": module("int8"), "q4k": module("q4k")}
        return {name: table[name] for name in self.names}


@torch.inference_mode()
def run_model(model: str, names: list[str], ms: list[int], reps: int, bw: float, max_wait: float) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    weights = Weights(model, names, gen)
    print(f"# {model}: {weights.numel / 1e6:.0f} M weights, made in {time.perf_counter() - t0:.0f} s", flush=True)
    fns = {m: weights.sweeps(m, gen) for m in ms}
    for per_m in fns.values():  # warm-up
        for fn in per_m.values():
            fn()
    times: dict[int, dict[str, list[float]]] = {m: {name: [] for name in per_m} for m, per_m in fns.items()}
    for rep in range(reps):  # every (M, kernel) once per repetition, in a rotating order
        wait_until_quiet(max_wait)
        for m in ms:
            order = list(fns[m])
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                t = time.perf_counter()
                fns[m][name]()
                times[m][name].append(time.perf_counter() - t)
    result = {
        str(m): {
            name: {"median": 1e3 * statistics.median(v), "min": 1e3 * min(v), "max": 1e3 * max(v)}
            for name, v in per_m.items()
        }
        for m, per_m in times.items()
    }
    floors = {name: weights.numel * BYTES_PER_WEIGHT[name] / bw / 1e6 for name in weights.names}
    return {"numel": weights.numel, "times": result, "floor_ms": floors}


def print_model(model: str, res: dict[str, Any], ms: list[int]) -> None:
    print(f"\n### Qwen2.5-{model.upper()} decoder projections ({res['numel'] / 1e6:.0f} M weights): ms per sweep")
    print("| kernel | " + " | ".join(f"M={m}" for m in ms) + " | M=5/M=1 | floor ms |")
    print("|---" * (len(ms) + 3) + "|")
    for name, floor in res["floor_ms"].items():
        cells = []
        for m in ms:
            r = res["times"][str(m)][name]
            cells.append(f"{r['median']:.1f} [{r['min']:.1f}-{r['max']:.1f}]")
        t = res["times"]
        ratio = f"{t['5'][name]['median'] / t['1'][name]['median']:.2f}" if "1" in t and "5" in t else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} | {floor:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--ms", default="1,2,5,8,16")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default=",".join(CANDIDATES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait for the machine to go quiet")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [n for n in CANDIDATES if n in args.only.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    bw = read_bandwidth()["median"]
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {bw:.1f} GB/s (median)")
    results: dict[str, Any] = {"bandwidth_gbps": bw}
    for model in args.models.split(","):
        results[model] = run_model(model, names, ms, args.reps, bw, args.max_wait)
        print_model(model, results[model], ms)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
