"""How verispec runs on a CUDA GPU, next to Hugging Face transformers, at the default pair's shapes.

No weights can be downloaded on a GPU machine, so the models are Qwen2.5-Coder-1.5B / 0.5B
*shaped* (same config: layers, widths, GQA, tied 151,936-id embeddings) with transformers' random
initialisation, saved once as Hugging Face folders and loaded by verispec's HF loader: both
runtimes run the very same weights in bf16. What it measures, side by side in one run:

- **pass cost**: ms of one target forward over T = 1, 2, 4, 5, 8, 16 new tokens after
  ``--context`` cached ones (the pass that verifies T - 1 draft tokens), for batch sizes
  1, 8, 32; relative to T = 1 — the curve speculation lives on (flat = memory-bound);
- **plain decoding**: tokens/s of verispec's engine (no drafter) and of ``model.generate`` (greedy,
  same prompt ids, same number of new tokens), batch 1; greedy agreement of the two, token by token;
- **draft cost ratio c**: one 0.5B-shaped decode step over one 1.5B-shaped decode step;
- **prompt lookup**: verispec's n-gram drafter (K = 4) against transformers' prompt-lookup assisted
  generation (``prompt_lookup_num_tokens=4``) on a prompt that repeats itself; random weights
  make acceptance an artefact of this model, so read the ratio of each runtime to its own plain
  decoding, not the absolute speedup.

    python benchmarks/cuda_speed.py [--tokens 128] [--context 256] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.formats.hf import load_hf_folder
from verispec.models.transformer import Transformer

# The configs of Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct (config.json of those checkpoints).
SHAPES: dict[str, dict[str, Any]] = {
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14},
}
WIDTHS = (1, 2, 4, 5, 8, 16)
BATCHES = (1, 8, 32)
VOCAB = 151_936


def hf_model(size: str, folder: Path, device: str) -> Any:
    """A random Qwen2 model of ``size``'s shape in bf16 on ``device``, also saved to ``folder``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, num_key_value_heads=2, **SHAPES[size],
    )  # fmt: skip
    torch.manual_seed({"1.5b": 0, "0.5b": 1}[size])
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(folder)
    return model.to(device).eval()


