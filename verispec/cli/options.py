"""Option groups and argument types shared by several ``verispec`` commands, written once.

- :func:`add_model_options`: the model pair, drafter, draft length, precisions, device, draft head
  (generate, bench, serve, gate);
- :func:`add_sampling_options` and :func:`sampling_params`: the sampling parameters (generate, bench);
- :func:`add_prompt_options` and :func:`load_prompts`: prompt files and built-in sets, the API key
  (loadgen, gate);
- argument types: :func:`draft_length` (``auto`` or N), :func:`int_list` / :func:`float_list`
  (comma-separated levels), :func:`port`, :func:`host`.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from verispec.config import DRAFT_CONTEXT_WINDOW
from verispec.errors import ConfigError
from verispec.names import DEFAULT_DRAFTER, DRAFTERS, LOSSLESS_RULES, PRECISIONS, TREE_CHILDREN

_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def draft_length(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k must be 'auto' or an integer >= 0, got {text!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"--k must be 'auto' or an integer >= 0, got {k}")
    return k


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by the commands that load a model pair."""
    from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET

    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"target model: a registry name, a .gguf file or a Hugging Face folder (default {DEFAULT_TARGET})",
    )
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model, same forms (default {DEFAULT_DRAFT})")
    p.add_argument(
        "--drafter", default=DEFAULT_DRAFTER, choices=DRAFTERS,
        help="where draft tokens come from: model (the draft model), ngram (prompt lookup, no draft model), "
        "composite (the continuation earlier occurrences of the current suffix agree on, in this and earlier "
        "requests, else the model), tree (token trees from the draft model, see --tree), "
        "suffix (trees of what followed the current suffix earlier in this and earlier requests; no draft "
        "model), retrieval (trees of what followed it in --datastore; no draft model), medusa (heads on "
        f"the target's hidden state, see --heads; no draft model), none (plain decoding). Default: {DEFAULT_DRAFTER}",
    )  # fmt: skip
    p.add_argument(
        "--heads", default=None, metavar="PATH",
        help="with --drafter medusa: the Medusa heads file `verispec train medusa` wrote for this target (a chain "
        "of the heads' top tokens, or with --tree rank paths a static tree of their candidates)",
    )  # fmt: skip
    p.add_argument(
        "--datastore", default=None, metavar="PATH",
        help="with --drafter retrieval: a folder of text or code (e.g. your repository) or one text file, "
        "tokenised once and cached; hidden names, links, binary files and files over 4 MiB are skipped, "
        "256 MiB of text at most",
    )  # fmt: skip
    p.add_argument(
        "--rule", default="rejection", choices=(*LOSSLESS_RULES, "typical"),
        help="acceptance rule: rejection (token-wise speculative sampling; a tree goes to the rule made for its "
        "children), block (block verification of chains: never fewer accepted tokens in expectation), or a tree "
        "rule by name (specinfer, sequoia, point-mass), all lossless; or typical (Medusa's typical acceptance of "
        "chains: LOSSY, needs --allow-lossy, and every output says so). Default: rejection",
    )  # fmt: skip
    p.add_argument(
        "--allow-lossy", action="store_true",
        help="allow --rule typical, which does not keep the target's output distribution (outputs are labelled "
        "lossy: the CLI's figures, the server's spec.lossless, the gate's report)",
    )  # fmt: skip
    p.add_argument(
        "--tree", default=None, metavar="D,E,B[,N]|PATHS|auto",
        help="with --drafter tree: grow D levels at most, the E likeliest nodes of each level getting B "
        "children each, N nodes at most (default 4,2,2,12; --k caps the depth per step); or a static tree "
        "as JSON rank paths, inline or a file (e.g. [[0],[1],[0,0]]; verispec analyze --tree-out writes "
        "the best one for a measured acceptance); or auto: each step's tree chosen from the acceptance by "
        "child rank measured so far and the measured pass costs (Sequoia's dynamic programme, at most 16 "
        "nodes, depth 8)",
    )  # fmt: skip
    p.add_argument(
        "--tree-children", default="fixed", choices=TREE_CHILDREN,
        help="with --drafter tree: each grown node's children are its B likeliest draft tokens (fixed; "
        "verified by recursive point-mass acceptance), B i.i.d. draws (sampled; SpecInfer's rule) or B draws "
        "without replacement (distinct; Sequoia's rule). Default: fixed",
    )  # fmt: skip
    p.add_argument(
        "--k",
        type=draft_length,
        default=None,
        metavar="auto|N",
        help="draft length: auto (chosen per step from measured acceptance and costs; default) "
        "or a fixed N (0 = no speculation)",
    )
    p.add_argument(
        "--no-confidence-stop", dest="confidence_stop", action="store_false",
        help="with --k auto: draft exactly the chosen K. By default a draft model's chain may run to 8 "
        "tokens and ends after the first token whose confidence says the next one does not pay for its pass "
        "(learnt from this run's accepted tokens; the output's law is unchanged either way)",
    )  # fmt: skip
    p.add_argument(
        "--dtype",
        default=None,
        choices=PRECISIONS,
        help="precision of the target (default: picked for this machine and printed: int4 on a CPU where "
        "verispec's vector kernels run and the target has Q4_K weights, else bf16). fp32 is the exact "
        "reference; int8 / int4: quantised projection weights (per-channel int8; int4 = a GGUF's Q4_K blocks "
        "exactly) times activations quantised to int8 per block of 64 inputs, exact integer sums, on verispec's "
        "CPU kernels (compiled on first use for this CPU's instruction set)",
    )
    p.add_argument(
        "--draft-dtype",
        default=None,
        choices=PRECISIONS,
        help="precision of the draft model (default: picked with --dtype when that is not given: int4-all for "
        "a draft with Q4_K weights, else int8, on a CPU where the kernels run; with --dtype given, int8 there "
        "unless --dtype is fp32, else --dtype). int4-all: every decoder projection 4-bit (Q4_K blocks as "
        "stored, the others requantised once): a cheaper draft; a draft's precision never changes the output's law",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument(
        "--draft-vocab", type=int, default=None, metavar="N",
        help="score only token ids below N (plus the stop tokens, and the ids of the request's own prompt and "
        "output) with the draft model: a cheaper draft head, still exact (default: 32768 for a large vocabulary "
        "when --dtype is not given and the kernels run, else the full vocabulary)",
    )  # fmt: skip
    p.add_argument(
        "--draft-window", type=int, default=DRAFT_CONTEXT_WINDOW, metavar="N",
        help=f"the most prompt tokens the draft model reads: a longer prompt is drafted from its last N tokens "
        f"(default {DRAFT_CONTEXT_WINDOW}; 0: the whole prompt). Feeding the draft a long prompt costs more than "
        "its drafts save; drafts are only proposals, so the output's law is unchanged",
    )  # fmt: skip


def draft_window(args: argparse.Namespace) -> int | None:
    """``--draft-window`` as the pipeline takes it (None: the whole prompt); raises
    :class:`~verispec.errors.ConfigError` for a negative value."""
    if args.draft_window < 0:
        raise ConfigError(f"--draft-window must be 0 (the whole prompt) or a number of tokens, got {args.draft_window}")
    return args.draft_window or None


def resolve_precisions(args: argparse.Namespace) -> str | None:
    """Fill in ``--dtype`` (and, unless given, ``--draft-dtype`` and ``--draft-vocab``) with the
    machine's defaults (:func:`verispec.pipeline.machine_defaults`) when ``--dtype`` was not given;
    returns the one line that says what was picked and why, or None when the user chose."""
    if args.dtype is not None:
        return None
    from verispec.names import MODEL_DRAFTERS
    from verispec.pipeline import machine_defaults

    uses_draft = args.drafter in MODEL_DRAFTERS
    picked = machine_defaults(args.target, args.draft if uses_draft else None, args.device, args.draft_dtype)
    args.dtype = picked.dtype
    args.draft_dtype = picked.draft_dtype  # (the given one, when given: machine_defaults keeps it)
    if args.draft_vocab is None and uses_draft:
        args.draft_vocab = picked.draft_head
    return f"picked {picked.flags()} for this machine: {picked.why}"


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off, default)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="repetition penalty (1 = off, default)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty (default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of this request's random numbers (default: fresh)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop when this text appears (repeatable)"
    )


