"""``verispec loadgen``: streamed load against any OpenAI-compatible endpoint, closed or open loop."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from verispec.cli.options import add_prompt_options, float_list, int_list, load_prompts

EPILOG = """\
examples:
  verispec loadgen --endpoint http://127.0.0.1:8000/v1 --concurrency 1,2,4 --num-requests 16
  verispec loadgen --endpoint http://127.0.0.1:8000 --qps 0.5,1 --duration 60 --prompts prompts.jsonl
  verispec loadgen --endpoint http://gpu-box:8000/v1 --model meta-llama/Llama-3.1-8B-Instruct \\
                   --api-key "$KEY" --max-tokens 256 --json load.json

Prompt files are JSONL: {"prompt": "..."} (sent to /v1/completions) or {"messages": [...]}
(sent to /v1/chat/completions), one per line. Acceptance is read from the endpoint's /metrics
(verispec:, vllm: or sglang: names) before and after each level."""


UNBOUNDED = 10**9  # requests per level when only a duration bounds it


def register(sub: Any) -> None:
    p = sub.add_parser(
        "loadgen",
        help="offer streamed load to an OpenAI-compatible endpoint and report latency, throughput, acceptance",
        description="Streamed load against any OpenAI-compatible endpoint (verispec, vLLM, SGLang): a closed-loop "
        "concurrency sweep or open-loop Poisson arrivals; per level TTFT, inter-token latency, time per "
        "output token and end-to-end latency (p50/p95/p99), output tokens/s, requests/s, errors by kind, "
        "and the acceptance rate and length read from the endpoint's /metrics.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--endpoint", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    add_prompt_options(p, "mixed", None)
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=None,
        metavar="C,C,...",
        help="closed-loop levels: clients in flight (default 1 when no --qps is given)",
    )
    p.add_argument(
        "--qps",
        type=float_list,
        default=None,
        metavar="R,R,...",
        help="open-loop levels: Poisson arrivals per second (seeded by --seed)",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests per level (default: the number of prompts; with --duration alone, as many as fit)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="stop sending new requests after S seconds per level (requests in flight finish)",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="temperature of every request (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="top_p of every request (default: the server's)")
    p.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests sent first (default 1)")
    p.add_argument(
        "--no-usage",
        action="store_true",
        help="do not ask for stream_options.include_usage (servers that refuse it); tokens = chunks",
    )
    p.add_argument("--no-metrics", action="store_true", help="do not scrape the endpoint's /metrics")
    p.add_argument("--metrics-url", default=None, metavar="URL", help="Prometheus URL (default ENDPOINT/metrics)")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write every figure and every request's record to FILE (atomically)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from verispec.bench.loadgen import Load, RequestOptions, check_endpoint, parse_endpoint, record_dict, sweep
    from verispec.errors import ConfigError
    from verispec.formats.files import write_json

    parse_endpoint(args.endpoint)
    for name in ("max_tokens", "timeout"):
        if not getattr(args, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
    prompts = load_prompts(args)
    # With only --duration, the duration bounds the level (requests cycle through the prompts).
    num = args.num_requests or (UNBOUNDED if args.duration else len(prompts))
    concurrency = args.concurrency or ([] if args.qps else [1])
    loads = [Load(concurrency=c, num_requests=num, duration=args.duration) for c in concurrency]
    loads += [Load(qps=q, num_requests=num, duration=args.duration, seed=args.seed) for q in args.qps or []]
    model = asyncio.run(check_endpoint(args.endpoint, args.api_key, args.model))  # fail fast, before any display
    options = RequestOptions(
        model=model, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        stop=tuple(args.stop), include_usage=not args.no_usage, timeout=args.timeout,
    )  # fmt: skip
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err) as progress:  # fmt: skip

        def on_level(load: Load) -> Any:
            task = progress.add_task(load.label, total=None if load.num_requests == UNBOUNDED else load.num_requests)
            return lambda record: progress.advance(task)

        results = asyncio.run(
            sweep(
                args.endpoint,
                prompts,
                loads,
                options,
                api_key=args.api_key,
                metrics_url=args.metrics_url,
                scrape=not args.no_metrics,
                warmup=args.warmup,
                on_level=on_level,
            )
        )
    summaries = [r.summary() for r in results]
    print_table(summaries, Console())
    if args.json:
        write_json(args.json, {
            "endpoint": args.endpoint,
            "model": results[0].model if results else None,
            "prompts": str(args.prompts) if args.prompts else args.prompt_set,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "levels": [s | {"records": [record_dict(x) for x in r.records]} for s, r in zip(summaries, results,
                                                                                          strict=True)],
        })  # fmt: skip
        err.print(f"wrote {args.json}")
    return 0


def print_table(summaries: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    def ms(d: dict[str, Any], key: str) -> str:
        v = d.get(key)
        return "-" if v is None else f"{1e3 * v:.0f}"

    def f(v: float | None, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(title="verispec loadgen (latencies in ms)")
    for col in ("level", "ok/sent", "errors", "req/s", "tok/s", "TTFT p50/p95/p99", "ITL p50/p95/p99",
                "TPOT p50/p95", "e2e p50/p95", "AR", "AL", "spec from"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("level", "errors", "spec from") else "right")
    for s in summaries:
        spec = s["spec_metrics"]
        source = spec["source"] if spec else None
        ar = spec.get("acceptance_rate") if spec else None
        al = (spec.get("mean_acceptance_length") or spec.get("accept_length_gauge")) if spec else None
        if ar is None and s["spec_responses"]:
            source = "responses"
            ar = s["spec_responses"]["token_weighted"]["acceptance_rate"]
            al = s["spec_responses"]["token_weighted"]["mean_acceptance_length"]
        t, i, p, e = s["ttft_s"], s["itl_s"], s["tpot_s"], s["e2e_s"]
        table.add_row(
            s["label"], f"{s['completed']}/{s['requests']}", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()),
            f(s["requests_per_s"]), f(s["output_tokens_per_s"], ".1f"),
            f"{ms(t, 'p50')}/{ms(t, 'p95')}/{ms(t, 'p99')}", f"{ms(i, 'p50')}/{ms(i, 'p95')}/{ms(i, 'p99')}",
            f"{ms(p, 'p50')}/{ms(p, 'p95')}", f"{ms(e, 'p50')}/{ms(e, 'p95')}", f(ar, ".3f"), f(al), source or "-",
        )  # fmt: skip
    console.print(table)