def ours(folder: Path, device: str) -> Transformer:
    config, state = load_hf_folder(folder, torch.bfloat16, device)
    return Transformer(config, state, dtype=torch.bfloat16, device=device)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, reps: int) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after two warm-ups, synchronised."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def pass_costs(model: Transformer, context: int, reps: int) -> dict[int, dict[int, float]]:
    """{batch: {T: ms}} of one forward over T new tokens after ``context`` cached ones."""
    out: dict[int, dict[int, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for batch in BATCHES:
        cache = model.new_cache(batch, context + 32)
        prompt = torch.randint(0, VOCAB, (batch, context), generator=gen).to(model.device)
        with torch.inference_mode():
            model(prompt, None, cache, logits_at=torch.full((batch, 1), context - 1, device=model.device))
        out[batch] = {}
        for width in WIDTHS:
            ids = torch.randint(0, VOCAB, (batch, width), generator=gen).to(model.device)

            def step(ids: torch.Tensor = ids, cache: Any = cache, batch: int = batch) -> None:
                with torch.inference_mode():
                    model(ids, None, cache)
                cache.truncate([context] * batch)

            out[batch][width] = timed(step, reps)
    return out


def engine_decode(model: Transformer, prompt: list[int], tokens: int, drafter: str = "none",
                  k: int | None = None) -> tuple[list[int], float, dict[str, Any]]:  # fmt: skip
    """(token ids, tokens/s, stats) of greedy decoding through the engine, batch 1."""
    d = make_drafter(drafter, vocab_size=VOCAB, max_len=len(prompt) + tokens + 64)
    engine = Engine(model, None, d, EngineConfig(max_batch=1, max_len=len(prompt) + tokens + 32,
                                                  num_draft_tokens=k if drafter != "none" else 0))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=tokens)
    engine.generate([prompt], params)  # warm-up (kernels, allocator)
    sync()
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    sync()
    seconds = time.perf_counter() - start
    s = out.stats
    stats = {"acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length}
    return list(out.token_ids), len(out.token_ids) / seconds, stats


def hf_decode(model: Any, prompt: list[int], tokens: int, **extra: Any) -> tuple[list[int], float]:
    """(token ids, tokens/s) of transformers' greedy ``generate`` (plus ``extra``), batch 1."""
    ids = torch.tensor([prompt], device=model.device)
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, **extra)
    with torch.inference_mode():
        model.generate(ids, **kw)
        sync()
        start = time.perf_counter()
        out = model.generate(ids, **kw)
        sync()
    seconds = time.perf_counter() - start
    new = out[0, len(prompt) :].tolist()
    return new, len(new) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode (default 128)")
    ap.add_argument("--context", type=int, default=256, help="cached tokens before a timed pass (default 256)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per pass (default 20)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("cuda_speed.py needs a CUDA GPU (torch sees none); --device cpu runs it, slowly")
    device = args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    result: dict[str, Any] = {"gpu": name, "torch": torch.__version__}
    print(f"# {result['gpu']}, torch {torch.__version__}, bf16, random weights of the default pair's shapes")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (args.context,), generator=gen).tolist()
    repetitive = (torch.randint(0, VOCAB, (48,), generator=gen).tolist()) * 4

    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for size in ("1.5b", "0.5b"):
            folder = Path(tmp) / size
            hf = hf_model(size, folder, device)
            models[size] = (hf, ours(folder, device))

        hf_t, our_t = models["1.5b"]
        costs = pass_costs(our_t, args.context, args.reps)
        result["pass_ms"] = costs
        print("\n| target 1.5B-shaped | " + " | ".join(f"T={w}" for w in WIDTHS) + " |")
        print("|---" * (len(WIDTHS) + 1) + "|")
        for batch, row in costs.items():
            base = row[1]
            cells = [f"{row[1]:.2f} ms"] + [f"{row[w] / base:.2f}x" for w in WIDTHS[1:]]
            print(f"| B={batch} | " + " | ".join(cells) + " |")

        draft_costs = pass_costs(models["0.5b"][1], args.context, args.reps)
        c = draft_costs[1][1] / costs[1][1]
        result["draft_pass_ms"] = draft_costs
        result["c"] = c
        print(f"\ndraft 0.5B-shaped decode step {draft_costs[1][1]:.2f} ms -> c = {c:.3f} (batch 1)")

        our_ids, our_tps, _ = engine_decode(our_t, prompt, args.tokens)
        hf_ids, hf_tps = hf_decode(hf_t, prompt, args.tokens)
        agree = next((i for i, (a, b) in enumerate(zip(our_ids, hf_ids, strict=False)) if a != b), len(our_ids))
        result["plain"] = {"verispec_tps": our_tps, "transformers_tps": hf_tps, "greedy_agreement": agree}
        print(f"\nplain greedy decoding, batch 1, {args.tokens} tokens after {args.context}:")
        print(f"  verispec {our_tps:.1f} tok/s, transformers {hf_tps:.1f} tok/s -> {our_tps / hf_tps:.2f}x")
        print(f"  greedy outputs identical for the first {agree} of {len(our_ids)} tokens (bf16, random weights)")

        plain_ids, plain_tps, _ = engine_decode(our_t, repetitive, args.tokens)
        ng_ids, ng_tps, ng_stats = engine_decode(our_t, repetitive, args.tokens, drafter="ngram", k=4)
        _, hf_plain_tps = hf_decode(hf_t, repetitive, args.tokens)
        _, hf_pl_tps = hf_decode(hf_t, repetitive, args.tokens, prompt_lookup_num_tokens=4)
        result["prompt_lookup"] = {
            "verispec_plain_tps": plain_tps, "verispec_ngram_tps": ng_tps, "verispec_speedup": ng_tps / plain_tps,
            "verispec_stats": ng_stats, "verispec_same_as_plain": ng_ids == plain_ids,
            "transformers_plain_tps": hf_plain_tps, "transformers_lookup_tps": hf_pl_tps,
            "transformers_speedup": hf_pl_tps / hf_plain_tps,
        }  # fmt: skip
        print("\nprompt lookup (K = 4) on a self-repeating prompt, batch 1, greedy:")
        print(f"  verispec     {plain_tps:.1f} -> {ng_tps:.1f} tok/s ({ng_tps / plain_tps:.2f}x), "
              f"AR {ng_stats['acceptance_rate']:.2f}, AL {ng_stats['mean_acceptance_length']:.2f}, "
              f"output {'identical to' if ng_ids == plain_ids else 'DIFFERENT from'} plain")  # fmt: skip
        print(f"  transformers {hf_plain_tps:.1f} -> {hf_pl_tps:.1f} tok/s ({hf_pl_tps / hf_plain_tps:.2f}x)")
        print(f"  verispec lookup / transformers lookup: {ng_tps / hf_pl_tps:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
