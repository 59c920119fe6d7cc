"""Draft heads side by side: how many token ids should the draft score, and should it add the
request's own ids (:mod:`verispec.drafters.model`, ``context_ids``)?

One process, one engine per variant over the machine's defaults (precisions, K per step, the
confidence stop), the model drafter, greedy, 128 tokens, one warm-up generation per engine, then
the variants and plain decoding in rotating order per prompt, tok/s counting the prompt's prefill.
A variant is ``N`` (the first N ids and the stop ids), ``N+context`` (and each request's own ids
outside them) or ``plain``. Asserts that every variant gives plain decoding's tokens. Printed per
prompt: each variant's tok/s; reported per variant: the median tok/s, the median and geometric mean
of its per-prompt ratio to plain, the pooled acceptance rate and tokens per decode step, and the
share of the output tokens its draft could not propose (outside its head; with context ids,
outside the head and the request's context so far).

    python benchmarks/draft_head_ab.py --variants 32768,32768+context,16384+context,plain \\
        --set humaneval --prompts 16 [--json out.json]
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
from verispec.pipeline import Pipeline, build, machine_defaults

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def parse_variant(name: str) -> tuple[int, bool] | None:
    """``N`` -> (N, False), ``N+context`` -> (N, True), ``plain`` -> None."""
    if name == "plain":
        return None
    size, _, extra = name.partition("+")
    if not size.isdigit() or extra not in ("", "context"):
        raise SystemExit(f"a variant is N, N+context or plain, got {name!r}")
    return int(size), extra == "context"


def engine_for(variant: tuple[int, bool] | None) -> Pipeline:
    picked = machine_defaults(TARGET, DRAFT, "cpu")
    if variant is None:
        return build(TARGET, None, drafter="none", dtype=picked.dtype, max_batch=1, max_len=4096)
    pipe = build(TARGET, DRAFT, dtype=picked.dtype, draft_dtype=picked.draft_dtype, draft_head=variant[0],
                 max_batch=1, max_len=4096)  # fmt: skip
    pipe.engine.drafter.context_ids = variant[1]  # type: ignore[attr-defined]
    return pipe


def outside_share(prompt: list[int], output: list[int], size: int, keep: set[int], context: bool) -> float:
    """Share of ``output``'s tokens the draft could not have proposed when the target emitted them."""
    seen = set(prompt)
    out = 0
    for t in output:
        out += t >= size and t not in keep and not (context and t in seen)
        seen.add(t)
    return out / max(1, len(output))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="32768,32768+context,16384+context,plain")
    p.add_argument("--set", default="humaneval")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    names = [v for v in args.variants.split(",") if v]
    variants = {name: parse_variant(name) for name in names}
    if "plain" not in variants:
        names.append("plain")
        variants["plain"] = None
    engines = {name: engine_for(v) for name, v in variants.items()}
    keep = set(engines["plain"].target.tokenizer.eos_token_ids)
    warm = engines["plain"].target.tokenizer.encode("print('hello')\n")
    for pipe in engines.values():  # (a first generation pays for the process's cold start: not measured)
        pipe.engine.generate([warm], [SamplingParams(temperature=0, max_tokens=16)])
    tok_s: dict[str, list[float]] = {name: [] for name in names}
    counts: dict[str, dict[str, int]] = {name: {"drafted": 0, "accepted": 0, "steps": 0, "tokens": 0} for name in names}
    outside: dict[str, list[float]] = {name: [] for name in names if variants[name] is not None}
    for pi, text in enumerate(list(prompt_set(args.set))[: args.prompts]):
        ids = engines["plain"].target.tokenizer.encode(text)
        first: list[int] | None = None
        row = []
        for name in names if pi % 2 == 0 else names[::-1]:
            params = SamplingParams(temperature=0, max_tokens=args.tokens)
            start = time.perf_counter()
            out = engines[name].engine.generate([ids], [params])[0]
            tok_s[name].append(len(out.token_ids) / (time.perf_counter() - start))
            st = out.stats
            c = counts[name]
            c["drafted"] += st.num_draft_tokens
            c["accepted"] += st.num_accepted_tokens
            c["steps"] += len(out.token_ids) - 1 - st.num_accepted_tokens  # (each step commits accepted + 1)
            c["tokens"] += len(out.token_ids) - 1
            variant = variants[name]
            if variant is not None:
                outside[name].append(outside_share(ids, list(out.token_ids), variant[0], keep, variant[1]))
            first = first if first is not None else list(out.token_ids)
            assert list(out.token_ids) == first, (pi, name)
            row.append(f"{name}={tok_s[name][-1]:.1f}")
        print(pi, " ".join(row), flush=True)
    machine = machine_line()
    print(f"# {machine}")
    summary: dict[str, Any] = {}
    for name in names:
        c = counts[name]
        s = {"median_tok_s": statistics.median(tok_s[name])} | per_unit_ratios(tok_s[name], tok_s["plain"])
        if variants[name] is not None:
            s |= {"acceptance_rate": c["accepted"] / max(1, c["drafted"]),
                  "acceptance_length": c["tokens"] / max(1, c["steps"]),
                  "outside_share": statistics.fmean(outside[name])}  # fmt: skip
        summary[name] = s
        extra = (f", acceptance {s['acceptance_rate']:.3f}, {s['acceptance_length']:.2f} tokens per step, "
                 f"{100 * s['outside_share']:.1f}% of the output outside the draft's ids" if "acceptance_rate" in s
                 else "")  # fmt: skip
        print(f"{name}: median {s['median_tok_s']:.2f} tok/s; per prompt / plain: median {s['median_ratio']:.3f}, "
              f"geometric mean {s['geomean_ratio']:.3f}{extra}")  # fmt: skip
    if args.json is not None:
        payload = {"machine": machine, "args": vars(args) | {"json": str(args.json)}, "tok_s": tok_s,
                   "counts": counts, "summary": summary}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
