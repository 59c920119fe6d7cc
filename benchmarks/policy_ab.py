"""A/B of the draft-length policy's acceptance estimate, with fixed draft lengths as yardsticks.

"old": each position's record shrunk towards the estimate of the position before, position 1
towards a fixed 0.6 (re-implemented here as the reference); "new": each position shrunk towards
the acceptance pooled over all positions (:class:`verispec.engine.policy.MeasuredPolicy`), K as
chosen; "stop": the same, a draft then running to 8 tokens and ending where its confidence says
the next token does not pay (:mod:`verispec.engine.confidence`; today's default); "stop12": the
same with a ceiling of 12 tokens instead of ``max_draft_tokens`` (8); "warm": today's
policy kept from one generation to the next (as a server's is: it starts each request knowing what
the draft did before); "k2", "k3", "k4": a fixed draft length. "old" and "new" draft K exactly. One process,
the default pair at the machine's defaults, a fresh policy per generation otherwise (a cold start,
as each ``verispec generate`` is), greedy, 128 tokens, the variants and plain in rotating order
per repeat; tok/s counts the prompt's prefill too. Asserts that all give the same tokens. The
composite's suffix index keeps no earlier requests here: the variants share one drafter, and each
would otherwise find the answer the variant before it produced.

    python benchmarks/policy_ab.py --set humaneval --prompts 8 --repeats 2 --json out.json
    python benchmarks/policy_ab.py --text "def quicksort(arr):" --repeats 4 --json out.json
    python benchmarks/policy_ab.py --variants new,warm,k3,k4 ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from verispec.bench.prompts import prompt_set
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.engine.calibrate import load_or_calibrate
from verispec.engine.policy import FixedPolicy, MeasuredPolicy
from verispec.formats.registry import verispec_home
from verispec.pipeline import build, machine_defaults

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def previous_position_acceptance(self: MeasuredPolicy, request_id: str | None = None) -> list[float]:
    """The policy's estimate before the change: position 1 from a fixed prior, each later one
    from the engine-wide estimate of the position before it."""
    out = []
    start = self.prior_accept
    for i in range(self.max_k):
        engine = (self.passed[i] + start * self.prior_weight) / (self.reached[i] + self.prior_weight)
        estimate = engine
        if request_id is not None and request_id in self.per_request:
            reached, passed = self.per_request[request_id]
            estimate = (passed[i] + engine * self.prior_weight) / (reached[i] + self.prior_weight)
        out.append(min(max(estimate, 0.0), 0.999))
        start = min(max(engine, 0.0), 0.999)
    return out


VARIANTS = ("old", "new", "stop", "stop12", "warm", "k2", "k3", "k4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="humaneval")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--text", default=None, help="one prompt instead of a set")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--drafter", default="model", choices=("model", "composite"))
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (outputs then differ; not compared)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    args = p.parse_args()
    variants = [*(v for v in args.variants.split(",") if v), "plain"]
    if not set(variants) <= {*VARIANTS, "plain"}:
        p.error(f"--variants takes some of {', '.join(VARIANTS)}")
    current = MeasuredPolicy.acceptance
    picked = machine_defaults(TARGET, DRAFT, "cpu")
    spec = build(TARGET, DRAFT, drafter=args.drafter, dtype=picked.dtype, draft_dtype=picked.draft_dtype,
                 draft_head=picked.draft_head, max_batch=1, max_len=2048)  # fmt: skip
    plain = build(TARGET, None, drafter="none", dtype=picked.dtype, max_batch=1, max_len=2048).engine
    lookup = getattr(spec.engine.drafter, "lookup", None)
    if lookup is not None and hasattr(lookup, "corpus_tokens"):
        # no memory across requests: one variant's output would be the lookup's draft for the next
        lookup.corpus_tokens = 0
    costs = load_or_calibrate(spec.engine.target, spec.target.name, verispec_home(), batch_sizes=[1])
    prompts = [args.text] if args.text else list(prompt_set(args.set))[: args.prompts]
    greedy = args.temperature == 0.0
    rows = []
    warm = MeasuredPolicy(spec.engine.config.max_draft_tokens, costs=costs)
    for pi, text in enumerate(prompts):
        ids = spec.target.tokenizer.encode(text)
        outputs = {}
        for rep in range(args.repeats):
            params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, seed=None if greedy else rep)
            for name in variants if rep % 2 == 0 else variants[::-1]:
                engine = plain
                if name == "warm":
                    MeasuredPolicy.acceptance = current  # type: ignore[method-assign]
                    spec.engine.policy = warm
                    engine = spec.engine
                elif name == "stop12":
                    MeasuredPolicy.acceptance = current  # type: ignore[method-assign]
                    spec.engine.policy = MeasuredPolicy(12, costs=costs)
                    engine = spec.engine
                elif name in ("old", "new", "stop"):
                    MeasuredPolicy.acceptance = previous_position_acceptance if name == "old" else current  # type: ignore[method-assign]
                    spec.engine.policy = MeasuredPolicy(
                        spec.engine.config.max_draft_tokens, costs=costs, confidence_stop=name == "stop"
                    )
                    engine = spec.engine
                elif name != "plain":
                    spec.engine.policy = FixedPolicy(int(name[1:]))
                    engine = spec.engine
                start = time.perf_counter()
                out = engine.generate([ids], [params])[0]
                rate = len(out.token_ids) / (time.perf_counter() - start)
                outputs.setdefault(name, out.token_ids)
                assert not greedy or out.token_ids == next(iter(outputs.values())), (pi, name)
                st = out.stats
                rows.append({"prompt": pi, "repeat": rep, "policy": name, "tok_s": rate, "tokens": len(out.token_ids),
                             "drafted": st.num_draft_tokens, "accepted": st.num_accepted_tokens,
                             "drafts": st.num_drafts})  # fmt: skip
                print(pi, rep, name, f"{rate:.2f}", flush=True)
    MeasuredPolicy.acceptance = current  # type: ignore[method-assign]
    summary = {
        name: [statistics.median(r["tok_s"] for r in rows if r["prompt"] == pi and r["policy"] == name)
               for pi in range(len(prompts))]
        for name in variants
    }  # fmt: skip
    machine = machine_line()
    print(f"# {machine}")
    print(f"# {args.drafter} drafter, {len(prompts)} prompts, {args.tokens} tokens, temperature {args.temperature}, "
          f"{args.repeats} repeats")  # fmt: skip
    for name in variants[:-1]:
        ratios = [a / b for a, b in zip(summary[name], summary["plain"], strict=True)]
        mine = [r for r in rows if r["policy"] == name]
        drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
        drafts = sum(r["drafts"] for r in mine)
        print(f"{name}: median speedup over plain {statistics.median(ratios):.3f} "
              f"(geometric mean {statistics.geometric_mean(ratios):.3f}); acceptance {accepted / max(drafted, 1):.3f}, "
              f"{drafted / max(drafts, 1):.2f} tokens per draft, {accepted / max(drafts, 1) + 1:.2f} per "
              "speculative step", [f"{r:.2f}" for r in ratios])  # fmt: skip
    if args.json is not None:
        payload = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                   "summary": summary}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
