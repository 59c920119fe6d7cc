"""How much of a forward pass runs outside the native kernels? (Issue 12's target: <= 1 ms.)

Loads the default pair (the 1.5B target in int4, the 0.5B draft in int4-all, or what
``--target-dtype`` / ``--draft-dtype`` say) and times decode passes over T new tokens after
``--context`` cached ones, the logits of every row computed (as a verification needs). Inside each
pass it times the two native calls that do the work: ``Layers.forward`` (every decoder layer, one
call: ``csrc/bindings.cpp``) and the LM head's projection. What is left, ``pass - layers - head``,
is Python and torch around them: the step plan, the embedding lookup, RoPE's tables, the
visibility mask, the first RMSNorm, the logits' cast. Medians over ``--reps`` passes per width.

    python benchmarks/python_overhead.py [--widths 1,5] [--reps 60] [--context 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model


class Timed:
    """Stands in for the native ``Layers`` object and adds up the seconds its ``forward`` takes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def forward(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner.forward(*args)
        self.seconds += time.perf_counter() - t0
        return out


def head_timer(head: torch.nn.Module) -> list[float]:
    """Hooks on the LM head that add its seconds to the returned one-element list."""
    total, start = [0.0], [0.0]
    head.register_forward_pre_hook(lambda *_: start.__setitem__(0, time.perf_counter()))
    head.register_forward_hook(lambda *_: total.__setitem__(0, total[0] + time.perf_counter() - start[0]))
    return total


@torch.inference_mode()
def measure(model: Any, widths: list[int], context: int, reps: int) -> dict[int, dict[str, float]]:
    if getattr(model, "_native_layers", None) is None or model.lm_head is None:
        raise SystemExit("this model does not run on the one-call native path (CPU kernels, bf16 cache)")
    layers = model._native_layers = Timed(model._native_layers)
    head = head_timer(model.lm_head)
    cache = model.new_cache(1, context + max(widths))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    model(torch.randint(0, vocab, (1, context), generator=gen), None, cache, logits_at=torch.tensor([[context - 1]]))
    rows: dict[int, dict[str, list[float]]] = {t: {"pass": [], "layers": [], "head": []} for t in widths}
    for rep in range(reps + 1):
        for t in widths:
            new = torch.randint(0, vocab, (1, t), generator=gen)
            layers.seconds, head[0] = 0.0, 0.0
            t0 = time.perf_counter()
            model(new, None, cache)
            elapsed = time.perf_counter() - t0
            cache.truncate([context])
            if rep > 0:  # the first round warms up
                rows[t]["pass"].append(elapsed)
                rows[t]["layers"].append(layers.seconds)
                rows[t]["head"].append(head[0])
    out: dict[int, dict[str, float]] = {}
    for t, r in rows.items():
        outside = [p - a - b for p, a, b in zip(r["pass"], r["layers"], r["head"], strict=True)]
        out[t] = {k: 1e3 * statistics.median(v) for k, v in (*r.items(), ("outside", outside))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,5", help="new tokens per pass, comma-separated")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-dtype", default="int4")
    ap.add_argument("--draft-dtype", default="int4-all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",") if w]
    print(f"### Python outside the native calls: {machine_line()}, {args.context} cached tokens, "
          f"median of {args.reps} passes")  # fmt: skip
    print("| model | T | pass ms | Layers.forward ms | LM head ms | outside ms |\n|---|---|---|---|---|---|")
    for name, dtype in ((DEFAULT_TARGET, args.target_dtype), (DEFAULT_DRAFT, args.draft_dtype)):
        model = load_model(name, dtype=dtype).model
        for t, m in measure(model, widths, args.context, args.reps).items():
            print(f"| {name} {dtype} | {t} | {m['pass']:.2f} | {m['layers']:.2f} | {m['head']:.2f} | "
                  f"**{m['outside']:.2f}** |")  # fmt: skip


if __name__ == "__main__":
    main()
