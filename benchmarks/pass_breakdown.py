"""Where does a forward pass's time go, operation by operation, and what does each add when the
pass verifies T tokens instead of decoding one?

Loads the 1.5B target (``--precision``, int4 by default) and runs its decoder layers op by op
(``Transformer._layers_on_kernels`` without the one-call ``Layers.forward``: the same kernels, called
from Python one at a time), with a timer around every kernel entry of the loaded module: each
projection (labelled by its role from the model's shapes: q+k+v, o, gate+up, down, the LM head,
and its kind: Q4_K, int8, Q6_K, bf16), attention, RMSNorm, RoPE, SwiGLU; ``other`` is the rest of
the op-by-op pass (Python between the calls, the KV cache writes, the embedding). The passes run
over T = 1 and each ``--widths`` after ``--context`` cached tokens, in turns, the cache rolled
back after each; reported are medians over ``--rounds`` rounds of the mean of ``--passes`` passes.
The one-call pass (what decoding runs) is timed in the same rounds, so the table says how much
the op-by-op path adds (mostly Python around ~300 calls). Each op's time includes the torch call
around its kernel, whose code and data a projection's weight stream has evicted (~20 us for the
first call after a projection on an Intel Xeon with AMX: ``results/torch_free_loop_intel.md``);
the one-call pass makes no such call between its kernels, so the small operations' rows overstate
what they cost there.

The column that matters for speculation is ``T - 1``: what verifying T tokens costs over one
decode step, op by op (the policy's c(T) and the S(alpha, K, c) model rest on it).

    python benchmarks/pass_breakdown.py [--precision int4] [--widths 8] [--context 160]
        [--rounds 8] [--passes 5] [--threads 2] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import textwrap
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_TARGET, load_model
from verispec.kernels import load

#: The kernel entries timed, and the kind of projection each is (None: a layer operation).
ENTRIES = {
    "q4k_linear": "Q4_K",
    "w8a8_linear": "int8",
    "q6k_linear": "Q6_K",
    "bf16_linear": "bf16",
    "attention_rows": None,
    "rms_norm": None,
    "rotary": None,
    "silu_mul": None,
}


def roles(config: Any) -> Callable[[int, int], str]:
    """The role of a projection [N x K] in a decoder of this config (several when shapes coincide)."""
    c, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    names = {
        (q + 2 * kv, c): "q+k+v",
        (kv, c): "k / v",
        (2 * f, c): "gate+up",
        (f, c): "gate / up",
        (c, f): "down",
        (config.vocab_size, c): "LM head",
    }
    names[(q, c)] = "q / o" if q == c else "q"
    names.setdefault((c, q), "o")
    return lambda n, k: names.get((n, k), f"{n} x {k}")


def timed_module(ops: Any, role_of: Callable[[int, int], str], seconds: dict[str, float]) -> Callable[[], None]:
    """Wraps the timed entries of the kernel module ``ops`` in place; returns what undoes it."""
    originals = {name: getattr(ops, name) for name in ENTRIES}

    def wrap(name: str, kind: str | None) -> Callable[..., Any]:
        inner = originals[name]
        # projections: (x, weights, [scales,] n, k, ...) -> the label of their role and kind
        at = 3 if name == "w8a8_linear" else 2

        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*args)
            label = name if kind is None else f"{role_of(int(args[at]), int(args[at + 1]))} ({kind})"
            seconds[label] += time.perf_counter() - t0
            return out

        return call

    for name, kind in ENTRIES.items():
        setattr(ops, name, wrap(name, kind))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(ops, name, fn)

    return undo


@torch.inference_mode()
def measure(model: Any, widths: list[int], context: int, rounds: int, passes: int) -> dict[str, Any]:
    """``{"ops": {T: {label: [ms per round]}}, "native": {T: [ms per round]}}``."""
    if getattr(model, "_native_layers", None) is None:
        raise SystemExit("this model does not run on the CPU kernels' one-call path (CPU, bf16 cache, packed weights)")
    ops = load()
    native = model._native_layers
    seconds: dict[str, float] = defaultdict(float)
    undo = timed_module(ops, roles(model.config), seconds)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = model.new_cache(1, context + max(widths))
    model(torch.randint(0, vocab, (1, context), generator=gen), None, cache, logits_at=torch.tensor([[context - 1]]))
    per_op: dict[int, dict[str, list[float]]] = {t: defaultdict(list) for t in widths}
    whole: dict[int, list[float]] = {t: [] for t in widths}
    try:
        for r in range(rounds + 1):  # (round 0 warms up)
            for t in widths:
                for one_call in (True, False):
                    model._native_layers = native if one_call else None
                    seconds.clear()
                    spent = 0.0
                    for _ in range(passes):
                        new = torch.randint(0, vocab, (1, t), generator=gen)
                        t0 = time.perf_counter()
                        model(new, None, cache)
                        spent += time.perf_counter() - t0
                        cache.truncate([context])
                    if r == 0:
                        continue
                    if one_call:
                        whole[t].append(1e3 * spent / passes)
                        continue
                    kernels = 0.0
                    for label, s in seconds.items():
                        per_op[t][label].append(1e3 * s / passes)
                        kernels += s
                    per_op[t]["other"].append(1e3 * (spent - kernels) / passes)
    finally:
        model._native_layers = native
        undo()
    return {"ops": {t: dict(v) for t, v in per_op.items()}, "native": whole}


def table(result: dict[str, Any], widths: list[int]) -> list[tuple[str, dict[int, float]]]:
    """One row per op: its median ms at each width, the most at the widest first."""
    labels = {label for per in result["ops"].values() for label in per}
    rows = [(label, {t: statistics.median(result["ops"][t].get(label, [0.0])) for t in widths}) for label in labels]
    return sorted(rows, key=lambda row: -row[1][widths[-1]])


def plot(
    rows: list[tuple[str, dict[int, float]]], widths: list[int], native: dict[int, float], title: str, path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, ms) for label, ms in rows if label != "other"]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(shown) + 2.4))
    height = 0.8 / len(widths)
    for i, t in enumerate(widths):
        ys = [y + i * height for y in range(len(shown))]
        ax.barh(ys, [ms[t] for _, ms in shown], height=height, label=f"T = {t} (one-call pass {native[t]:.1f} ms)")
    ax.set_yticks([y + 0.4 - height / 2 for y in range(len(shown))])
    ax.set_yticklabels([label for label, _ in shown])
    ax.invert_yaxis()
    ax.set_xlabel("ms per pass (all layers)")
    ax.set_title(textwrap.fill(title, 120), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="int4", help="the target's precision (int4, int8, bf16)")
    ap.add_argument("--widths", default="8", help="T of the verification passes set against T = 1")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    model = load_model(DEFAULT_TARGET, dtype=args.precision).model
    result = measure(model, widths, args.context, args.rounds, args.passes)
    rows = table(result, widths)
    native = {t: statistics.median(result["native"][t]) for t in widths}
    title = f"{DEFAULT_TARGET} {args.precision}, context {args.context}, {machine_line()}"
    print(f"### {title}, medians of {args.rounds} rounds")
    last = widths[-1]
    head = " | ".join(f"T = {t} ms" for t in widths)
    print(f"| op | {head} | T = {last} - T = 1 | ratio |")
    print("|---|" + "---|" * (len(widths) + 2))
    for label, ms in rows:
        cells = " | ".join(f"{ms[t]:.2f}" for t in widths)
        ratio = ms[last] / ms[1] if ms[1] > 0 else float("nan")
        print(f"| {label} | {cells} | {ms[last] - ms[1]:+.2f} | {ratio:.2f} |")
    total = {t: sum(ms[t] for _, ms in rows) for t in widths}
    print(f"| **op-by-op pass** | {' | '.join(f'{total[t]:.2f}' for t in widths)} | "
          f"{total[last] - total[1]:+.2f} | {total[last] / total[1]:.2f} |")  # fmt: skip
    print(f"| **one-call pass** | {' | '.join(f'{native[t]:.2f}' for t in widths)} | "
          f"{native[last] - native[1]:+.2f} | {native[last] / native[1]:.2f} |")  # fmt: skip
    if args.json:
        payload = {"title": title, "widths": widths, "rows": dict(rows), "one_call_ms": native, "raw": result}
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    if args.plot:
        plot(rows, widths, native, title, args.plot)


if __name__ == "__main__":
    main()
