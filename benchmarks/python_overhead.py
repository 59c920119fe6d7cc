"""How much of a forward pass runs outside the native kernels? (Issue 12's target: <= 1 ms.)

Loads the default pair (the 1.5B target in int4, the 0.5B draft in int4-all, or what
``--target-dtype`` / ``--draft-dtype`` say) and times decode passes over T new tokens after
``--context`` cached ones, the logits of every row computed (as a verification needs), by two
paths of the same pass, alternated:

- ``native``: what a chain pass runs, ``Layers.chain`` (``csrc/bindings.cpp``): the embedding, the
  first norm, every decoder layer, the LM head and the logits' cast in one call;
- ``general``: the same pass down the general path (as a prompt's chunk goes): the step plan, the
  embedding lookup, RoPE's tables, the visibility mask, the first RMSNorm in Python and torch,
  ``Layers.forward`` (every decoder layer, one call), the LM head's projection, the logits' cast.

Inside each pass it times the native calls that do the work (``Layers.chain``; or
``Layers.forward`` and the LM head); ``outside`` = pass - those is Python and torch around them.
Medians over ``--reps`` passes per width.

With ``--tree`` each pass is a tree of T nodes (binary, breadth-first) verified in one pass: its
mask and positions (length + depth) given, as the engine's tree verification gives them.

    python benchmarks/python_overhead.py [--widths 1,5] [--reps 60] [--context 128] [--threads 2] [--tree]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from verispec.models.transformer import tree_attention_mask


class Timed:
    """Stands in for the native ``Layers`` object and adds up the seconds its ``forward`` and
    ``chain`` take."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def _timed(self, name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = getattr(self.inner, name)(*args)
        self.seconds += time.perf_counter() - t0
        return out

    def forward(self, *args: Any) -> Any:
        return self._timed("forward", *args)

    def chain(self, *args: Any) -> Any:
        return self._timed("chain", *args)


def head_timer(head: torch.nn.Module) -> list[float]:
    """Hooks on the LM head that add its seconds to the returned one-element list."""
    total, start = [0.0], [0.0]
    head.register_forward_pre_hook(lambda *_: start.__setitem__(0, time.perf_counter()))
    head.register_forward_hook(lambda *_: total.__setitem__(0, total[0] + time.perf_counter() - start[0]))
    return total


PATHS = ("native", "general")


@torch.inference_mode()
def tree_of(t: int) -> torch.Tensor:
    """The mask ``[1, T, T]`` of a binary tree of ``t`` nodes in breadth-first order."""
    return tree_attention_mask(torch.tensor([[-1] + [(q - 1) // 2 for q in range(1, t)]]))


def measure(
    model: Any, widths: list[int], context: int, reps: int, tree: bool
) -> dict[tuple[int, str], dict[str, float]]:
    if getattr(model, "_native_layers", None) is None or model.lm_head is None:
        raise SystemExit("this model does not run on the one-call native path (CPU kernels, bf16 cache)")
    layers = model._native_layers = Timed(model._native_layers)
    head = head_timer(model.lm_head)
    cache = model.new_cache(1, context + max(widths))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    model(torch.randint(0, vocab, (1, context), generator=gen), None, cache, logits_at=torch.tensor([[context - 1]]))
    rows: dict[tuple[int, str], dict[str, list[float]]] = {
        (t, path): {"pass": [], "native": []} for t in widths for path in PATHS
    }
    for rep in range(reps + 1):
        for t in widths:
            for path in PATHS if rep % 2 else PATHS[::-1]:
                new = torch.randint(0, vocab, (1, t), generator=gen)
                mask = positions = None
                if tree:  # (its mask and positions, length + depth, as the engine builds them)
                    mask = tree_of(t)
                    positions = cache.lengths[:1, None] + mask.sum(dim=2) - 1
                if path == "general":  # (the one-call pass declines: the general path runs)
                    model._chain_natively = lambda *args: None
                else:
                    vars(model).pop("_chain_natively", None)
                layers.seconds, head[0] = 0.0, 0.0
                t0 = time.perf_counter()
                model(new, positions, cache, attn_mask=mask)
                elapsed = time.perf_counter() - t0
                cache.truncate([context])
                if rep > 0:  # the first round warms up
                    rows[t, path]["pass"].append(elapsed)
                    rows[t, path]["native"].append(layers.seconds + head[0])
    out: dict[tuple[int, str], dict[str, float]] = {}
    for key, r in rows.items():
        outside = [p - n for p, n in zip(r["pass"], r["native"], strict=True)]
        out[key] = {k: 1e3 * statistics.median(v) for k, v in (*r.items(), ("outside", outside))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,5", help="new tokens per pass, comma-separated")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-dtype", default="int4")
    ap.add_argument("--draft-dtype", default="int4-all")
    ap.add_argument("--tree", action="store_true", help="each pass a tree (binary, breadth-first) verified in one pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",") if w]
    shape = "trees verified in one pass" if args.tree else "chains"
    print(f"### Python outside the native calls, {shape}: {machine_line()}, {args.context} cached tokens, "
          f"median of {args.reps} passes")  # fmt: skip
    print("| model | T | path | pass ms | in native calls ms | outside ms |\n|---|---|---|---|---|---|")
    for name, dtype in ((DEFAULT_TARGET, args.target_dtype), (DEFAULT_DRAFT, args.draft_dtype)):
        model = load_model(name, dtype=dtype).model
        for (t, path), m in measure(model, widths, args.context, args.reps, args.tree).items():
            print(f"| {name} {dtype} | {t} | {path} | {m['pass']:.2f} | {m['native']:.2f} | **{m['outside']:.2f}** |")


if __name__ == "__main__":
    main()
