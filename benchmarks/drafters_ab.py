"""Drafters side by side on a prompt set: which one makes the default pair fastest?

One process, one engine per configuration over the machine's defaults (precisions, draft head, K per
step), the configurations in rotating order per prompt (the host's speed moves from minute to
minute), 128 tokens each, tok/s counting the prompt's prefill. Greedy runs assert that every
configuration gives the same tokens. Sampled runs sample different texts per configuration unless
``--k`` fixes the draft length (the measured policy's K follows timings, and with it the draws):
with it they count the prompts whose text the configurations share. Configurations: ``plain`` (no
drafter), ``model``, ``composite`` (the suffix lookup, else the model: what ``--drafter composite``
builds), ``composite-before`` (the composite as it was before its lookups drafted on the steps the
policy gave the model none, and before the policy kept them out of the model's acceptance),
``ngram-composite`` (the composite with prompt lookup instead of the suffix lookup, as it was
before), ``suffix``, ``ngram``; ``model-python-loop`` and ``composite-python-loop``: those drafters
drafting in Python's loop instead of one native call a proposal (as before it);
``plain-general-pass``, ``model-general-pass``, ``composite-general-pass``: every model pass by the
general path (the step planned in Python and torch around ``Layers.forward``), as before a chain
pass ran in one native call (``Layers.chain``). Printed
per prompt: each configuration's tok/s, and how many of its decode steps drafted and how many of
those drafts a lookup made for free; reported per configuration: the median tok/s, and the median
and geometric mean of its per-prompt ratio to the first configuration.

    python benchmarks/drafters_ab.py --configs model,composite,ngram-composite,plain --set humaneval \\
        --prompts 16 [--temperature 0] [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from verispec.bench.prompts import prompt_set
from verispec.bench.stats import per_unit_ratios
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.drafters.ngram import NgramDrafter
from verispec.pipeline import Pipeline, build, machine_defaults

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CONFIGS = ("plain", "model", "composite", "composite-before", "ngram-composite", "suffix", "ngram",
           "model-python-loop", "composite-python-loop", "plain-general-pass", "model-general-pass",
           "composite-general-pass")  # fmt: skip


def engine_for(name: str, k: int | None = None) -> Pipeline:
    if name.endswith("-general-pass"):  # every pass by the general path, as before chain passes ran in one call
        pipe = engine_for(name.removesuffix("-general-pass"), k)
        drafter = pipe.engine.drafter
        models = [
            pipe.engine.target,
            getattr(drafter, "model", None),
            getattr(getattr(drafter, "model", None), "model", None),
        ]
        for model in models:
            if hasattr(model, "_chain_natively"):
                model._chain_natively = lambda *args: None  # type: ignore[union-attr]
        return pipe
    picked = machine_defaults(TARGET, DRAFT, "cpu")
    if name in ("plain", "suffix", "ngram"):
        return build(TARGET, None, drafter="none" if name == "plain" else name, dtype=picked.dtype, max_batch=1,
                     max_len=4096)  # fmt: skip
    drafter = "composite" if name in ("ngram-composite", "composite-before") else name.removesuffix("-python-loop")
    pipe = build(TARGET, DRAFT, drafter=drafter, dtype=picked.dtype, draft_dtype=picked.draft_dtype,
                 draft_head=picked.draft_head, max_batch=1, max_len=4096, k=k)  # fmt: skip
    if name == "composite-before":  # lookups only where the model drafts, counted in the model's acceptance
        pipe.engine.drafter.free_when_off = False  # type: ignore[attr-defined]
        observe = pipe.engine.policy.observe
        pipe.engine.policy.observe = lambda *a, **kw: observe(*a[:7])  # type: ignore[method-assign]
    if name == "ngram-composite":
        pipe.engine.drafter.lookup = NgramDrafter(2, 4)  # type: ignore[attr-defined]
    if name.endswith("-python-loop"):  # drafts by the drafter's Python loop
        model = pipe.engine.drafter if drafter == "model" else pipe.engine.drafter.model  # type: ignore[attr-defined]
        model._natively = lambda: False
    return pipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="model,composite,ngram-composite,plain")
    p.add_argument("--set", default="humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--k", type=int, default=None, help="a fixed draft length instead of the measured policy")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    names = [c for c in args.configs.split(",") if c]
    if not names or not set(names) <= set(CONFIGS):
        p.error(f"--configs takes some of {', '.join(CONFIGS)}")
    engines = {name: engine_for(name, args.k) for name in names}
    tok_s: dict[str, list[float]] = {name: [] for name in names}
    # per prompt: decode steps, steps with a draft, drafts a lookup made for free (no model pass)
    steps: dict[str, list[dict[str, int]]] = {name: [] for name in names}
    same: dict[str, list[bool]] = {name: [] for name in names}  # each prompt's text equal to the first config's
    for pi, text in enumerate(list(prompt_set(args.set))[: args.prompts]):
        ids = engines[names[0]].target.tokenizer.encode(text)
        first: list[int] | None = None
        for name in names if pi % 2 == 0 else names[::-1]:
            params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, seed=1000 + pi)
            start = time.perf_counter()
            out = engines[name].engine.generate([ids], [params])[0]
            tok_s[name].append(len(out.token_ids) / (time.perf_counter() - start))
            st = out.stats  # (every step commits its accepted tokens and one more; the first comes from the prefill)
            steps[name].append({"steps": len(out.token_ids) - 1 - st.num_accepted_tokens, "drafts": st.num_drafts,
                                "free": st.num_free_drafts})  # fmt: skip
            if args.temperature == 0 or args.k is not None:  # (sampled: the same draws only with the same K)
                first = first if first is not None else out.token_ids
                same[name].append(out.token_ids == first)
                assert args.temperature > 0 or out.token_ids == first, (pi, name)
        shown = (f"{name}={tok_s[name][-1]:.1f} ({steps[name][-1]['drafts']} drafts, {steps[name][-1]['free']} free, "
                 f"{steps[name][-1]['steps']} steps)" for name in names)  # fmt: skip
        print(pi, " ".join(shown), flush=True)
    summary = {}
    machine = machine_line()
    print(f"# {machine}")
    for name in names:
        summary[name] = {"median_tok_s": statistics.median(tok_s[name])} | per_unit_ratios(tok_s[name], tok_s[names[0]])
        agree = f"; the same text on {sum(same[name])} of {len(same[name])} prompts" if same[name] else ""
        ratios = f"median {summary[name]['median_ratio']:.3f}, geometric mean {summary[name]['geomean_ratio']:.3f}"
        print(f"{name}: median {summary[name]['median_tok_s']:.2f} tok/s; per prompt / {names[0]}: {ratios}{agree}")
    if args.json is not None:
        payload = {"machine": machine, "args": vars(args) | {"json": str(args.json)}, "tok_s": tok_s,
                   "steps": steps, "same_text": same, "summary": summary}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
