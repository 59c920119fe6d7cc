"""Chains, block verification and token trees side by side on the default pair, in one run.

One loaded target and draft (the machine's default precisions, or ``--dtype`` / ``--draft-dtype``);
for every prompt, in rotating order: plain decoding, then each ``--configs`` entry, each with its
own engine and caches:

    chain:K          the draft model's chain of K tokens, token-wise rejection rule (chain:auto: K
                     per step from measured costs, verispec generate's default)
    block:K          the same chain, block verification (Sun et al. 2025)
    tree:D,E,B,N     the tree drafter (top-k children, point-mass rule) of that shape; a static
                     shape as JSON rank paths (tree:[[0],[1],[0,0]]) or a file of them
    tree-sampled:... / tree-distinct:...   i.i.d. / without-replacement children (sampled requests)
    tree-auto:C      the tree planned per step (--tree auto), children C (fixed, sampled, distinct)
    ngram:K          prompt lookup (no model), chains of K
    suffix:K         the suffix drafter (no model), K a chain length for the policy
    retrieval:PATH   the retrieval drafter over a datastore of the files at PATH (no model)
    medusa:HEADS     Medusa heads (verispec train medusa): a chain of every head's top token
    medusa-tree:HEADS  the same heads, a static tree of their candidates (MEDUSA_TREE)
    medusa-auto:HEADS  the same heads, a tree planned per step (--tree auto)
    draft:PATH[@DTYPE]  another draft model (e.g. a verispec train distill folder, or the default
                     draft's name to compare in the same precision; default int8), K per step;
                     draft-K:PATH[@DTYPE] the same with chains of K
    eagle:HEAD       an EAGLE head (verispec train eagle): chains, K per step from measured costs
    eagle-K:HEAD     the same head, chains of K (e.g. eagle-4:eagle.safetensors)
    eagle-tree:HEAD:D,E,B,N  the same head, EAGLE-2 dynamic trees of that shape

Reported per configuration: median tokens/s end to end, the mean accepted length per step
(accepted draft tokens + 1), nodes verified per step, the speedup over plain decoding of the same
prompt, for greedy runs whether the output equals plain decoding token for token, and for trees
the acceptance by child rank over all prompts (Sequoia's positional acceptance: what
``verispec analyze --tree-acceptance`` takes to find the best static tree).

    python benchmarks/trees.py [--sets humaneval,chat] [--prompts 5] [--tokens 128] [--threads 2]
        [--temperature 0] [--configs chain:4,block:4,tree:4,2,2,12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from verispec.bench.prompts import prompt_set
from verispec.cli.doctor import cpu_model
from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.drafters.eagle import load_eagle
from verispec.drafters.heads import load_heads
from verispec.drafters.registry import make_drafter
from verispec.drafters.retrieval import text_files
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.engine.calibrate import CostTable, load_or_calibrate
from verispec.engine.policy import TreePolicy, make_policy
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.formats.registry import verispec_home
from verispec.metrics import SpecStats
from verispec.pipeline import AUTO_TREE_DEPTH, AUTO_TREE_NODES, build, chat_prompt, load_datastore, machine_defaults
from verispec.train.data import held_out


def parse_configs(text: str) -> list[tuple[str, str]]:
    """``chain:4,block:4,tree:4,2,2,12`` -> [(kind, arg), ...] (a tree's shape keeps its commas)."""
    out: list[tuple[str, str]] = []
    for part in text.split(","):
        if ":" in part:
            kind, arg = part.split(":", 1)
            out.append((kind, arg))
        elif out and out[-1][0].startswith(("tree", "eagle-tree")):
            out[-1] = (out[-1][0], out[-1][1] + "," + part)
        else:
            raise SystemExit(f"bad --configs entry {part!r}")
    return out


#: The static tree of ``medusa-tree``: ranks of heads 1..4's candidates (14 nodes).
MEDUSA_TREE = "[[0],[1],[2],[0,0],[0,1],[1,0],[2,0],[0,0,0],[0,0,1],[0,1,0],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,1,0]]"


def make_engine(pipe: Any, kind: str, arg: str, draft_head: int | None) -> Engine:
    target, draft = pipe.target, pipe.draft
    common = dict(
        draft_model=draft.model,
        vocab_size=target.logits_width,
        vocab_limit=target.vocab_size,
        max_batch=1,
        max_len=4096,
        draft_head=draft_head,
        keep_ids=tuple(target.tokenizer.eos_token_ids),
    )
    if kind == "draft" or kind.startswith("draft-"):
        from verispec.formats.loader import load_model

        path, _, precision = arg.partition("@")
        other = load_model(path, dtype=precision or "int8")  # type: ignore[arg-type]
        drafter = make_drafter("model", **(common | {"draft_model": other.model}))  # type: ignore[arg-type]
        fixed_k = int(kind[6:]) if kind.startswith("draft-") else None
        config = EngineConfig(max_batch=1, max_len=4000, num_draft_tokens=fixed_k)
        if fixed_k is not None:  # a fixed K: acceptance rates of different drafts compare at one K
            return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size)
        policy = make_policy(config, speculative=True, costs=measured_costs(target))
        return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size, policy=policy)
    if kind.startswith("eagle"):
        path, _, tree_arg = arg.partition(":")
        head, _ = load_eagle(path, target.model)
        tree = TreeShape.parse(tree_arg) if kind == "eagle-tree" else None
        drafter = make_drafter("eagle", vocab_size=target.logits_width, target_model=target.model, heads=head,
                               draft_head=draft_head, tree=tree)  # fmt: skip
        fixed = tree.depth if tree is not None else (int(kind[6:]) if kind[6:] else None)
        config = EngineConfig(
            max_batch=1, max_len=4000, num_draft_tokens=fixed, max_draft_tokens=max(16, tree.max_nodes if tree else 0)
        )
        if fixed is None:  # K per step from measured costs, as verispec generate's default
            policy = make_policy(config, speculative=True, costs=measured_costs(target))
            return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size, policy=policy)
    elif kind in ("medusa", "medusa-tree", "medusa-auto"):
        heads, _ = load_heads(arg, target.model)
        tree = TreeShape.parse(MEDUSA_TREE) if kind == "medusa-tree" else None
        drafter = make_drafter("medusa", vocab_size=target.logits_width, target_model=target.model, heads=heads,
                               draft_head=draft_head, tree=tree)  # fmt: skip
        k = tree.depth if tree is not None else heads.num_heads
        if kind == "medusa-auto":  # trees planned per step (--tree auto)
            config = EngineConfig(max_batch=1, max_len=4000, max_draft_tokens=AUTO_TREE_NODES)
            policy = TreePolicy(AUTO_TREE_NODES, heads.num_heads, costs=measured_costs(target))
            return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size, policy=policy)
        config = EngineConfig(max_batch=1, max_len=4000, num_draft_tokens=k, max_draft_tokens=16)
    elif kind in ("ngram", "suffix", "retrieval"):
        datastore = load_datastore(text_files(arg), target.tokenizer) if kind == "retrieval" else None
        drafter = make_drafter(kind, vocab_size=target.logits_width, datastore=datastore)
        config = EngineConfig(
            max_batch=1, max_len=4000, num_draft_tokens=8 if kind == "retrieval" else int(arg), max_draft_tokens=16
        )
    elif kind in ("chain", "block"):
        drafter = make_drafter("model", **common)  # type: ignore[arg-type]
        config = EngineConfig(
            max_batch=1,
            max_len=4000,
            num_draft_tokens=None if arg == "auto" else int(arg),
            spec=SpecConfig(rule="block" if kind == "block" else "rejection"),
        )
        if arg == "auto":  # K per step from measured costs, as verispec generate's default
            policy = make_policy(config, speculative=True, costs=measured_costs(target))
            return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size, policy=policy)
    elif kind == "tree-auto":  # the tree planned per step (verispec generate --drafter tree --tree auto)
        shape = TreeShape(AUTO_TREE_DEPTH, 2, 2, AUTO_TREE_NODES)
        drafter = make_drafter("tree", tree=shape, tree_children=arg, **common)  # type: ignore[arg-type]
        config = EngineConfig(max_batch=1, max_len=4000, max_draft_tokens=shape.max_nodes)
        policy = TreePolicy(shape.max_nodes, shape.depth, costs=measured_costs(target))
        return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size, policy=policy)
    else:
        shape = TreeShape.parse(arg)
        children = {"tree": "fixed", "tree-sampled": "sampled", "tree-distinct": "distinct"}[kind]
        drafter = make_drafter("tree", tree=shape, tree_children=children, **common)  # type: ignore[arg-type]
        config = EngineConfig(
            max_batch=1, max_len=4000, num_draft_tokens=shape.depth, max_draft_tokens=max(8, shape.max_nodes)
        )
    return Engine(target.model, target.tokenizer, drafter, config, vocab_limit=target.vocab_size)


