"""``verispec certify``: statistical certification that speculative sampling keeps the target's law."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from verispec.config import SamplingParams
from verispec.errors import ConfigError

T = TypeVar("T")

DESCRIPTION = """\
Certify losslessness statistically. For every configuration of the grid (draft length K x
temperature x top-k x top-p x min-p), generate N sequences with speculative decoding on a toy
target/draft pair of Markov chains, and compare the joint law of the first n = K + 1 tokens
(so that bonus tokens are tested too) with the target's EXACT law by a chi-square test.
A configuration passes when p >= alpha. With --negative-controls, deliberately broken rules
are run through the same test and must fail: proof that the test can see the bugs that matter.
Exit status: 0 when every verdict is as expected, 1 otherwise, 2 on bad input."""

EPILOG = """\
examples:
  verispec certify
  verispec certify --k 1,2,4,6 --temperature 1,0.5 --top-k 0,3 --negative-controls
  verispec certify --rule typical --allow-lossy --temperature 0,1   # lossy: fails at T > 0
  verispec certify --drafter point-mass --json > certificate.json"""


def _list(kind: Callable[[str], T], what: str) -> Callable[[str], list[T]]:
    def parse(text: str) -> list[T]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{what} needs at least one value")
        return values

    return parse


def register(sub: Any) -> None:
    p = sub.add_parser(
        "certify",
        help="certify statistically that speculative sampling keeps the target's distribution",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rule",
        default="rejection",
        choices=["rejection", "greedy", "typical"],
        help="acceptance rule to certify: rejection (lossless speculative sampling), greedy (argmax "
        "matching, exact only at temperature 0), typical (Medusa typical acceptance, lossy; needs "
        "--allow-lossy). Default: rejection",
    )
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="permit --rule typical, which does not preserve the target law",
    )
    p.add_argument(
        "--drafter",
        default="model",
        choices=["model", "point-mass"],
        help="model: draft tokens sampled from a draft model, with their laws reported; point-mass: "
        "the draft model's mode proposed with no law (like n-gram lookup). Default: model",
    )
    p.add_argument(
        "--k",
        type=_list(int, "--k"),
        default=[1, 2, 4],
        help="draft lengths K, comma-separated (default 1,2,4)",
    )
    p.add_argument(
        "--temperature", type=_list(float, "--temperature"), default=[1.0, 0.7],
        help="temperatures, comma-separated; 0 = greedy (default 1,0.7)",
    )  # fmt: skip
    p.add_argument("--top-k", type=_list(int, "--top-k"), default=[0], help="top-k values, 0 = off (default 0)")
    p.add_argument(
        "--top-p",
        type=_list(float, "--top-p"),
        default=[1.0, 0.9],
        help="top-p values, 1 = off (default 1,0.9)",
    )
    p.add_argument("--min-p", type=_list(float, "--min-p"), default=[0.0], help="min-p values, 0 = off (default 0)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="repetition penalty for every case (default 1 = off)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty for every case (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty for every case (default 0)")
    p.add_argument(
        "--prefix-extra", type=int, default=1,
        help="test the first K + this many tokens (>= 1 so that bonus tokens are observed; default 1)",
    )  # fmt: skip
    p.add_argument("--samples", type=int, default=40_000, help="sequences generated per case (default 40000)")
    p.add_argument("--alpha", type=float, default=1e-6, help="significance level of each test (default 1e-6)")
    p.add_argument("--vocab-size", type=int, default=4, help="vocabulary of the toy models (default 4)")
    p.add_argument("--order", type=int, default=1, help="Markov order of the toy models (default 1)")
    p.add_argument(
        "--distance", type=float, default=1.0,
        help="std of the noise added to the target's logits to make the draft; "
        "larger = lower acceptance (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="seed of the sampling (default 1234); --model-seed for the models",
    )
    p.add_argument("--model-seed", type=int, default=0, help="seed that draws the toy models (default 0)")
    p.add_argument(
        "--negative-controls", action="store_true",
        help="also run the deliberately broken rules (always accept, residual = target, bonus from "
        "the draft, off-by-one) and a drafter that misreports its law; each must FAIL",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.certify import CertificationResult, ToySetup, grid, negative_controls, run_cases

    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    if args.vocab_size < 2:
        raise ConfigError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if args.rule == "typical" and not args.allow_lossy:
        raise ConfigError(
            "rule 'typical' does not preserve the target distribution; add --allow-lossy to certify it anyway"
        )
    base = SamplingParams(
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    cases = grid(
        ks=args.k, temperatures=args.temperature, top_ks=args.top_k, top_ps=args.top_p, min_ps=args.min_p,
        rule=args.rule, drafter=args.drafter, prefix_extra=args.prefix_extra, base=base,
    )  # fmt: skip
    if args.negative_controls:
        cases += negative_controls(args.k[0])
    for case in cases:
        if args.vocab_size**case.prefix_len > 2_000_000:
            raise ConfigError(
                f"{args.vocab_size}^{case.prefix_len} outcomes are too many to test; lower --k or --vocab-size"
            )
    setup = ToySetup(args.vocab_size, args.order, args.distance, args.model_seed)

    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=args.json) as progress:
        task = progress.add_task("certifying", total=len(cases))
        results = run_cases(
            cases, setup, num_sequences=args.samples, seed=args.seed, alpha=args.alpha,
            on_result=lambda _: progress.advance(task),
        )  # fmt: skip
    ok = all(r.as_expected for r in results)
    if args.json:
        print(json.dumps({"all_as_expected": ok, "setup": vars(setup) | {"prompt": list(setup.prompt)},
                          "results": [r.as_dict() for r in results]}, indent=2))  # fmt: skip
        return 0 if ok else 1

    out = Console(width=max(Console().width, 132))
    table = Table(title=f"verispec certify: {args.samples} sequences per case, alpha = {args.alpha:g}")
    for col in ("rule / drafter", "K", "n", "sampling", "claim", "p-value", "TV", "AR", "AL", "verdict"):
        table.add_column(col, justify="left" if col in ("rule / drafter", "sampling", "claim", "verdict") else "right")

    def verdict(r: CertificationResult) -> str:
        if r.as_expected:
            return "[green]pass[/]" if r.passed else "[green]FAIL (caught)[/]"
        return "[bold red]FAIL[/]" if not r.passed else "[bold red]pass (NOT caught)[/]"

    for r in results:
        c = r.case
        claim = "lossless" if c.claims_lossless else "[yellow]lossy/broken[/]"
        table.add_row(
            f"{c.rule} / {c.drafter}", str(c.k), str(c.prefix_len), c.sampling_label(), claim,
            f"{r.gof.p_value:.3g}", f"{r.gof.tv_distance:.4f}", f"{r.acceptance_rate:.3f}",
            f"{r.mean_acceptance_length:.2f}", verdict(r),
        )  # fmt: skip
    out.print(table)
    n_lossless = sum(r.case.claims_lossless for r in results)
    passed = sum(r.passed and r.case.claims_lossless for r in results)
    caught = sum((not r.passed) and not r.case.claims_lossless for r in results)
    summary = f"{passed}/{n_lossless} lossless configurations passed"
    if len(results) > n_lossless:
        summary += f"; {caught}/{len(results) - n_lossless} lossy or broken configurations were caught"
    out.print(("[green]CERTIFIED[/]: " if ok else "[bold red]NOT CERTIFIED[/]: ") + summary)
    if not ok:
        print("verispec: some verdicts were not as expected (see the table above)", file=sys.stderr)
    return 0 if ok else 1
