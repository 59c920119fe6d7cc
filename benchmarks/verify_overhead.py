"""How much does verification cost next to the decode step it rides on?

Times ``RejectionRule.verify`` (and ``to_probs``, which sits on the same path) for a realistic
shape (B = 8 requests, K = 8 draft tokens, V = 151936: the Qwen2 vocabulary) and compares it with
one plain decode step of a 1.5B-parameter model on this machine. The decode step is memory-bound,
so it is estimated as ``weight bytes / measured memory read bandwidth`` (bandwidth measured here,
in the same run, by summing a ~1 GiB tensor with the same thread count). The ratio
``rule time / decode step time`` is the fraction of a step spent on verification.

Also a greedy step (generator None, laws that are point masses on the modes), as ``verispec generate``
runs by default.

Run:  python benchmarks/verify_overhead.py [--threads 2] [--repeats 15] [--batch 8 --k 8 --vocab 151936]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from verispec.config import SamplingParams
from verispec.kernels.bandwidth import probe_buffer
from verispec.sampling import make_generator, sample, to_probs
from verispec.verify import Draft, GreedyRule, RejectionRule

BYTES_PER_PARAM = {"bf16": 2.0, "Q4_K_M": 0.56}


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(gib: float, repeats: int) -> float:
    """Bytes per second read by ``x.sum()`` over a ``gib`` GiB fp32 tensor (median of repeats)."""
    x = probe_buffer(int(gib * 2**30))  # (on huge pages where the OS gives them, as the weights are mapped)
    seconds = median_seconds(x.sum, repeats, warmup=2)
    return x.numel() * 4 / seconds


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_average() -> str:
    """The 1-minute load average: timings on a busy shared machine are inflated (say so)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="requests per step B (default 8)")
    ap.add_argument("--k", type=int, default=8, help="draft tokens per request K (default 8)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary size V (default 151936, Qwen2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--repeats", type=int, default=15, help="timed runs per figure; the median is shown")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before timing (default 3)")
    ap.add_argument("--params", type=float, default=1.5e9, help="target model parameters (default 1.5e9)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the bandwidth probe (GiB)")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of both laws")
    ap.add_argument("--top-p", type=float, default=0.9, help="top_p for the to_probs top-p row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    load_before = load_average()
    b, k, v = args.batch, args.k, args.vocab
    gen = torch.Generator().manual_seed(args.seed)

    # Inputs as the engine builds them: random logits through the one logits -> law path.
    target_logits = torch.randn((b * (k + 1), v), generator=gen) * 3.0  # [B*(K+1), V] fp32
    draft_logits = target_logits[: b * k] + torch.randn((b * k, v), generator=gen)  # correlated drafter
    temp_only = [SamplingParams(temperature=args.temperature)]
    with_top_p = [SamplingParams(temperature=args.temperature, top_p=args.top_p)]
    target_probs = to_probs(target_logits, temp_only * (b * (k + 1))).view(b, k + 1, v)
    draft_probs = to_probs(draft_logits, temp_only * (b * k)).view(b, k, v)
    ids = sample(draft_probs.view(b * k, v), [make_generator(args.seed)] * (b * k)).view(b, k)
    num = torch.full((b,), k, dtype=torch.long)
    model_draft = Draft(ids, num, draft_probs)
    point_draft = Draft(ids, num, None)
    gens = [make_generator(args.seed + i) for i in range(b)]

    n = b * (k + 1)
    cases: list[tuple[str, Callable[[], object]]] = []
    rules = [RejectionRule(check_values=True), RejectionRule(check_values=False)]
    for checked, rule in zip((True, False), rules, strict=True):
        tag = "checked" if checked else "check_values=False"
        for what, draft in (("model draft probs", model_draft), ("probs=None", point_draft)):
            cases.append((f"RejectionRule, {what}, {tag}", lambda r=rule, d=draft: r.verify(d, target_probs, gens)))
    greedy = GreedyRule()
    nobody = [None] * b  # greedy requests: no generator; their laws are point masses on the modes
    greedy_params = [SamplingParams(temperature=0.0)] * n
    modes_probs = to_probs(target_logits, greedy_params).view(b, k + 1, v)
    cases += [
        ("RejectionRule, greedy rows, probs=None, checked", lambda: rules[0].verify(point_draft, modes_probs, nobody)),
        ("GreedyRule (for reference), checked", lambda: greedy.verify(point_draft, target_probs, gens)),
        (f"to_probs [{n}, {v}], greedy", lambda: to_probs(target_logits, greedy_params)),
        (f"to_probs [{n}, {v}], temperature only", lambda: to_probs(target_logits, temp_only * n)),
        (f"to_probs [{n}, {v}], temperature + top_p", lambda: to_probs(target_logits, with_top_p * n)),
    ]
    rows = [(label, median_seconds(fn, args.repeats, args.warmup)) for label, fn in cases]

    bandwidth = read_bandwidth(args.bandwidth_gib, repeats=max(5, args.repeats // 2))
    weight_bytes = {name: args.params * bpp for name, bpp in BYTES_PER_PARAM.items()}
    decode = {name: nbytes / bandwidth for name, nbytes in weight_bytes.items()}

    print(f"verispec verification overhead: {cpu_name()}, torch {torch.__version__}, {args.threads} threads")
    print(
        f"B={b}  K={k}  V={v}  temperature={args.temperature}  top_p={args.top_p}  "
        f"median of {args.repeats} runs after {args.warmup} warm-up"
    )
    print(
        f"1-min load average before / after: {load_before} / {load_average()} "
        f"(on {len(os.sched_getaffinity(0))} CPUs; other processes inflate every figure)"
    )
    print(f"memory read bandwidth (sum over {args.bandwidth_gib:g} GiB fp32): {bandwidth / 1e9:.2f} GB/s")
    for name, sec in decode.items():
        print(
            f"  one decode step, {args.params / 1e9:g}B params in {name} ({BYTES_PER_PARAM[name]} B/param): "
            f"{weight_bytes[name] / 1e9:.2f} GB / {bandwidth / 1e9:.2f} GB/s = {sec * 1e3:.1f} ms"
        )
    print()
    width = max(len(label) for label, _ in rows)
    header = f"{'operation':<{width}}  {'time (ms)':>10}" + "".join(f"  {'÷ ' + name + ' step':>14}" for name in decode)
    print(header)
    print("-" * len(header))
    for label, sec in rows:
        ratios = "".join(f"  {sec / d:>14.3f}" for d in decode.values())
        print(f"{label:<{width}}  {sec * 1e3:>10.2f}{ratios}")
    print()
    print("ratio = operation time / estimated plain decode step (weight bytes / measured bandwidth);")
    print("a verify step emits up to K+1 tokens per request, a plain decode step exactly 1.")


if __name__ == "__main__":
    main()