def measured_costs(target: Any) -> CostTable:
    """The target's pass costs as verispec measures them on this machine (once, cached)."""
    return load_or_calibrate(target.model, target.name, verispec_home(), batch_sizes=[1])


def run(engine: Engine, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    start = time.perf_counter()
    out = engine.generate([ids], params)[0]
    seconds = time.perf_counter() - start
    stats = out.stats
    steps = max(stats.num_drafts, 1)
    return {
        "tokens": out.token_ids,
        "tok_s": len(out.token_ids) / seconds,
        "al": (stats.num_accepted_tokens + stats.num_drafts) / steps if stats.num_drafts else 1.0,
        "nodes": stats.num_draft_tokens / steps if stats.num_drafts else 0.0,
        "stats": stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="humaneval")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="chain:4,block:4,tree:4,2,2,12")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--draft-dtype", default=None)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--heldout", action="store_true", help="only the prompts verispec train data holds out (for trained drafters)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    picked = machine_defaults(DEFAULT_TARGET, DEFAULT_DRAFT, "cpu")
    dtype = args.dtype or picked.dtype
    draft_dtype = args.draft_dtype or picked.draft_dtype
    draft_head = args.draft_vocab if args.draft_vocab is not None else picked.draft_head
    pipe = build(DEFAULT_TARGET, DEFAULT_DRAFT, drafter="model", k=4, dtype=dtype, draft_dtype=draft_dtype,
                 max_batch=1, max_len=4000, draft_head=draft_head)  # fmt: skip
    plain = Engine(pipe.target.model, pipe.target.tokenizer, None, EngineConfig(max_batch=1, max_len=4000),
                   vocab_limit=pipe.target.vocab_size)  # fmt: skip
    configs = parse_configs(args.configs)
    engines = {"plain": plain} | {f"{k}:{a}": make_engine(pipe, k, a, draft_head) for k, a in configs}
    print(f"# {cpu_model()}, {args.threads} threads, target {dtype}, draft {draft_dtype} (head {draft_head}), "
          f"T={args.temperature:g}, {args.tokens} tokens")  # fmt: skip
    results: dict[str, dict[str, list[Any]]] = {}
    for set_name in args.sets.split(","):
        texts = [t for t in prompt_set(set_name) if held_out(t) or not args.heldout][: args.prompts]
        per: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for i, text in enumerate(texts):
            instruction = set_name in ("chat", "summarize", "edit") and pipe.target.tokenizer.chat_template
            # (instructions go through the chat template, as verispec bench sends them)
            ids = pipe.target.tokenizer.encode(chat_prompt(pipe.target, text) if instruction else text)
            names = list(engines)
            names = names[i % len(names) :] + names[: i % len(names)]  # rotate
            for name in names:
                params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, seed=args.seed + i)
                per[name].append(run(engines[name], ids, params))
                r = per[name][-1]
                print(f"{set_name} {i + 1}/{len(texts)} {name}: {r['tok_s']:.2f} tok/s AL {r['al']:.2f}", flush=True)
        results[set_name] = {}
        print(f"\n### {set_name}\n\n| configuration | median tok/s | speedup vs plain | AL | accepted/drafted "
              "| nodes/step | == plain | acceptance by child rank |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for name, rows in per.items():
            speedups = [r["tok_s"] / p["tok_s"] for r, p in zip(rows, per["plain"], strict=True)]
            same = sum(r["tokens"] == p["tokens"] for r, p in zip(rows, per["plain"], strict=True))
            equal = f"{same}/{len(rows)}" if args.temperature == 0 and name != "plain" else "-"
            merged = SpecStats()
            for r in rows:
                merged = merged.merge(r["stats"])
            row = {
                "tok_s": statistics.median(r["tok_s"] for r in rows),
                "speedup": statistics.median(speedups),
                "al": statistics.mean(r["al"] for r in rows),
                "nodes": statistics.mean(r["nodes"] for r in rows),
                "acceptance_rate": merged.num_accepted_tokens / max(1, merged.num_draft_tokens),
                "equal": equal,
                "positional_acceptance": merged.positional_acceptance,
                "rank_reached": merged.rank_reached,
            }
            results[set_name][name] = [row]
            ranks = ",".join(f"{p:.3f}" for p in merged.positional_acceptance[:6]) or "-"
            print(f"| {name} | {row['tok_s']:.2f} | {row['speedup']:.2f}x | {row['al']:.2f} | "
                  f"{row['acceptance_rate']:.3f} | {row['nodes']:.1f} | {equal} | {ranks} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
