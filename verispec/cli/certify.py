"""``verispec certify``: statistical certification that speculative sampling keeps the target's law."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from verispec.config import SamplingParams
from verispec.errors import ConfigError
from verispec.names import DRAFTERS, RULES, TREE_CHILDREN

T = TypeVar("T")

DESCRIPTION = """\
Certify losslessness statistically. For every configuration of the grid (draft length K x
temperature x top-k x top-p x min-p), generate N sequences with speculative decoding on a toy
target/draft pair of Markov chains, and compare the joint law of the first n = K + 1 tokens
(so that bonus tokens are tested too) with the target's EXACT law by a chi-square test.
A configuration passes when p >= alpha. With --negative-controls, deliberately broken rules
are run through the same test and must fail: proof that the test can see the bugs that matter.

With --engine, the whole engine is certified instead (drafter model, ngram or composite, K a
number or auto, the sampling grid, --draft-vocab, --device): requests go through the same
Engine that `verispec generate` and `verispec serve` use, on a tiny target/draft transformer pair
built in code whose exact law is computable (real vocabularies have too many outcomes).
With --target, a real deployment is certified by two samples: for each prompt, N continuations
from plain decoding and N from speculative decoding of the real models, a two-sample test of
the first --tokens tokens, one decision over the prompts (Holm), the TV between the arms with a
bootstrap interval, and the smallest TV the run could detect (power 0.8): a pass bounds the
difference at that level and no lower.
Exit status: 0 when every verdict is as expected, 1 otherwise, 2 on bad input."""

EPILOG = """\
examples:
  verispec certify
  verispec certify --k 1,2,4,6 --temperature 1,0.5 --top-k 0,3 --negative-controls
  verispec certify --rule typical --allow-lossy --temperature 0,1   # lossy: fails at T > 0
  verispec certify --drafter point-mass --json > certificate.json
  verispec certify --engine --drafter composite --k 2,auto --temperature 0.8 --top-p 0.9 --samples 8000
  verispec certify --engine --device cuda --negative-controls
  verispec certify --target qwen2.5-coder-1.5b-instruct --samples 1000 --tokens 3   (this machine's deployment)"""


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


def _k_value(text: str) -> int | None:
    """A draft length: an integer, or "auto" (None: the measured policy, --engine only)."""
    return None if text.strip().lower() == "auto" else int(text)


def _verdict_cell(passed: bool, as_expected: bool) -> str:
    """The verdict column: green when the test saw what it should (a pass, or a broken rule caught)."""
    if as_expected:
        return "[green]pass[/]" if passed else "[green]FAIL (caught)[/]"
    return "[bold red]FAIL[/]" if not passed else "[bold red]pass (NOT caught)[/]"


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
        choices=RULES,
        help="acceptance rule to certify: rejection (lossless speculative sampling; trees go to the rule made "
        "for their children), block (block verification of chains), specinfer / sequoia / point-mass (the "
        "tree rules, with --tree), greedy (argmax matching, exact only at temperature 0), typical (Medusa "
        "typical acceptance, lossy; needs --allow-lossy). Default: rejection",
    )
    p.add_argument(
        "--allow-lossy",
        action="store_true",
        help="permit --rule typical, which does not preserve the target law",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="certify the engine (drafters, batching, policy) on tiny transformers instead of a rule on Markov chains",
    )
    p.add_argument(
        "--drafter",
        default="model",
        choices=["model", "point-mass", "ngram", "composite", "tree", "suffix", "retrieval", "medusa", "eagle"],
        help="model: draft tokens sampled from a draft model, with their laws reported; point-mass: "
        "the draft model's mode proposed with no law (like n-gram lookup); with --engine: model, "
        "ngram (prompt lookup), composite, tree, suffix, retrieval (over a fixed toy datastore), medusa (fixed "
        "random heads on the target's hidden state) or eagle (a fixed random EAGLE head). "
        "Default: model",
    )
    p.add_argument(
        "--tree", default=None, metavar="D,E,B[,N]",
        help="certify token trees of this shape (D levels, the first E nodes of each level growing B "
        "children, N nodes at most) instead of chains; with --engine, the tree drafter's shape (needs "
        "--drafter tree). K is then the number of nodes (rules) or the depth cap (engine)",
    )  # fmt: skip
    p.add_argument(
        "--tree-children", default="fixed", choices=TREE_CHILDREN,
        help="how the tree's children are drawn: fixed (top-k), sampled (i.i.d.), distinct (without "
        "replacement); each goes to the rule made for it (default fixed)",
    )  # fmt: skip
    p.add_argument(
        "--k",
        type=_list(_k_value, "--k"),
        default=[1, 2, 4],
        help="draft lengths K, comma-separated (default 1,2,4); with --engine, 'auto' = the measured policy",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="with --engine and --drafter model/composite: restrict the draft head to the first N ids",
    )
    p.add_argument("--device", default="cpu", help="with --engine: cpu (default) or cuda")
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
        "--prefix-extra", type=int, default=2,
        help="test the first K + this many tokens (>= 1 so that bonus tokens are observed; the engine "
        "needs >= 2: the prefill's token, a full draft and its bonus; default 2)",
    )  # fmt: skip
    p.add_argument(
        "--samples", type=int, default=None,
        help="sequences generated per case (default 40000); with --target, per arm and prompt (default 1000)",
    )  # fmt: skip
    p.add_argument(
        "--alpha", type=float, default=None,
        help="significance level of each test (default 1e-6); with --target, of the whole run (default 0.01)",
    )  # fmt: skip
    real = p.add_argument_group(
        "a real deployment (--target): plain against speculative decoding of real models, by two samples"
    )
    from verispec.formats.loader import DEFAULT_DRAFT

    real.add_argument("--target", default=None, help="target model: certify this deployment instead of toy models")
    real.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model (default {DEFAULT_DRAFT})")
    real.add_argument("--dtype", default=None, help="target precision (default: this machine's)")
    real.add_argument(
        "--prompts", default="certify",
        help="prompt set, or a file of one prompt per line (default certify: prompts whose first tokens are "
        "nearly determined, which gives the test its power)",
    )  # fmt: skip
    real.add_argument("--tokens", type=int, default=3, help="tokens of each continuation tested (default 3)")
    real.add_argument("--batch", type=int, default=16, help="requests sampled together (default 16)")
    real.add_argument(
        "--combine", default="holm", choices=["holm", "fisher"], help="how prompts combine (default holm)"
    )
    real.add_argument(
        "--fit", action="store_true",
        help="goodness of fit: the baseline scores the speculative samples instead of drawing its own (locally "
        "the target, teacher forced; an endpoint by prompt logprobs with echo, as vLLM answers): more power per "
        "sample. Endpoints: temperature 1, no truncation or penalties",
    )  # fmt: skip
    real.add_argument("--html", type=Path, default=None, help="also write the result as an HTML page here")
    ends = p.add_argument_group(
        "two deployments behind OpenAI-compatible APIs (vLLM, SGLang, llama-server, verispec serve)"
    )
    ends.add_argument("--endpoint-baseline", default=None, metavar="URL", help="the plain deployment")
    ends.add_argument("--endpoint-spec", default=None, metavar="URL", help="the speculative deployment")
    ends.add_argument("--model", default=None, help="the model name the endpoints serve (their /v1/models id)")
    ends.add_argument(
        "--tokenizer", default=None,
        help="whose tokenizer turns the returned text into tokens (a model name, .gguf or folder; required "
        "except with --fit, which asks the endpoints for token ids)",
    )  # fmt: skip
    ends.add_argument("--api-key", default=None, help="bearer token for both endpoints")
    ends.add_argument(
        "--concurrency", type=int, default=1,
        help="requests in flight at once per endpoint (default 1; each request its own seed either way)",
    )  # fmt: skip
    ends.add_argument(
        "--max-requests", type=int, default=10_000, help="requests to each endpoint at most (default 10000)"
    )
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
    from verispec.certify.core import grid, negative_controls

    if args.endpoint_baseline is not None or args.endpoint_spec is not None:
        return run_deployment(args, endpoints=True)
    if args.target is not None:
        return run_deployment(args)
    args.samples = 40_000 if args.samples is None else args.samples
    args.alpha = 1e-6 if args.alpha is None else args.alpha
    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    if args.vocab_size < 2:
        raise ConfigError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if args.rule == "typical" and not args.allow_lossy:
        raise ConfigError(
            "rule 'typical' does not preserve the target distribution; add --allow-lossy to certify it anyway"
        )
    if args.engine:
        return run_engine(args)
    if args.tree is not None:
        return run_trees(args)
    if args.drafter not in ("model", "point-mass"):
        raise ConfigError(f"--drafter {args.drafter} needs --engine; without it use model or point-mass")
    if None in args.k:
        raise ConfigError("--k auto needs --engine (the measured policy lives in the engine); give numbers")
    if args.draft_vocab is not None or args.device != "cpu":
        raise ConfigError("--draft-vocab and --device apply to --engine only")
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
    return report(args, cases)


