"""``verispec train``: train drafters on this machine (see DESCRIPTION below).

``train data`` makes self-distillation data (:mod:`verispec.train.data`); ``train medusa`` trains
Medusa heads on it (:mod:`verispec.train.medusa`), ``train eagle`` an EAGLE head
(:mod:`verispec.train.eagle`), ``train distill`` fine-tunes the draft model
(:mod:`verispec.train.distill`). They show progress; data, Medusa and EAGLE resume an interrupted run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verispec.cli.options import draft_length
from verispec.errors import ConfigError
from verispec.names import PRECISIONS

DESCRIPTION = """\
Train a drafter for a target model on this machine, from the target's own generations
(self-distillation: Medusa-2, EAGLE, DistillSpec). Data first, then any of three drafters:

  verispec train data    --prompts humaneval,chat --num-prompts 200 --out data/   (generate, record hidden states)
  verispec train medusa  --data data/ --out heads.safetensors                    (Medusa heads)
  verispec train eagle   --data data/ --out eagle.safetensors                    (an EAGLE head)
  verispec train distill --data data/ --out distilled/                           (the draft model, fine-tuned)
  verispec generate "def f(x):" --drafter eagle --heads eagle.safetensors         (draft with one)
  verispec generate "def f(x):" --draft distilled/                                (or with the distilled draft)

Measured on a 2-core AMD EPYC (Zen 5) for the default 1.5B target in int4: data 24 min for 212
prompts of up to 192 answer tokens (6.8 s a prompt: generation with speculation, then one
teacher-forced pass; 3.4 GB peak memory); Medusa training 11.6 min for 3 epochs of 125 steps of
256 positions with 4 heads scoring 32768 ids (1.8 s a step; 3.6 GB peak); EAGLE training 26.6 min
for 3 epochs of 64 steps of ~1024 token pairs unrolled 3 deep (5.9 s a step; 4.3 GB peak);
distillation 15 min for one epoch of 80 steps (LoRA rank 16 on the 0.5B draft; 13.2 GB peak).
About one prompt in ten (by a hash of its text) is held out: the figures printed after each
epoch are measured on prompts the drafter never saw."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train drafters on this machine: self-distillation data, Medusa heads, an EAGLE head, a distilled draft",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(title="steps", metavar="STEP", parser_class=type(p))
    data = sub.add_parser(
        "data",
        help="generate the target's answers to prompts and record its hidden states (resumable)",
        description="Generate the target's answers to the prompts (speculative decoding, the target's law either "
        "way) and record its last hidden state at every position, in shards (resumable).",
    )
    from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET

    data.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    data.add_argument(
        "--draft", default=DEFAULT_DRAFT, help=f"draft model that speeds generation (default {DEFAULT_DRAFT})"
    )
    data.add_argument(
        "--drafter", default="model", choices=["model", "ngram", "none"], help="drafter for generation (default model)"
    )
    data.add_argument("--k", type=draft_length, default=None, metavar="auto|N", help="draft length (default auto)")
    data.add_argument("--dtype", default=None, choices=PRECISIONS, help="target precision (default: this machine's)")
    data.add_argument("--prompts", default="humaneval,chat", help="prompt sets and/or files of one prompt per line")
    data.add_argument(
        "--num-prompts", type=int, default=200, help="prompts per set or file, from the start (default 200)"
    )
    data.add_argument("--max-tokens", type=int, default=256, help="answer tokens at most (default 256)")
    data.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    data.add_argument("--seed", type=int, default=0, help="seed of the first prompt (prompt i: seed + i; default 0)")
    data.add_argument("--no-chat-template", action="store_true", help="send instruction sets without the chat template")
    data.add_argument("--out", required=True, help="folder of the data (resumed when it holds part of this run)")
    data.set_defaults(run=run_data)

    medusa = sub.add_parser(
        "medusa",
        help="train Medusa heads on self-distillation data (resumable)",
        description="Train K Medusa heads (residual blocks over the target's hidden state, its LM head frozen) "
        "on a data folder; report held-out accuracy after each epoch; save atomically (resumable).",
    )
    _trainer_options(medusa)
    medusa.add_argument("--heads", type=int, default=4, help="number of heads, 1..16 (default 4)")
    medusa.add_argument(
        "--head-size", type=int, default=32768, help="vocabulary ids the heads score, the first N (default 32768)"
    )
    medusa.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    medusa.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, cosine decay (default 0.001)")
    medusa.add_argument("--batch", type=int, default=256, help="answer positions per step (default 256)")
    medusa.add_argument(
        "--out", required=True, help="heads file to write (resumed when it and its optimiser state exist)"
    )
    medusa.set_defaults(run=run_medusa)

    eagle = sub.add_parser(
        "eagle",
        help="train an EAGLE head on self-distillation data (resumable)",
        description="Train an EAGLE head (one decoder layer over the target's features and token embeddings, "
        "unrolled as it drafts) on a data folder; report held-out agreement per depth and a greedy chain's "
        "accepted length after each epoch; save atomically (resumable).",
    )
    _trainer_options(eagle)
    eagle.add_argument(
        "--head-size", type=int, default=32768, help="vocabulary ids the head scores, the first N (default 32768)"
    )
    eagle.add_argument(
        "--intermediate", type=int, default=None, help="the head's MLP width (default 2 x the target's hidden size)"
    )
    eagle.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    eagle.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, cosine decay (default 0.001)")
    eagle.add_argument("--batch", type=int, default=1024, help="token pairs per step, whole sequences (default 1024)")
    eagle.add_argument("--unroll", type=int, default=3, help="drafting depths unrolled in training, 1..8 (default 3)")
    eagle.add_argument(
        "--out", required=True, help="head file to write (resumed when it and its optimiser state exist)"
    )
    eagle.set_defaults(run=run_eagle)

    dist = sub.add_parser(
        "distill",
        help="fine-tune the draft model toward the target (DistillSpec; LoRA adapters, merged)",
        description="Fine-tune the draft toward the target's laws on a data folder (forward KL or total variation, "
        "at a sampling temperature) through LoRA adapters merged into the weights; report held-out acceptance "
        "before and after; write a model folder that --draft takes.",
    )
    _trainer_options(dist)
    dist.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model to fine-tune (default {DEFAULT_DRAFT})")
    dist.add_argument(
        "--objective", default="fkl", choices=["fkl", "tv"],
        help="forward KL (fkl) or total variation (tv, whose complement is the acceptance rate); default fkl",
    )  # fmt: skip
    dist.add_argument("--temperature", type=float, default=1.0, help="temperature of the laws matched (default 1)")
    dist.add_argument(
        "--head-size", type=int, default=32768, help="vocabulary ids the draft scores, the first N (default 32768)"
    )
    dist.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    dist.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    dist.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate, cosine decay (default 0.0002)")
    dist.add_argument("--batch", type=int, default=512, help="answer positions per step, whole sequences (default 512)")
    dist.add_argument("--out", required=True, help="folder of the distilled draft (a new folder)")
    dist.set_defaults(run=run_distill)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1])