def sampling_params(args: argparse.Namespace) -> Any:
    from verispec.config import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )  # fmt: skip


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers > 0, got {text!r}")
    return values


def add_prompt_options(p: argparse.ArgumentParser, default_set: str, default_num: int | None) -> None:
    from verispec.bench.prompts import SET_NAMES  # light: the CLI must start without the bench extras

    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSONL prompt file: {"prompt": ...} or {"messages": [...]} per line (default: --prompt-set)',
    )
    p.add_argument(
        "--prompt-set",
        default=default_set,
        choices=("mixed", *SET_NAMES),
        help=f"built-in prompts when no --prompts file is given (default {default_set}; mixed = "
        "HumanEval, chat and summarisation interleaved)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=default_num,
        metavar="N",
        help="use the first N prompts" + (f" (default {default_num})" if default_num else " (default all)"),
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("VERISPEC_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="send 'Authorization: Bearer KEY' (default $VERISPEC_API_KEY, else $OPENAI_API_KEY)",
    )


def load_prompts(args: argparse.Namespace) -> list[Any]:
    from verispec.bench.loadgen import builtin_prompts, load_prompt_file
    from verispec.errors import ConfigError

    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    items = load_prompt_file(args.prompts) if args.prompts else builtin_prompts(args.prompt_set)
    return items[: args.num_prompts] if args.num_prompts else items


def port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer in [1, 65535], got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in [1, 65535], got {port}")
    return port


def host(text: str) -> str:
    """An IP address or a host name (RFC 1123 labels), as uvicorn can bind it."""
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if not text or len(text) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise argparse.ArgumentTypeError(f"--host must be an IP address or a host name, got {text!r}")
    return text
