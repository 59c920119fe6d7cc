"""Which linear-layer kernel keeps a speculative verification pass as cheap as a decode step?

Times one linear layer ``y = x @ W.T`` for M = 1, 2, 4, 5, 8, 16 tokens (the pass that verifies
M - 1 draft tokens) at the shapes of Qwen2.5-1.5B, for every candidate side by side in one run:

  bf16 / fp32          ``F.linear`` with dense weights (oneDNN; AMX for bf16)
  int8pack             ``torch._weight_int8pack_mm`` (per-channel int8, bf16 activations), and the
                       same op called once per row ("per-row": M calls of M = 1)
  int4pack             ``torch._weight_int4pack_mm_for_cpu`` (group 32, asymmetric), and per-row
  ind-int8 / -mat      torch.compile (inductor) of ``F.linear(x, w.to(bf16)) * s``: the WOQ pattern
                       rewrites it to ``_weight_int8pack_mm``; "-mat" = mode="max-autotune", where
                       inductor may pick its C++ GEMM template (AMX micro-kernel for M >= 5)
  ind-int4-mat         torch.compile(max-autotune) of ``_weight_int4pack_mm_for_cpu`` (inductor's
                       CppWoqInt4GemmTemplate; AVX-512 micro-kernel for M < 5, AMX above)
  ind-int4-deq         torch.compile of dequantise-int4-then-``F.linear`` (no WOQ pattern exists)
  q4k-amx              prototype (benchmarks/prototypes/woq_amx.cpp): GGUF Q4_K, exact weights,
                       dequantised once per call, AMX TDPBF16PS for all M rows
  q4k-avx512           prototype, same weights, AVX512-BF16 VDPBF16PS (no AMX)
  q4k-auto             q4k-avx512 for M = 1, q4k-amx for M > 1 (not timed: copied from those rows)
  q4k-amx-bf16w        prototype, alternative design: bf16-rounded Q4_K weights as the AMX A operand
  int8-amx             prototype: per-channel int8 weights, AMX

The machine may be shared. Before each round the script waits (up to --max-wait s) until other
processes are idle; every call is timed alone; candidates are interleaved round-robin (a noisy
moment hits all of them); a sample counts as "clean" only when, during the call, the CPU pressure
stall counter (/proc/pressure/cpu "some") and this process's involuntary context switches did not
move and no other process was charged a scheduler tick. Before each call a 192 MiB buffer is
read, so the weights come from DRAM as in a real forward pass (--evict-mib 0: cache-hot; the LM
head never fits a cache). Reported: median of clean samples (of all samples when too few are
clean, marked "*") and the p10-p90 spread. Whole-model estimates sum one decoder layer's linears
(q, k, v, o, gate, up, down) x 28 + the LM head, against the memory floor (weight bytes /
bandwidth) and llama.cpp's measured decode on this machine.

    python benchmarks/linear_kernels.py [--threads 2] [--shapes q/o,down] [--ms 1,5] [--only q4k,bf16]
        [--no-inductor] [--min-clean 15] [--budget 20] [--evict-mib 192] [--max-wait 30] [--retries 2]
        [--json out.json] [--merge earlier.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.kernels.bandwidth import probe_buffer

sys.path.insert(0, str(Path(__file__).resolve().parent / "prototypes"))
import woq_amx

# name -> (out_features, in_features, count per decoder layer)
SHAPES: dict[str, tuple[int, int, int]] = {
    "q/o": (1536, 1536, 2),
    "k/v": (256, 1536, 2),
    "gate/up": (8960, 1536, 2),
    "down": (1536, 8960, 1),
    "lm_head": (151936, 1536, 0),
}
NUM_LAYERS = 28
NOMINAL_GBPS = 32.0
LLAMA_CPP_MS = {"Qwen2.5-1.5B Q4_K_M": 1000 / 34, "Qwen2.5-0.5B Q4_K_M": 1000 / 48}
# bytes per weight of each candidate's storage (scales included)
BYTES_PER_WEIGHT = {
    "bf16": 2.0,
    "fp32": 4.0,
    "int8pack": 1.0,
    "int8pack/row": 1.0,
    "int4pack": 0.5 + 4 / 32,
    "int4pack/row": 0.5 + 4 / 32,
    "ind-int8": 1.0,
    "ind-int8-mat": 1.0,
    "ind-int4-mat": 0.5 + 4 / 32,
    "ind-int4-deq": 0.5 + 4 / 32,
    "q4k-amx": 144 / 256,
    "q4k-avx512": 144 / 256,
    "q4k-amx-bf16w": 144 / 256,
    "int8-amx": 1.0,
    "q4k-auto": 144 / 256,
}


# ------------------------------------------------------------------------------ noise-aware timing


def _psi_some_us() -> int:
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("=", 1)[1])
    except (OSError, ValueError, IndexError):
        return 0


def _nivcsw() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process) so far."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:]]
    busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")  # user nice sys irq softirq steal
    t = os.times()
    return busy, t.user + t.system


def wait_until_quiet(max_wait_s: float, window_s: float = 0.2, threshold: float = 0.05) -> float:
    """Sleeps until other processes use < threshold of one CPU over a window; returns the wait."""
    t0 = time.perf_counter()
    while True:
        b0, m0 = _cpu_seconds()
        time.sleep(window_s)
        b1, m1 = _cpu_seconds()
        if (b1 - b0) - (m1 - m0) < threshold * window_s or time.perf_counter() - t0 > max_wait_s:
            return time.perf_counter() - t0


class Samples:
    def __init__(self) -> None:
        self.all: list[float] = []
        self.clean: list[float] = []

    def add(self, seconds: float, clean: bool) -> None:
        self.all.append(seconds)
        if clean:
            self.clean.append(seconds)

    def summary(self, min_clean: int) -> dict[str, float | int | bool]:
        use = self.clean if len(self.clean) >= min_clean else self.all
        v = sorted(use)
        return {
            "ms": 1e3 * statistics.median(v),
            "p10": 1e3 * v[len(v) // 10],
            "p90": 1e3 * v[(9 * len(v)) // 10],
            "min": 1e3 * v[0],
            "n_clean": len(self.clean),
            "n": len(self.all),
            "clean": use is self.clean,
        }


class Evictor:
    """Reads a buffer larger than the last-level cache before each timed call, so every call
    streams its weights from DRAM as in a real forward pass (where the ~1 GB of weights of one
    token never fit in cache). 0 MiB: no eviction (weights of small layers stay cache-hot)."""

    def __init__(self, mib: int):
        self.buf = torch.ones(mib << 18) if mib > 0 else None
        self.active = True

    def __call__(self) -> None:
        if self.buf is not None and self.active:
            self.buf.sum()


class Settings:
    """Run-wide timing settings (set once from the command line)."""

    evict = Evictor(0)
    max_wait_s = 30.0
    waited_s = 0.0


CFG = Settings()


def time_interleaved(
    fns: dict[str, Callable[[], object]], min_clean: int, budget_s: float, max_rounds: int = 400
) -> dict[str, Samples]:
    """Round-robin timing of every fn until each has ``min_clean`` clean samples or the budget ends."""
    samples = {name: Samples() for name in fns}
    names = list(fns)
    for fn in fns.values():  # warm-up
        fn(), fn()
    t_end = time.perf_counter() + budget_s
    for r in range(max_rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        CFG.waited_s += wait_until_quiet(CFG.max_wait_s)
        for name in order:
            CFG.evict()
            b0, m0 = _cpu_seconds()
            s0, c0 = _psi_some_us(), _nivcsw()
            t0 = time.perf_counter()
            fns[name]()
            dt = time.perf_counter() - t0
            s1, c1 = _psi_some_us(), _nivcsw()
            b1, m1 = _cpu_seconds()
            # clean: no task waited for a CPU, we were not preempted, and no other process got a
            # scheduler tick (10 ms resolution) while the call ran
            samples[name].add(dt, s1 == s0 and c1 == c0 and (b1 - b0) - (m1 - m0) < 0.005)
        done = all(len(s.clean) >= min_clean for s in samples.values())
        if (done and r >= 4) or time.perf_counter() > t_end:
            break
    return samples


def read_bandwidth_gbps(min_clean: int, budget_s: float) -> dict[str, float]:
    """DRAM read bandwidth of torch's sum with the current threads: a 1 GiB tensor, and 8 MiB
    tensors (a layer's weights) read cold, one after another from 800 MiB of them."""
    x = probe_buffer(2**30)  # (on huge pages where the OS gives them, as the weights are mapped)
    s = time_interleaved({"sum": x.sum}, min_clean=min(min_clean, 7), budget_s=budget_s)["sum"]
    big = s.summary(min(min_clean, 7))
    bufs = [torch.ones(2**21) for _ in range(100)]
    it = iter(range(10**9))
    s = time_interleaved({"sum": bufs[next(it) % 100].sum}, min_clean=30, budget_s=budget_s)["sum"]
    small = s.summary(30)
    return {
        "1GiB_median": 2**30 / big["ms"] * 1e3 / 1e9,
        "1GiB_best": 2**30 / big["min"] * 1e3 / 1e9,
        "8MiB_cold_median": 2**23 / small["ms"] * 1e3 / 1e9,
        "8MiB_cold_best": 2**23 / small["min"] * 1e3 / 1e9,
    }


# ------------------------------------------------------------------------------ weights and candidates


def random_q4k_blocks(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random but well-formed Q4_K blocks [n, k/256*144]: fp16 d, dmin in [2^-10, 2^-7)."""
    b = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n * k // 256, 2, generator=gen) * 7 + 1) * 2.0**-10
    b[:, 0:4] = d.to(torch.float16).view(torch.uint8)
    return b.reshape(n, -1)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.abs().amax(1).clamp_min(1e-8) / 127
    return torch.round(w / s[:, None]).clamp(-128, 127).to(torch.int8), s


def quantize_int4_g32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-32 asymmetric int4 in int4pack's convention w = (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    sz = torch.stack([scale.T, zero.T], -1).to(torch.bfloat16).contiguous()  # [k/32, n, 2]
    return q, sz


class _Int8Mod(torch.nn.Module):
    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        super().__init__()
        self.register_buffer("w", q)
        self.register_buffer("s", s.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [1, M, K] bf16 (3-D: the pattern wants a reshape)
        return F.linear(x, self.w.to(x.dtype)) * self.s


class _Int4PackMod(torch.nn.Module):
    def __init__(self, packed: torch.Tensor, sz: torch.Tensor):
        super().__init__()
        self.register_buffer("w", packed)
        self.register_buffer("sz", sz)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16
        return torch._weight_int4pack_mm_for_cpu(x, self.w, 32, self.sz)


class _Int4DeqMod(torch.nn.Module):
    def __init__(self, q: torch.Tensor, sz: torch.Tensor):
        super().__init__()
        n, k = q.shape
        q8 = q.to(torch.uint8).reshape(n, k // 2, 2)
        self.register_buffer("w", (q8[..., 0] | (q8[..., 1] << 4)).contiguous())  # [n, k/2]
        self.register_buffer("scale", sz[..., 0].T.contiguous())  # [n, k/32] bf16
        self.register_buffer("zero", sz[..., 1].T.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16
        n = self.w.shape[0]
        q = torch.stack([self.w & 15, self.w >> 4], -1).reshape(n, -1, 32).to(x.dtype)
        w = ((q - 8) * self.scale[..., None] + self.zero[..., None]).reshape(n, -1)
        return F.linear(x, w)


def _compile(mod: torch.nn.Module, example: torch.Tensor, mode: str | None) -> tuple[Callable, float]:
    import torch._inductor.config as ic

    torch._dynamo.reset()
    ic.freezing = mode == "max-autotune"  # the CPP GEMM template wants frozen (constant) weights
    ic.max_autotune = mode == "max-autotune"
    if mode == "max-autotune":
        ic.max_autotune_gemm_backends = "CPP,ATEN"
    fn = torch.compile(mod, mode=mode, dynamic=False)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(example)
    return fn, time.perf_counter() - t0


class ShapeBench:
    """All candidates' weights for one shape (random values: timings do not depend on them)."""

    def __init__(self, n: int, k: int, names: list[str], gen: torch.Generator):
        self.n, self.k, self.names = n, k, names
        w = torch.randn(n, k, generator=gen) * 0.02
        want = lambda *keys: any(name.startswith(key) for name in names for key in keys)  # noqa: E731
        if want("bf16"):
            self.w_bf16 = w.to(torch.bfloat16)
        if want("fp32"):
            self.w_fp32 = w
        if want("int8pack", "ind-int8", "int8-amx"):
            self.q8, self.s8 = quantize_int8(w)
            self.s8_bf16 = self.s8.to(torch.bfloat16)
        if want("int4pack", "ind-int4"):
            self.q4, self.sz = quantize_int4_g32(w)
            self.p4 = torch._convert_weight_to_int4pack_for_cpu(self.q4, 2)
        if want("q4k"):
            self.q4k = woq_amx.Q4KLinear(random_q4k_blocks(n, k, gen), n, k, with_rows_layout="q4k-amx-bf16w" in names)
        if want("int8-amx"):
            self.i8amx = woq_amx.Int8Linear(self.q8, self.s8)
        del w
        self.compile_s: dict[str, float] = {}

    def fns(self, m: int, gen: torch.Generator) -> dict[str, Callable[[], object]]:
        xf = torch.randn(m, self.k, generator=gen)
        xb = xf.to(torch.bfloat16)
        out: dict[str, Callable[[], object]] = {}
        for name in self.names:
            if name == "bf16":
                out[name] = lambda: F.linear(xb, self.w_bf16)
            elif name == "fp32":
                out[name] = lambda: F.linear(xf, self.w_fp32)
            elif name == "int8pack":
                out[name] = lambda: torch._weight_int8pack_mm(xb, self.q8, self.s8_bf16)
            elif name == "int8pack/row":
                out[name] = lambda: torch.cat(
                    [torch._weight_int8pack_mm(xb[i : i + 1], self.q8, self.s8_bf16) for i in range(m)]
                )
            elif name == "int4pack":
                out[name] = lambda: torch._weight_int4pack_mm_for_cpu(xb, self.p4, 32, self.sz)
            elif name == "int4pack/row":
                out[name] = lambda: torch.cat(
                    [torch._weight_int4pack_mm_for_cpu(xb[i : i + 1], self.p4, 32, self.sz) for i in range(m)]
                )
            elif name in ("ind-int8", "ind-int8-mat"):
                x3 = xb[None]
                fn, cs = _compile(_Int8Mod(self.q8, self.s8), x3, "max-autotune" if name.endswith("mat") else None)
                self.compile_s[f"{name} M={m}"] = cs
                out[name] = lambda fn=fn, x3=x3: fn(x3)
            elif name == "ind-int4-mat":
                fn, cs = _compile(_Int4PackMod(self.p4, self.sz), xb, "max-autotune")
                self.compile_s[f"{name} M={m}"] = cs
                out[name] = lambda fn=fn: fn(xb)
            elif name == "ind-int4-deq":
                fn, cs = _compile(_Int4DeqMod(self.q4, self.sz), xb, None)
                self.compile_s[f"{name} M={m}"] = cs
                out[name] = lambda fn=fn: fn(xb)
            elif name == "q4k-amx":
                out[name] = lambda: self.q4k(xb, "amx")
            elif name == "q4k-avx512":
                out[name] = lambda: self.q4k(xb, "avx512")
            elif name == "q4k-amx-bf16w":
                out[name] = lambda: self.q4k(xb, "amx_bf16w")
            elif name == "int8-amx":
                out[name] = lambda: self.i8amx(xb)
            else:
                raise ValueError(name)
        return out


# ------------------------------------------------------------------------------ report


def print_tables(results: dict, ms: list[int], names: list[str]) -> None:
    """One markdown table per shape: ms per call for each candidate and M."""
    for shape, per_m in results.items():
        n, k, _ = SHAPES[shape]
        print(
            f"\n### {shape}: W [{n} x {k}]  (ms per call: median of clean samples [p10-p90]; * = too few clean samples)"
        )
        print("| candidate | " + " | ".join(f"M={m}" for m in ms) + " | M=8/M=1 |")
        print("|---|" + "---|" * (len(ms) + 1))
        for name in names:
            cells, t1, t8 = [], None, None
            for m in ms:
                r = per_m.get(m, {}).get(name)
                if r is None:
                    cells.append("-")
                    continue
                t1 = r["ms"] if m == 1 else t1
                t8 = r["ms"] if m == 8 else t8
                cells.append(f"{r['ms']:.3f}{'' if r['clean'] else '*'} [{r['p10']:.3f}-{r['p90']:.3f}]")
            ratio = f"{t8 / t1:.2f}" if t1 and t8 else "-"
            print(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")


def whole_model(results: dict, names: list[str], bw: dict[str, float]) -> None:
    """Sum of one decoder layer's linears x 28 + the LM head, at M = 1 and M = 5."""
    per_layer = {s: c for s, (_, _, c) in SHAPES.items() if c}
    params = sum(n * k * c for s, (n, k, c) in SHAPES.items() if c) * NUM_LAYERS + 151936 * 1536
    print(
        f"\n### Whole model (Qwen2.5-1.5B linears: 7 per layer x {NUM_LAYERS} + LM head = {params / 1e9:.2f} G weights)"
    )
    print("llama.cpp decode on this machine: " + ", ".join(f"{k} {v:.1f} ms/token" for k, v in LLAMA_CPP_MS.items()))
    print(
        "read bandwidth (torch sum): "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items())
        + f"; floors use the nominal {NOMINAL_GBPS:.0f} GB/s"
    )
    print("| candidate | M=1 ms | M=5 ms | M=5/M=1 | floor ms (bytes/32 GB/s) | M=1 / floor |")
    print("|---|---|---|---|---|---|")
    for name in names:
        tot = {}
        for m in (1, 5):
            try:
                t = sum(results[s][m][name]["ms"] * c for s, c in per_layer.items()) * NUM_LAYERS
                t += results["lm_head"][m][name]["ms"]
                tot[m] = t
            except KeyError:
                tot[m] = None
        floor = params * BYTES_PER_WEIGHT[name] / (NOMINAL_GBPS * 1e9) * 1e3
        t1, t5 = tot[1], tot[5]
        cells = [
            f"{t1:.1f}" if t1 else "-",
            f"{t5:.1f}" if t5 else "-",
            f"{t5 / t1:.2f}" if t1 and t5 else "-",
            f"{floor:.1f}",
            f"{t1 / floor:.2f}" if t1 else "-",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1,2,4,5,8,16")
    ap.add_argument("--only", default="", help="comma-separated candidate name prefixes")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--min-clean", type=int, default=15)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per (shape, M) cell")
    ap.add_argument("--evict-mib", type=int, default=192, help="LLC eviction before each call (0 = hot cache)")
    ap.add_argument(
        "--max-wait",
        type=float,
        default=30.0,
        help="seconds to wait, before each round, for other processes to go idle",
    )
    ap.add_argument("--retries", type=int, default=2, help="re-time candidates left with too few clean samples")
    ap.add_argument("--merge", default="", help="JSON of an earlier run: keep its cells this run did not time")
    ap.add_argument("--json", default="")
    ap.add_argument("--kernel-cache", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    names = [n for n in BYTES_PER_WEIGHT if n != "q4k-auto"]
    if args.no_inductor:
        names = [n for n in names if not n.startswith("ind-")]
    if args.only:
        names = [n for n in names if any(n.startswith(p) for p in args.only.split(","))]
    if not woq_amx.cpu_supported(amx=True):
        names = [n for n in names if not (n.startswith("q4k") or n == "int8-amx")]
        print("# this CPU lacks AVX512-BF16/AMX: prototype kernels skipped")
    else:
        woq_amx.load(args.kernel_cache)
        print(f"# prototype kernels loaded in {woq_amx.build_seconds():.1f} s (built on first use, then cached)")
    ms = [int(m) for m in args.ms.split(",")]
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}, loadavg {os.getloadavg()[0]:.2f}"
    )
    bw = read_bandwidth_gbps(args.min_clean, 10.0)
    CFG.evict = Evictor(args.evict_mib)
    CFG.max_wait_s = args.max_wait
    gen = torch.Generator().manual_seed(0)
    results: dict = {}
    compile_s: dict = {}
    t_start = time.perf_counter()
    for shape in args.shapes.split(","):
        n, k, _ = SHAPES[shape]
        bench = ShapeBench(n, k, names, gen)
        results[shape] = {}
        for m in ms:
            fns = bench.fns(m, gen)
            CFG.evict.active = n * k * 2 < 256 << 20  # the LM head's weights do not fit any cache anyway
            samples = time_interleaved(fns, args.min_clean, args.budget)
            for _ in range(args.retries):  # a busy spell spoilt some candidates: time those again
                short = {nm: f for nm, f in fns.items() if len(samples[nm].clean) < args.min_clean}
                if not short:
                    break
                for nm, more in time_interleaved(short, args.min_clean, args.budget).items():
                    samples[nm].all += more.all
                    samples[nm].clean += more.clean
            results[shape][m] = {nm: s.summary(args.min_clean) for nm, s in samples.items()}
            if "q4k-avx512" in results[shape][m] and "q4k-amx" in results[shape][m]:
                results[shape][m]["q4k-auto"] = results[shape][m]["q4k-avx512" if m == 1 else "q4k-amx"]
            best = min(results[shape][m].items(), key=lambda kv: kv[1]["ms"])
            print(
                f"# {shape} M={m}: done ({time.perf_counter() - t_start:.0f} s, {CFG.waited_s:.0f} s waiting;"
                f" loadavg {os.getloadavg()[0]:.2f};"
                f" fastest {best[0]} {best[1]['ms']:.3f} ms)",
                flush=True,
            )
        compile_s[shape] = bench.compile_s
        del bench
    if args.merge:  # cells of an earlier run (JSON) that this run did not time, or timed less cleanly
        old = json.loads(Path(args.merge).read_text())
        for shape, per_m in old["results"].items():
            for m_str, cands in per_m.items():
                m = int(m_str)
                new = results.setdefault(shape, {}).setdefault(m, {})
                for nm, r in cands.items():
                    if nm not in new or (r["clean"] and not new[nm]["clean"]):
                        new[nm] = r
                ms = sorted({*ms, m})
        results = {sh: results[sh] for sh in SHAPES if sh in results}
        bw = old.get("bandwidth", bw)
    if "q4k-amx" in names and "q4k-avx512" in names:
        names = [*names, "q4k-auto"]
    print_tables(results, ms, names)
    if set(SHAPES) <= set(results) and all({1, 5} <= set(results[sh]) for sh in SHAPES):
        whole_model(results, names, bw)
    if any(compile_s.values()):
        print("\n### torch.compile time per (candidate, M) [s]")
        for shape, cs in compile_s.items():
            if cs:
                print(f"{shape}: " + ", ".join(f"{k} {v:.1f}" for k, v in cs.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "results": results,
                    "bandwidth": bw,
                    "compile_s": compile_s,
                    "threads": args.threads,
                    "torch": torch.__version__,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
