"""Which draft precision makes a given target precision fastest? Side by side in one process.

The default pair, the target at ``--dtype``; one engine per draft precision in ``--drafts`` (model
drafter, its head cut to ``--draft-vocab`` ids, K per step from measured costs) and one without a
drafter, in rotating order per prompt (the host's speed moves from minute to minute), greedy,
``--tokens`` new tokens, tok/s counting the prompt's prefill. Every speculative output must equal
the plain one (asserted). Reported per configuration: the median tok/s, the median and geometric
mean of its per-prompt ratio to plain decoding, and the median share of draft tokens accepted.

    python benchmarks/draft_precisions_ab.py --dtype bf16 --drafts bf16,int4-all,int8 --prompts 8 \\
        [--draft-vocab 32768] [--json out.json]

A draft ``P+H`` is the draft in precision P with the LM head it has in precision H (e.g.
``int4-all+int8``: the int4-all layers, the int8 head).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from verispec.bench.prompts import prompt_set
from verispec.bench.stats import per_unit_ratios
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.drafters.model import restricted_head
from verispec.formats.loader import load_model
from verispec.pipeline import Pipeline, build

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def use_head_of(pipe: Pipeline, precision: str) -> None:
    """Give the draft of ``pipe`` the LM head the draft model has in ``precision`` (its layers stay
    as they are; the restricted head is cut from the new one)."""
    drafter: Any = pipe.engine.drafter
    drafter.model.lm_head = load_model(DRAFT, dtype=precision).model.lm_head
    if drafter._head_ids is not None:
        drafter._head_module = restricted_head(drafter.model, drafter._head_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", help="the target's precision")
    p.add_argument("--drafts", default="bf16,int4-all,int8", help="draft precisions (P+H: P's layers, H's head)")
    p.add_argument("--draft-vocab", type=int, default=32768, help="draft head size (0: the whole vocabulary)")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts (the first N)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    head = args.draft_vocab or None
    engines: dict[str, Pipeline] = {"plain": build(TARGET, None, drafter="none", dtype=args.dtype, max_batch=1)}
    for draft in args.drafts.split(","):
        precision, _, head_precision = draft.partition("+")
        engines[f"{draft} draft"] = build(TARGET, DRAFT, dtype=args.dtype, draft_dtype=precision, draft_head=head,
                                          max_batch=1)  # fmt: skip
        if head_precision:
            use_head_of(engines[f"{draft} draft"], head_precision)
    names = list(engines)
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    accepted: dict[str, list[float]] = {n: [] for n in names[1:]}
    for pi, text in enumerate(list(prompt_set("humaneval"))[: args.prompts]):
        ids = engines["plain"].target.tokenizer.encode(text)
        outputs: dict[str, list[int]] = {}
        for name in names[pi % len(names) :] + names[: pi % len(names)]:
            start = time.perf_counter()
            out = engines[name].engine.generate([ids], [SamplingParams(temperature=0.0, max_tokens=args.tokens)])[0]
            tok_s[name].append(len(out.token_ids) / (time.perf_counter() - start))
            outputs[name] = out.token_ids
            if name != "plain":
                accepted[name].append(out.stats.num_accepted_tokens / max(out.stats.num_draft_tokens, 1))
        assert all(o == outputs["plain"] for o in outputs.values()), f"prompt {pi}: a speculative output differs"
        print(pi, " ".join(f"{n} {tok_s[n][-1]:.2f}" for n in names), flush=True)
    machine = machine_line()
    print(f"### target {args.dtype}, draft head {head or 'whole'}, {len(tok_s['plain'])} HumanEval prompts, "
          f"{args.tokens} tokens, greedy: {machine}")  # fmt: skip
    summary: dict[str, Any] = {}
    for name in names:
        summary[name] = {
            "median_tok_s": statistics.median(tok_s[name]),
            **per_unit_ratios(tok_s[name], tok_s["plain"]),
            "median_accepted": statistics.median(accepted[name]) if name in accepted else None,
        }
        s = summary[name]
        shown = f", draft tokens accepted {s['median_accepted']:.3f}" if s["median_accepted"] is not None else ""
        print(f"{name}: median {s['median_tok_s']:.2f} tok/s, per prompt / plain: median {s['median_ratio']:.3f}, "
              f"geometric mean {s['geomean_ratio']:.3f}{shown}")  # fmt: skip
    if args.json is not None:
        payload = {"machine": machine, "args": vars(args) | {"json": str(args.json)}, "tok_s": tok_s,
                   "accepted": accepted, "summary": summary}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
