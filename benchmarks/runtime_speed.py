"""How fast is the runtime on this machine, and how far from the memory-bandwidth limit?

Builds a model with Qwen2.5-1.5B's shapes (hidden 1536, intermediate 8960, 28 layers, 12 heads,
2 kv heads, vocab 151936, tied embeddings, qkv bias) and random weights, then times one forward
pass over T = 1, 2, 4, 8, 16 new tokens after a prompt (the pass a speculative step runs to verify
T - 1 draft tokens), always at the same context length (the cache is rolled back after each pass).

Decode is memory-bound: a pass must stream every weight once, so ``weight bytes / bandwidth`` is
a floor for the T = 1 time; the printed limits use a nominal 32 GB/s and the read bandwidth
measured here. The ratio ``time(T) / time(T=1)`` is the verification cost the speedup model of
speculative decoding needs (c and the cost of a K-token pass).

    python benchmarks/runtime_speed.py [--threads 2] [--dtype bf16] [--context 256] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.kernels.bandwidth import probe_buffer
from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer, random_state_dict

QWEN25_15B = ModelConfig(
    architecture="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    head_dim=128,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position=32768,
    tie_word_embeddings=True,
    attention_bias=True,
)
NOMINAL_GBPS = 32.0


def read_bandwidth_gbps(reps: int = 5) -> float:
    """Read bandwidth of this machine with the current thread count: summing a 1 GiB fp32 tensor."""
    x = probe_buffer(2**30)  # (on huge pages where the OS gives them, as the weights are mapped)
    x.sum()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / min(times) / 1e9


def time_passes(model: Transformer, context: int, sizes: list[int], reps: int) -> dict[int, list[float]]:
    """Seconds of each pass over ``t`` new tokens after ``context`` cached ones, for every ``t`` in
    ``sizes``; the sizes take turns (round robin) so that a busy machine slows them all alike."""
    cache = model.new_cache(1, context + max(sizes))
    prompt = torch.randint(0, model.config.vocab_size, (1, context))
    model(prompt, None, cache, logits_at=torch.tensor([[context - 1]]))
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for i in range(reps + 1):
        for t in sizes:
            new = torch.randint(0, model.config.vocab_size, (1, t))
            t0 = time.perf_counter()
            model(new, None, cache)
            elapsed = time.perf_counter() - t0
            cache.truncate([context])
            if i > 0:  # the first round warms up allocators and kernels
                times[t].append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before each timed pass")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=QWEN25_15B.num_layers, help="fewer for a quick look")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = QWEN25_15B if args.layers == QWEN25_15B.num_layers else _with_layers(args.layers)
    t0 = time.perf_counter()
    model = Transformer(cfg, random_state_dict(cfg, seed=0, dtype=dtype), dtype=dtype)
    build_s = time.perf_counter() - t0
    gbytes = model.weight_bytes() / 1e9
    bandwidth = read_bandwidth_gbps()

    print(
        f"Qwen2.5-1.5B shapes ({cfg.num_layers} layers), {args.dtype}, random weights, "
        f"torch {torch.__version__}, {args.threads} threads, context {args.context}, "
        f"{args.reps} repetitions (built in {build_s:.0f} s)"
    )
    print(f"weights streamed per pass: {gbytes:.2f} GB")
    print(f"floor at {NOMINAL_GBPS:.0f} GB/s (nominal): {gbytes / NOMINAL_GBPS * 1e3:7.1f} ms")
    print(
        f"floor at {bandwidth:.1f} GB/s (measured read bandwidth, {args.threads} threads): "
        f"{gbytes / bandwidth * 1e3:7.1f} ms"
    )
    print()
    print(f"{'T':>3}  {'best ms':>8}  {'median ms':>9}  {'x T=1':>6}  {'ms / token':>10}  {'GB/s':>5}")
    times = time_passes(model, args.context, args.tokens, args.reps)
    base = min(times[args.tokens[0]])
    for t in args.tokens:
        best, median = min(times[t]), statistics.median(times[t])
        print(
            f"{t:>3}  {best * 1e3:8.1f}  {median * 1e3:9.1f}  {best / base:6.2f}  "
            f"{best * 1e3 / t:10.1f}  {gbytes / best:5.1f}"
        )
    print("(best of the repetitions is the figure to trust on a shared machine; x T=1 and GB/s use it)")


def _with_layers(n: int) -> ModelConfig:
    from dataclasses import replace

    return replace(QWEN25_15B, num_layers=n)


if __name__ == "__main__":
    main()
