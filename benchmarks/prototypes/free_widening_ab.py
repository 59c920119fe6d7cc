"""Does capping how far a composite's free (lookup) drafts widen the target's pass cost anything?

Two engines with the composite drafter over the machine's defaults, side by side in one process,
the order alternating per group of prompts: ``capped`` (the policy's ``free_widening``, by default
0.25: free drafts widen the planned pass while its cost grows by at most 25% over the batch size;
``--share``) and ``uncapped`` (free
drafts run to ``max_k`` whatever the pass costs, as before). Greedy, 128 tokens, ``--batch``
prompts generated together; every group's outputs asserted equal. Prints tok/s per group and the
geometric mean of capped / uncapped.

    python benchmarks/prototypes/free_widening_ab.py --sets summarize,chat --prompts 8 [--batch 1] [--share 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import time

from verispec.bench.prompts import prompt_set
from verispec.config import SamplingParams
from verispec.pipeline import Pipeline, build, machine_defaults

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def composite(batch: int) -> Pipeline:
    picked = machine_defaults(TARGET, DRAFT, "cpu")
    return build(TARGET, DRAFT, drafter="composite", dtype=picked.dtype, draft_dtype=picked.draft_dtype,
                 draft_head=picked.draft_head, max_batch=batch, max_len=4096)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="summarize,chat")
    p.add_argument("--prompts", type=int, default=8, help="per set")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--share", type=float, default=0.25, help="the capped engine's free_widening")
    args = p.parse_args()
    engines = {"uncapped": composite(args.batch), "capped": composite(args.batch)}
    engines["uncapped"].engine.policy.free_widening = float("inf")  # type: ignore[attr-defined]
    engines["capped"].engine.policy.free_widening = args.share  # type: ignore[attr-defined]
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    groups = []
    for set_name in args.sets.split(","):
        texts = list(prompt_set(set_name))[: args.prompts]
        groups += [(set_name, texts[i : i + args.batch]) for i in range(0, len(texts), args.batch)]
    for gi, (set_name, texts) in enumerate(groups):
        names = list(engines) if gi % 2 == 0 else list(engines)[::-1]
        ids = [engines[names[0]].target.tokenizer.encode(t) for t in texts]
        first = None
        for name in names:
            start = time.perf_counter()
            outs = engines[name].engine.generate(ids, [SamplingParams(temperature=0, max_tokens=128)] * len(ids))
            tok_s[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            got = [list(o.token_ids) for o in outs]
            first = first if first is not None else got
            assert got == first, (set_name, gi, name)
        print(set_name, gi, " ".join(f"{n}={tok_s[n][-1]:.1f}" for n in engines), flush=True)
    ratios = [a / b for a, b in zip(tok_s["capped"], tok_s["uncapped"], strict=True)]
    print(f"capped / uncapped, batch {args.batch}: geometric mean {statistics.geometric_mean(ratios):.3f}, "
          f"median {statistics.median(ratios):.3f} over {len(ratios)} groups")  # fmt: skip


if __name__ == "__main__":
    main()
