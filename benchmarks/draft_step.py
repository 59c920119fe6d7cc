"""What does one draft token cost, and where does the time go?

The default pair at the machine's defaults, greedy (or sampled: ``--temperature``, ``--top-p``):
the model drafter proposes ``--k`` tokens after a short code prompt, ``--rounds`` times (nothing
accepted: the draft cache goes back and one token is committed each round, so the context stays
~the same). Per draft token, medians over the rounds: the whole proposal, the native decoder
layers of the passes Python runs, the native drafting loop (the whole proposal in one call: its
layers, heads, laws and picks), the Python of the forward pass around the layers (cache plan,
masks, RoPE, embedding), the restricted LM head, and the rest of the proposal (laws, sampling,
bookkeeping). ``--loop both`` alternates proposals with the native loop and with the Python loop
round by round (the same drafter; greedy: the same tokens) and prints both. To compare two
versions of the Python, run it from two checkouts in turn (``PYTHONPATH=OTHER_CHECKOUT python
benchmarks/draft_step.py``): the host's speed moves by 20-30% from minute to minute, so alternate
them and compare the parts, not one run against another.

    python benchmarks/draft_step.py [--k 4] [--rounds 80] [--temperature 0.7 --top-p 0.95] [--loop both]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import verispec
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.drafters.base import BatchView
from verispec.pipeline import build, machine_defaults
from verispec.sampling import make_generator

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return out

    return wrapper


class _Timed:
    """A stand-in for the model's native layers that times their forward and chain passes."""

    def __init__(self, inner: Any, into: list[float]) -> None:
        self.forward = timed(inner.forward, into)
        self.chain = timed(inner.chain, into)
        self.draft = inner.draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=80)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled drafts (laws built and drawn from)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--loop",
        choices=("native", "python", "both"),
        default="native",
        help="the native drafting loop (where it runs), Python's, or both alternating",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    picked = machine_defaults(TARGET, DRAFT, "cpu")
    pipe = build(TARGET, DRAFT, dtype=picked.dtype, draft_dtype=picked.draft_dtype, draft_head=picked.draft_head,
                 max_batch=1, max_len=2048)  # fmt: skip
    drafter = pipe.engine.drafter
    model = drafter.model
    native: list[float] = []
    chain: list[float] = []
    forward: list[float] = []
    head: list[float] = []
    if model._native_layers is None:
        raise SystemExit("the draft does not run on verispec's kernels here: nothing to split")
    model._native_layers = _Timed(model._native_layers, native)
    model.forward_with_hidden = timed(model.forward_with_hidden, forward)
    model.draft = timed(model.draft, chain)
    if drafter._head_module is not None:
        drafter._head_module.forward = timed(drafter._head_module.forward, head)
    natively = drafter._natively
    loops = ["native", "python"] if args.loop == "both" else [args.loop]
    context = list(pipe.target.tokenizer.encode(PROMPT))
    drafter.begin("r", context)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    generator = None if params.greedy else make_generator(0)
    proposals: dict[str, list[tuple[float, ...]]] = {loop: [] for loop in loops}
    for r in range(len(loops) * (args.rounds + 1)):
        loop = loops[r % len(loops)]
        drafter._natively = natively if loop == "native" else (lambda: False)  # type: ignore[method-assign]
        for times in (native, chain, forward, head):
            times.clear()
        start = time.perf_counter()
        drafter.propose(BatchView(["r"], [params], [generator]), [args.k])
        whole = time.perf_counter() - start
        drafter.observe("r", [0])  # nothing accepted: the cache goes back
        context.append(context[-1])  # and one token is committed
        parts = (sum(native), sum(chain), sum(forward) - sum(native), sum(head))
        proposals[loop].append((whole, *parts))
    names = ("draft token", "native layers", "native drafting loop", "forward's Python", "restricted head")
    law = "greedy" if params.greedy else f"temperature {args.temperature}, top_p {args.top_p}"
    print(f"verispec from {Path(verispec.__file__).parent.parent}, K = {args.k}, {args.rounds} proposals, {law}")
    print(f"  {machine_line()}")
    table: dict[str, dict[str, float]] = {}
    for loop, rounds in proposals.items():
        rows = rounds[1:]  # (the first fed the prompt)
        ms = {name: statistics.median(row[i] for row in rows) / args.k * 1e3 for i, name in enumerate(names)}
        ms["laws, sampling, rest"] = ms["draft token"] - sum(v for k, v in ms.items() if k != "draft token")
        table[loop] = ms
    print("  " + " " * 22 + "".join(f"{loop + ' loop':>14s}" for loop in table))
    for name in table[loops[0]]:
        print(f"  {name:22s}" + "".join(f"{table[loop][name]:11.2f} ms" for loop in table))
    if args.json is not None:
        source = str(Path(verispec.__file__).parent)
        out = {"k": args.k, "rounds": args.rounds, "temperature": args.temperature, "top_p": args.top_p,
               "verispec": source, "machine": machine_line(), "ms_per_draft_token": table}  # fmt: skip
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