def run_deployment(args: argparse.Namespace, endpoints: bool = False) -> int:
    """``verispec certify --target X``: two-sample certification of plain against speculative
    decoding of real models (:mod:`verispec.certify.deployment`); with ``endpoints``, of two
    OpenAI-compatible deployments (:mod:`verispec.certify.endpoint`)."""
    from rich.console import Console
    from rich.table import Table

    from verispec.certify.deployment import CERTIFY_PROMPTS, certify_arms, certify_fit

    samples = 1000 if args.samples is None else args.samples
    alpha = 0.01 if args.alpha is None else args.alpha
    # the toy grid's defaults become one deployment's: K from the measured policy, T = 1, no top-p
    args.k = [None] if args.k == [1, 2, 4] else args.k
    args.temperature = args.temperature[:1] if args.temperature == [1.0, 0.7] else args.temperature
    args.top_p = args.top_p[:1] if args.top_p == [1.0, 0.9] else args.top_p
    grid_values = (args.k, args.temperature, args.top_k, args.top_p, args.min_p)
    if any(len(v) > 1 for v in grid_values):
        raise ConfigError("with --target, give one value each of --k, --temperature, --top-k, --top-p and --min-p")
    if args.drafter not in ("model", "ngram", "composite", "suffix"):
        raise ConfigError("with --target, --drafter is model, ngram, composite or suffix")
    if args.batch < 1 or not 0.0 < alpha < 1.0:
        raise ConfigError("--batch must be >= 1 and --alpha in (0, 1)")
    params = SamplingParams(
        temperature=args.temperature[0], top_k=args.top_k[0], top_p=args.top_p[0], min_p=args.min_p[0],
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )  # fmt: skip
    if args.html is not None and not args.html.parent.is_dir():
        raise ConfigError(f"--html {str(args.html)!r}: the folder {str(args.html.parent)!r} does not exist")
    err = Console(stderr=True)
    if endpoints:
        arms, tokenizer, name = _endpoint_arms(args, err)
    else:
        arms, tokenizer, name = _local_arms(args, err)
    texts = list(CERTIFY_PROMPTS) if args.prompts == "certify" else _prompt_texts(args.prompts)
    prompts = [(t, tokenizer.encode(t) if tokenizer is not None else []) for t in texts]
    from rich.progress import Progress

    with Progress(console=err, transient=True) as bar:
        what = f"sampling {samples} speculative continuations per prompt, scored by the baseline" if args.fit else (
            f"sampling {samples} + {samples} continuations per prompt")  # fmt: skip
        task = bar.add_task(what, total=len(prompts))
        common = {"samples": samples, "tokens": args.tokens, "alpha": alpha, "method": args.combine,
                  "seed": args.seed, "progress": lambda done, total: bar.update(task, completed=done)}  # fmt: skip
        report = (
            certify_fit(*arms, prompts, params, **common)
            if args.fit
            else certify_arms(*arms, prompts, params, **common)
        )
    drafter = "endpoints" if endpoints else args.drafter
    out = report.to_dict() | {"target": name, "drafter": drafter}
    if endpoints:
        out |= {"baseline": args.endpoint_baseline, "speculative": args.endpoint_spec, "tokenizer": args.tokenizer}
    if args.html is not None:
        from verispec.certify.html import deployment_page
        from verispec.formats.files import atomic_path

        with atomic_path(args.html) as tmp:
            tmp.write_text(deployment_page(out), encoding="utf-8")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if report.passed and report.valid else 1
    how = "scored by the baseline" if args.fit else "per arm"
    table = Table(title=f"{name}: plain vs speculative ({drafter}), {samples} {how}, first {args.tokens} tokens")
    for col in ("prompt", "outcomes", "p", "TV [95% CI]", "detectable TV", "s"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for p in report.prompts:
        r = p.result
        table.add_row(
            repr(p.prompt[:40]), str(p.distinct), f"{r.p_value:.3g}",
            f"{r.tv:.3f} [{r.tv_interval[0]:.3f}, {r.tv_interval[1]:.3f}]", f"{r.detectable_tv:.3f}",
            f"{p.seconds:.0f}",
        )  # fmt: skip
    Console().print(table)
    verdict = "[green]pass[/]" if report.passed else "[bold red]FAIL[/]"
    Console().print(
        f"{verdict}: combined p = {report.p_value:.3g} ({args.combine}) at alpha {alpha:g}. A pass bounds the "
        f"difference only at the detectable TV (best prompt {report.detectable_tv:.3f}); smaller differences "
        "are not excluded."
    )
    if not report.valid:
        Console().print(
            "[bold red]NOT VALID[/]: identical continuations came in runs (samples not independent) from "
            f"{', '.join(report.correlated)}; does the server draw several continuations from one seed?"
        )
    return 0 if report.passed and report.valid else 1


def _endpoint_arms(args: argparse.Namespace, err: Any) -> tuple[tuple[Any, Any], Any, str]:
    from verispec.certify.endpoint import endpoint_arm
    from verispec.formats.loader import load_tokenizer

    if not (args.endpoint_baseline and args.endpoint_spec and args.model and (args.tokenizer or args.fit)):
        raise ConfigError("certify endpoints with --endpoint-baseline URL --endpoint-spec URL --model NAME "
                          "--tokenizer MODEL together (the tokenizer turns the returned text into tokens)")  # fmt: skip
    if args.max_requests < 1 or args.batch < 1 or args.concurrency < 1:
        raise ConfigError("--max-requests, --batch and --concurrency must be >= 1")
    if args.fit:
        from verispec.certify.endpoint import endpoint_scorer

        options = {"api_key": args.api_key, "max_requests": args.max_requests}
        scorer = endpoint_scorer(args.endpoint_baseline, args.model, **options)
        sampler = endpoint_arm(args.endpoint_spec, args.model, None, per_request=1, token_ids=True,
                               concurrency=args.concurrency, **options)  # fmt: skip
        return (scorer, sampler), None, args.model
    tokenizer = load_tokenizer(args.tokenizer)

    def decode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    # One continuation per request, each with its own seed: llama-server draws the n samples of one
    # request from one seed (whole runs of identical continuations), which breaks independence.
    options = {"per_request": 1, "api_key": args.api_key, "max_requests": args.max_requests,
               "concurrency": args.concurrency}  # fmt: skip
    baseline = endpoint_arm(args.endpoint_baseline, args.model, decode, **options)
    speculative = endpoint_arm(args.endpoint_spec, args.model, decode, **options)
    return (baseline, speculative), tokenizer, args.model


def _local_arms(args: argparse.Namespace, err: Any) -> tuple[tuple[Any, Any], Any, str]:
    from verispec.certify.deployment import engine_arm, engine_scorer
    from verispec.config import EngineConfig
    from verispec.engine import Engine
    from verispec.pipeline import build, check_device, machine_defaults

    device = check_device(args.device)
    draft = args.draft if args.drafter in ("model", "composite") else None
    picked = machine_defaults(args.target, draft, device)
    dtype = args.dtype or picked.dtype
    with err.status("loading models", spinner="dots"):
        pipe = build(
            args.target, draft, drafter=args.drafter, k=args.k[0], dtype=dtype,
            draft_dtype=picked.draft_dtype if args.dtype is None else None,
            draft_head=picked.draft_head if args.dtype is None else args.draft_vocab,
            device=device, max_batch=args.batch, max_len=1024,
        )  # fmt: skip
    plain = Engine(
        pipe.target.model, pipe.target.tokenizer, None, EngineConfig(max_batch=args.batch, max_len=1024),
        vocab_limit=pipe.target.vocab_size,
    )  # fmt: skip
    baseline = engine_scorer(plain) if args.fit else engine_arm(plain, args.batch)
    return (baseline, engine_arm(pipe.engine, args.batch)), pipe.target.tokenizer, pipe.target.name


def _prompt_texts(spec: str) -> list[str]:
    from verispec.bench.prompts import SET_NAMES, prompt_set

    if spec in SET_NAMES:
        return list(prompt_set(spec))[:8]
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"--prompts {spec!r} is neither certify, a prompt set ({', '.join(SET_NAMES)}) nor a file")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if path.suffix == ".jsonl":  # one JSON string (or {"prompt": ...}) per line: prompts with newlines
        lines = [_jsonl_prompt(line, spec, i + 1) for i, line in enumerate(lines)]
    if not lines:
        raise ConfigError(f"--prompts {spec!r} holds no prompt")
    return lines