def _trainer_options(parser: Any) -> None:
    """The options every trainer takes: the target, its precision, the data folder, the device."""
    from verispec.formats.loader import DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default {DEFAULT_TARGET})")
    parser.add_argument("--dtype", default=None, choices=PRECISIONS, help="target precision (default: this machine's)")
    parser.add_argument("--data", required=True, help="folder written by verispec train data (for this target)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")


def _prompts(spec: str, limit: int) -> list[tuple[str, bool]]:
    """``(text, instruction)`` per prompt: the built-in sets (HumanEval is code to complete; the
    others are instructions), or files of one instruction per line."""
    from verispec.bench.prompts import SET_NAMES, prompt_set

    out: list[tuple[str, bool]] = []
    for part in [s for s in spec.split(",") if s]:
        if part in SET_NAMES:
            out += [(text, part != "humaneval") for text in prompt_set(part)[:limit]]
            continue
        path = Path(part)
        if not path.is_file():
            raise ConfigError(f"--prompts {part!r} is neither a prompt set ({', '.join(SET_NAMES)}) nor a file")
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        out += [(line, True) for line in lines[:limit]]
    if not out:
        raise ConfigError("--prompts gave no prompt")
    return out


def run_data(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from verispec.config import SamplingParams
    from verispec.pipeline import build, chat_prompt, machine_defaults
    from verispec.train.data import describe, make_data

    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ConfigError("--num-prompts and --max-tokens must be >= 1")
    prompts = _prompts(args.prompts, args.num_prompts)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    err = Console(stderr=True)
    draft = args.draft if args.drafter == "model" else None
    picked = machine_defaults(args.target, draft, "cpu")  # (what generate picks when --dtype is not given)
    chosen = (picked.dtype, picked.draft_dtype, picked.draft_head) if args.dtype is None else (args.dtype, None, None)
    with err.status("loading models", spinner="dots"):
        pipe = build(
            args.target, draft, drafter=args.drafter, k=args.k, dtype=chosen[0], draft_dtype=chosen[1],
            draft_head=chosen[2], max_batch=1, max_len=4096,
        )  # fmt: skip
    tok = pipe.target.tokenizer
    chat = not args.no_chat_template and tok.chat_template is not None
    ids = [tok.encode(chat_prompt(pipe.target, t) if chat and instruction else t) for t, instruction in prompts]
    texts = [t for t, _ in prompts]
    with Progress(
        TextColumn("generating and recording"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
        TimeRemainingColumn(), console=err,
    ) as bar:  # fmt: skip
        task = bar.add_task("data", total=len(ids))
        make_data(
            pipe.engine, pipe.target.model, pipe.target.name, ids, texts, Path(args.out), params,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )  # fmt: skip
    print(f"{args.out}: {describe(Path(args.out))}")
    return 0


def run_medusa(args: argparse.Namespace) -> int:
    from verispec.train.medusa import MedusaConfig, train_medusa

    config = MedusaConfig(args.heads, args.head_size, args.epochs, args.lr, args.batch)
    manifest = _train(args, "Medusa heads", lambda data, target, out, device, progress: train_medusa(
        data, target, out, config, device=device, progress=progress
    ))  # fmt: skip
    _summary(args.out, f"{manifest.num_heads} heads", "top-1 accuracy per head", manifest)
    return 0


def run_eagle(args: argparse.Namespace) -> int:
    from verispec.train.eagle import EagleConfig, train_eagle

    config = EagleConfig(args.head_size, args.intermediate, args.epochs, args.lr, args.batch, args.unroll)
    manifest = _train(args, "an EAGLE head", lambda data, target, out, device, progress: train_eagle(
        data, target, out, config, device=device, progress=progress
    ))  # fmt: skip
    _summary(args.out, "EAGLE head", "agreement per depth", manifest)
    return 0


def _summary(out: str, what: str, accuracy_name: str, manifest: Any) -> None:
    """One line on stdout: what was trained, in how long, and its held-out figures."""
    held = manifest.info.get("heldout", {})
    accuracy = ", ".join(f"{a:.3f}" for a in held.get("accuracy", []))
    print(
        f"{out}: {what} for {manifest.target}, {manifest.info['steps']} steps in "
        f"{manifest.info['seconds']:.0f} s; held-out {accuracy_name} {accuracy or '-'}, "
        f"greedy chain AL {held.get('chain_al', float('nan')):.2f} over {held.get('positions', 0)} positions",
        file=sys.stdout,
    )


def run_distill(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from verispec.formats.loader import load_model
    from verispec.pipeline import check_device
    from verispec.train.distill import DistillConfig, distill, read_manifest, save_folder
    from verispec.train.index import record

    config = DistillConfig(
        args.objective, args.temperature, args.head_size, args.epochs, args.lr, args.rank, args.batch
    )  # fmt: skip
    device = check_device(args.device)
    out = Path(args.out)
    if not Path(args.data).is_dir():
        raise ConfigError(f"--data {args.data!r} is not a folder; make it with verispec train data")
    if out.exists() and read_manifest(out) is None:
        raise ConfigError(f"--out {args.out!r} exists and is not a distilled draft; choose a new folder")
    err = Console(stderr=True)
    with err.status("loading the target and the draft (fp32)", spinner="dots"):
        target = load_model(args.target, dtype=args.dtype or _machine_dtype(args.target), device="cpu")
        draft = load_model(args.draft, dtype="fp32", device="cpu")
    with Progress(
        TextColumn("distilling the draft"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("{task.fields[note]}"), TimeRemainingColumn(), console=err,
    ) as bar:  # fmt: skip
        task = bar.add_task("train", total=1, note="")

        def progress(stage: str, done: int, total: int, figures: dict[str, float]) -> None:
            if stage == "train":
                bar.update(task, completed=done, total=total, note=f"{args.objective} {figures['loss']:.4f}")

        decoder, info = distill(Path(args.data), target.model, draft.model, config, device=device, progress=progress)
    manifest = {"base": draft.name, "target": target.name, **info}
    save_folder(decoder, draft.tokenizer, draft.vocab_size, out, manifest)
    record(out)
    before, after = info.get("heldout_before", {}), info.get("heldout", {})

    def change(key: str) -> str:
        return f"{before.get(key, float('nan')):.3f} -> {after.get(key, float('nan')):.3f}"

    print(
        f"{args.out}: {draft.name} distilled toward {target.name} ({args.objective}, T={args.temperature}), "
        f"{info['steps']} steps in {info['seconds']:.0f} s; held-out acceptance {change('acceptance')}, "
        f"greedy agreement {change('greedy_agreement')}",
        file=sys.stdout,
    )
    return 0


def _train(args: argparse.Namespace, what: str, train: Callable[..., Any]) -> Any:
    """Load the target, then ``train(data, target, out, device, progress)`` under a progress bar
    that prints each epoch's held-out chain AL."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from verispec.formats.loader import load_model
    from verispec.pipeline import check_device

    device = check_device(args.device)
    if not Path(args.data).is_dir():
        raise ConfigError(f"--data {args.data!r} is not a folder; make it with verispec train data")
    err = Console(stderr=True)
    with err.status("loading the target", spinner="dots"):
        target = load_model(args.target, dtype=args.dtype or _machine_dtype(args.target), device="cpu")
    with Progress(
        TextColumn(f"training {what}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("{task.fields[note]}"), TimeRemainingColumn(), console=err,
    ) as bar:  # fmt: skip
        task = bar.add_task("train", total=1, note="")

        def progress(stage: str, done: int, total: int, figures: dict[str, float]) -> None:
            if stage == "train":
                bar.update(task, completed=done, total=total, note=f"loss {figures['loss']:.3f}")
            else:
                bar.console.print(f"epoch {done}/{total}: held-out chain AL {figures['chain_al']:.2f}")

        result = train(Path(args.data), target.model, Path(args.out), device, progress)
    from verispec.train.index import record

    record(args.out)  # (for verispec models list)
    return result


def _machine_dtype(target: str) -> Any:
    from verispec.pipeline import machine_defaults

    return machine_defaults(target, None, "cpu").dtype