def _jsonl_prompt(line: str, spec: str, number: int) -> str:
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"--prompts {spec!r} line {number} is not JSON ({exc})") from exc
    if isinstance(value, dict):
        value = value.get("prompt")
    if not isinstance(value, str) or not value:
        raise ConfigError(f'--prompts {spec!r} line {number}: give a JSON string or an object with a "prompt" string')
    return value


def run_trees(args: argparse.Namespace) -> int:
    """``verispec certify --tree D,E,B``: the tree rules on a static tree of that shape."""
    from verispec.certify.core import CertificationCase, tree_negative_controls
    from verispec.drafters.tree import TreeShape

    tree = TreeShape.parse(args.tree).static_parents()
    drafter = {"fixed": "point-mass", "sampled": "model", "distinct": "model-distinct"}[args.tree_children]
    if args.rule in ("block", "typical"):
        raise ConfigError(f"--rule {args.rule} verifies chains; certify trees with rejection, a tree rule or greedy")
    base = SamplingParams(
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    depth = CertificationCase("rejection", drafter, len(tree), base, 1, tree).depth
    cases = []
    for t, tk, tp, mp in itertools.product(args.temperature, args.top_k, args.top_p, args.min_p):
        params = replace(base, temperature=t, top_k=tk, top_p=tp, min_p=mp)
        cases.append(CertificationCase(args.rule, drafter, len(tree), params, depth + args.prefix_extra, tree))
    if args.negative_controls:
        cases += tree_negative_controls(tree)
    return report(args, cases)


def report(args: argparse.Namespace, cases: list[Any]) -> int:
    """Run the rule cases on the toy pair and print the verdicts (table or JSON)."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.certify.core import ToySetup, run_cases

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

    for r in results:
        c = r.case
        claim = "lossless" if c.claims_lossless else "[yellow]lossy/broken[/]"
        table.add_row(
            f"{c.rule} / {c.drafter}", str(c.k), str(c.prefix_len), c.sampling_label(), claim,
            f"{r.gof.p_value:.3g}", f"{r.gof.tv_distance:.4f}", f"{r.acceptance_rate:.3f}",
            f"{r.mean_acceptance_length:.2f}", _verdict_cell(r.passed, r.as_expected),
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


def run_engine(args: argparse.Namespace) -> int:
    """``verispec certify --engine``: the grid through the Engine on tiny transformers."""
    import itertools
    from dataclasses import replace

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from verispec.certify.core import EngineCase, certify_engine_case
    from verispec.pipeline import check_device
    from verispec.verify.broken import AlwaysAcceptRule, ResidualIsTargetRule

    if args.drafter not in DRAFTERS or args.drafter == "none":
        raise ConfigError(f"--engine certifies a drafter (model, ngram, composite, tree, ...), not {args.drafter!r}")
    if (args.tree is not None and args.drafter not in ("tree", "medusa", "eagle")) or (
        args.drafter == "tree" and not args.tree
    ):
        raise ConfigError(
            "--engine certifies trees with --drafter tree and --tree D,E,B[,N] together (or --drafter medusa and "
            "--tree rank paths, or --drafter eagle and --tree D,E,B[,N])"
        )
    if args.rule == "greedy":
        raise ConfigError("--engine certifies the rejection rule (or typical with --allow-lossy); greedy is exact "
                          "only at temperature 0, where `verispec generate` equals plain decoding by test")  # fmt: skip
    if args.draft_vocab is not None and (args.draft_vocab < 1 or args.draft_vocab > args.vocab_size):
        raise ConfigError(f"--draft-vocab must be in 1..{args.vocab_size} (the toy vocabulary), got {args.draft_vocab}")
    if args.draft_vocab is not None and args.drafter in ("ngram", "suffix", "retrieval", "medusa", "eagle"):
        raise ConfigError(f"--draft-vocab restricts a draft model's head; the {args.drafter} drafter has none")
    if any(k is not None and k < 1 for k in args.k):
        raise ConfigError(f"--k values must be >= 1 or auto, got {args.k}")
    device = check_device(args.device)
    base = SamplingParams(
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )
    cases: list[tuple[EngineCase, Any]] = []
    for k, t, tk, tp, mp in itertools.product(args.k, args.temperature, args.top_k, args.top_p, args.min_p):
        params = replace(base, temperature=t, top_k=tk, top_p=tp, min_p=mp)
        prefix = (k if k is not None else 4) + args.prefix_extra
        case = EngineCase(
            args.drafter, k, params, prefix, rule=args.rule, draft_head=args.draft_vocab, tree=args.tree,
            tree_children=args.tree_children,
        )  # fmt: skip
        cases.append((case, None))
    if args.negative_controls:
        first = args.k[0] if args.k[0] is not None else 2
        control = EngineCase("model", first, SamplingParams(temperature=1.0), first + args.prefix_extra)
        cases += [(control, AlwaysAcceptRule()), (control, ResidualIsTargetRule())]
    for case, _ in cases:
        if args.vocab_size**case.prefix_len > 2_000_000:
            raise ConfigError(
                f"{args.vocab_size}^{case.prefix_len} outcomes are too many to test; lower --k or --vocab-size"
            )
    # A repetitive prompt, so that prompt lookup finds matches on the toy vocabulary.
    prompt = tuple([args.vocab_size - 1, 0, 0] * 3)
    rows = []
    with Progress(console=Console(stderr=True), transient=True, disable=args.json) as progress:
        task = progress.add_task("certifying the engine", total=len(cases))
        for case, broken in cases:
            gof, acceptance = certify_engine_case(
                case, vocab_size=args.vocab_size, num_sequences=args.samples, seed=args.seed, alpha=args.alpha,
                prompt=prompt, model_seed=args.model_seed, broken_rule=broken, device=device,
            )  # fmt: skip
            claims = broken is None and case.rule == "rejection"
            passed = gof.p_value >= args.alpha
            rows.append({
                "case": case.label() + (f" (broken: {broken.name})" if broken is not None else ""),
                "drafter": case.drafter, "k": case.k, "prefix_len": case.prefix_len, "claims_lossless": claims,
                "p_value": gof.p_value, "tv_distance": gof.tv_distance, "acceptance_rate": acceptance,
                "passed": passed, "as_expected": passed == claims,
            })  # fmt: skip
            progress.advance(task)
    ok = all(r["as_expected"] for r in rows)
    if args.json:
        print(json.dumps({"all_as_expected": ok, "engine": True, "device": device, "vocab_size": args.vocab_size,
                          "samples": args.samples, "alpha": args.alpha, "results": rows}, indent=2))  # fmt: skip
        return 0 if ok else 1
    out = Console(width=max(Console().width, 132))
    title = f"verispec certify --engine ({device}): {args.samples} requests per case, alpha = {args.alpha:g}"
    table = Table(title=title)
    for col in ("case", "claim", "p-value", "TV", "AR", "verdict"):
        table.add_column(col, justify="left" if col in ("case", "claim", "verdict") else "right")
    for r in rows:
        verdict = _verdict_cell(r["passed"], r["as_expected"])
        claim = "lossless" if r["claims_lossless"] else "[yellow]lossy/broken[/]"
        table.add_row(r["case"], claim, f"{r['p_value']:.3g}", f"{r['tv_distance']:.4f}",
                      f"{r['acceptance_rate']:.3f}", verdict)  # fmt: skip
    out.print(table)
    out.print(("[green]CERTIFIED[/]: " if ok else "[bold red]NOT CERTIFIED[/]: ")
              + f"{sum(r['as_expected'] for r in rows)}/{len(rows)} verdicts as expected")  # fmt: skip
    if not ok:
        print("verispec: some verdicts were not as expected (see the table above)", file=sys.stderr)
    return 0 if ok else 1
