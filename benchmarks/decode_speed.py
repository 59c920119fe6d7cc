"""How fast does verispec decode in each precision, next to transformers, llama.cpp and the memory limit?

For the default pair (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft; prepared with
``verispec models prepare``) and each precision (bf16, int8, int4), in one run:

- **pass cost**: ms of one forward pass over T = 1, 2, 4, 5, 8, 16 new tokens after ``--context``
  cached ones (the pass that verifies T - 1 draft tokens), relative to T = 1. Precisions and widths
  take turns in an order that rotates every round, so a busy spell of the (shared) machine slows
  them alike and no width is always the first pass after a switch; median [p10-p90].
- **decode tokens/s**: plain greedy decoding of ``--tokens`` tokens through the engine (no draft),
  on ``--prompts`` HumanEval prompts, median, two ways: end to end (tokens over the whole request,
  prefill included: what transformers' ``generate`` is timed as) and text generation alone
  (tokens after the first over the time after it: what ``llama-bench`` tg reports). Each figure
  is compared only with the runtimes timed the same way.
- **physical limit**: bytes one decode step streams (every weight once, the KV cache) over the
  read bandwidth measured here with the same threads (a 1 GiB stream read by the kernels, the best
  of 7), and the fraction of it the T = 1 pass reaches; and, since a shared host's bandwidth moves
  from minute to minute, that fraction priced at each round's own bandwidth (a 512 MiB stream read
  just before the round's passes), median over rounds.
- **transformers**: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf")`` in
  bf16 and fp32, ``generate`` greedy on the same prompt ids, same token budget, median tokens/s.
- **llama.cpp**: ``llama-bench`` text generation (tg) on the same Q4_K_M file with the same thread
  count, measured in this run when llama.cpp is built (``--llama-cpp BIN``, default the folder
  ``../shared/tools/build-llamacpp.sh`` builds into); otherwise no llama.cpp row is printed.
- **greedy agreement**: the int8 and int4 outputs compared with bf16's, token by token.

Targets the issue sets: verispec bf16 >= 1.5x transformers bf16 and >= 70% of its physical limit;
a verification pass of K = 4 draft tokens (T = 5) <= 1.3x the cost of K = 1 (T = 2) in the
precision that verifies; a quantised precision faster than bf16 at plain decoding.

    python benchmarks/decode_speed.py [--threads 2] [--precisions bf16,int8,int4] [--roles target,draft]
        [--tokens 64] [--prompts 3] [--reps 9] [--context 128] [--no-hf] [--llama-cpp BIN] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from verispec.cli.doctor import machine_line
from verispec.config import EngineConfig, SamplingParams
from verispec.engine import Engine
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, load_model
from verispec.formats.registry import GGUF_FILE, model_dir
from verispec.kernels.bandwidth import probe_buffer, read_bandwidth

ROLES = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}
#: Where ../shared/tools/build-llamacpp.sh puts llama.cpp's binaries by default.
LLAMA_CPP_BIN = Path.home() / ".cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
WIDTHS = (1, 2, 4, 5, 8, 16)


def cpu_busy_elsewhere(window_s: float = 0.2) -> float:
    """CPUs' worth of work other processes did over a short window (from /proc/stat)."""

    def sample() -> tuple[float, float]:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        t = os.times()
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK"), t.user + t.system

    (b0, m0), _ = sample(), time.sleep(window_s)
    b1, m1 = sample()
    return max(0.0, (b1 - b0) - (m1 - m0)) / window_s


def wait_until_quiet(max_wait_s: float) -> float:
    """Sleep until other processes use under 0.1 CPU (at most ``max_wait_s``); return the wait."""
    t0 = time.perf_counter()
    while cpu_busy_elsewhere() > 0.1 and time.perf_counter() - t0 < max_wait_s:
        pass
    return time.perf_counter() - t0


def summary(values: list[float], scale: float = 1e3) -> dict[str, float]:
    v = sorted(values)
    return {
        "median": scale * statistics.median(v),
        "p10": scale * v[len(v) // 10],
        "p90": scale * v[(9 * len(v)) // 10],
    }


ROUND_PROBE_BYTES = 512 << 20  # past the last-level cache of the CPUs measured


@torch.inference_mode()
def pass_times(
    models: dict[str, LoadedModel], context: int, reps: int, max_wait: float
) -> tuple[dict[str, dict[int, Any]], list[float]]:
    """ms of a pass over T new tokens after ``context`` cached ones, every precision and width in
    turn; and the read bandwidth (GB/s) measured just before each timed round."""
    probe = probe_buffer(ROUND_PROBE_BYTES)
    bandwidths: list[float] = []
    caches = {p: m.model.new_cache(1, context + max(WIDTHS)) for p, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), generator=gen)
    for p, m in models.items():
        m.model(prompt, None, caches[p], logits_at=torch.tensor([[context - 1]]))
    times: dict[str, dict[int, list[float]]] = {p: {t: [] for t in WIDTHS} for p in models}
    order = list(models.items())
    for rep in range(reps + 1):
        wait_until_quiet(max_wait)
        if rep > 0:
            bandwidths.append(read_bandwidth(reps=3, buf=probe)["median"])
        # (the models and the widths in a rotating order: no width is always the first pass after a
        # switch of model or the bandwidth probe, whose caches it would find cold)
        for p, m in order[rep % len(order) :] + order[: rep % len(order)]:
            for t in WIDTHS[rep % len(WIDTHS) :] + WIDTHS[: rep % len(WIDTHS)]:
                new = torch.randint(0, vocab, (1, t), generator=gen)
                t0 = time.perf_counter()
                m.model(new, None, caches[p])
                elapsed = time.perf_counter() - t0
                caches[p].truncate([context])
                if rep > 0:  # the first round warms up allocators and page mappings
                    times[p][t].append(elapsed)
    out: dict[str, dict[int, Any]] = {p: {t: summary(v) for t, v in per.items()} for p, per in times.items()}
    for p, per in times.items():  # each width against T = 1 of the same round: robust to the host's drift
        for t, v in per.items():
            out[p][t]["vs_t1_per_round"] = statistics.median(a / b for a, b in zip(v, per[1], strict=True))
        floors = [models[p].model.weight_bytes() / (gbps * 1e9) for gbps in bandwidths]  # s per pass
        out[p][1]["of_floor_per_round"] = statistics.median(f / t1 for f, t1 in zip(floors, per[1], strict=True))
    return out, bandwidths


def verispec_decode(
    loaded: LoadedModel, prompts: list[list[int]], tokens: int
) -> tuple[list[float], list[float], list[list[int]]]:
    """Plain greedy decoding through the engine, per prompt: tokens/s end to end, tokens/s after the
    first token (text generation alone), and the token ids."""
    engine = Engine(loaded.model, loaded.tokenizer, None, EngineConfig(max_batch=1, max_len=2048, num_draft_tokens=0))
    params = SamplingParams(temperature=0, max_tokens=tokens)
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    tps, tg, outs = [], [], []
    for ids in prompts:
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        tps.append(len(out.token_ids) / (time.perf_counter() - t0))
        tpot = out.timings.get("tpot_s")
        tg.append(1.0 / tpot if tpot else float("nan"))
        outs.append(list(out.token_ids))
    return tps, tg, outs


@torch.inference_mode()
def transformers_decode(folder: Path, dtype: torch.dtype, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """transformers' greedy ``generate`` on the GGUF (dequantised by transformers): tokens/s per prompt."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_FILE, dtype=dtype).eval()
    load_s = time.perf_counter() - t0
    model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=4, do_sample=False)  # warm-up
    tps, outs = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, do_sample=False)
        tps.append((y.shape[1] - x.shape[1]) / (time.perf_counter() - t0))
        outs.append(y[0, x.shape[1] :].tolist())
    del model
    return {"tps": tps, "outs": outs, "load_s": load_s}


def agreement(a: list[int], b: list[int]) -> str:
    """ "same", or where two greedy outputs first differ."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"differs at {i}"
    return "same" if len(a) == len(b) else f"same for {min(len(a), len(b))}, lengths {len(a)}/{len(b)}"


def run_role(role: str, args: argparse.Namespace, bandwidth: float, prompts_text: list[str]) -> dict[str, Any]:
    name = ROLES[role]
    models = {}
    for precision in args.precisions:
        models[precision] = load_model(name, dtype=precision)
        print(f"# {name} {precision}: loaded in {models[precision].load_seconds:.1f} s", flush=True)
    tok = next(iter(models.values())).tokenizer
    prompts = [tok.encode(p) for p in prompts_text]
    result: dict[str, Any] = {"name": name, "rows": {}, "agreement": {}}
    passes, result["bandwidth_rounds"] = pass_times(models, args.context, args.reps, args.max_wait)
    outs = {}
    for precision, loaded in models.items():
        wait_until_quiet(args.max_wait)
        tps, tg, outs[precision] = verispec_decode(loaded, prompts, args.tokens)
        nbytes = loaded.model.weight_bytes()
        result["rows"][f"verispec {precision}"] = {
            "pass_ms": passes[precision],
            "decode_tps": statistics.median(tps),
            "decode_tps_all": tps,
            "tg_tps": statistics.median(tg),
            "tg_tps_all": tg,
            "bytes_per_token": nbytes,
            "limit_ms": nbytes / bandwidth / 1e6,
            "load_s": loaded.load_seconds,
            "kinds": {
                k: sum(lin.kind == k for lin in loaded.model.linears().values())
                for k in ("dense", "bf16", "q4k", "int8")
            },
        }
    for precision in args.precisions:
        if precision != "bf16" and "bf16" in outs:
            result["agreement"][precision] = [
                agreement(outs["bf16"][i], outs[precision][i]) for i in range(len(prompts))
            ]
    del models
    if args.hf:
        for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            wait_until_quiet(args.max_wait)
            hf = transformers_decode(model_dir(name), dtype, prompts, args.tokens)
            row = {"decode_tps": statistics.median(hf["tps"]), "decode_tps_all": hf["tps"], "load_s": hf["load_s"]}
            result["rows"][f"transformers {label}"] = row
            if label == "bf16" and "bf16" in outs:
                result["agreement"]["transformers bf16"] = [
                    agreement(outs["bf16"][i], hf["outs"][i]) for i in range(len(prompts))
                ]
    bench = Path(args.llama_cpp) / "llama-bench"
    if bench.is_file():
        wait_until_quiet(args.max_wait)
        result["rows"]["llama.cpp Q4_K_M"] = {"tg_tps": llamacpp_tg(bench, model_dir(name) / GGUF_FILE, args)}
    return result


def llamacpp_tg(bench: Path, gguf: Path, args: argparse.Namespace) -> float | None:
    """llama-bench's text-generation rate (tokens/s, mean of its repetitions) on ``gguf``, measured
    now with the same thread count; None when it fails."""
    cmd = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(args.tokens), "-t", str(args.threads), "-r", "3",
           "-o", "json"]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        rows = json.loads(out)
        return float(next(r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0))
    except (OSError, subprocess.SubprocessError, ValueError, StopIteration, KeyError) as exc:
        print(f"# llama-bench failed: {exc}")
        return None


def print_role(res: dict[str, Any]) -> None:
    rows = res["rows"]
    print(f"\n### {res['name']}")
    print("| runtime | load s | ms/pass T=1 [p10-p90] | " + " | ".join(f"T={t}" for t in WIDTHS[1:])
          + " | bytes/token | limit ms | T=1 / limit | e2e tok/s (prefill incl.) | vs transformers bf16 "
          + "| tg tok/s (after the first token) |")  # fmt: skip
    print("|---" * (8 + len(WIDTHS)) + "|")
    hf_bf16 = rows.get("transformers bf16", {}).get("decode_tps")
    for label, r in rows.items():
        p = r.get("pass_ms")
        t1 = f"{p[1]['median']:.1f} [{p[1]['p10']:.1f}-{p[1]['p90']:.1f}]" if p else "-"
        widths = [f"{p[t]['median'] / p[1]['median']:.2f}x" if p else "-" for t in WIDTHS[1:]]
        limit = f"{r['limit_ms']:.1f}" if "limit_ms" in r else "-"
        frac = f"{r['limit_ms'] / p[1]['median']:.0%}" if p else "-"
        gb = f"{r['bytes_per_token'] / 1e9:.2f} GB" if "bytes_per_token" in r else "-"
        tps, tg = r.get("decode_tps"), r.get("tg_tps")
        vs = f"{tps / hf_bf16:.2f}x" if tps and hf_bf16 else "-"
        load = f"{r['load_s']:.1f}" if "load_s" in r else "-"
        e2e, gen = (f"{tps:.1f}" if tps else "-"), (f"{tg:.1f}" if tg else "-")
        cells = [label, load, t1, *widths, gb, limit, frac, e2e, vs, gen]
        print("| " + " | ".join(cells) + " |")
    for label, r in rows.items():
        if "pass_ms" in r:
            p = r["pass_ms"]
            print(f"{label}: verify K=4 / K=1 = T5/T2 = {p[5]['median'] / p[2]['median']:.2f}x "
                  f"(T5/T1 = {p[5]['median'] / p[1]['median']:.2f}x); projections {r['kinds']}")  # fmt: skip
            if "vs_t1_per_round" in p[8]:  # (older result files lack it)
                print(f"{label}: median of each round's T / T=1: "
                      + ", ".join(f"T{t} {p[t]['vs_t1_per_round']:.2f}x" for t in WIDTHS[1:]))  # fmt: skip
            if "of_floor_per_round" in p[1]:
                bws = res["bandwidth_rounds"]
                print(f"{label}: T=1 at {p[1]['of_floor_per_round']:.0%} of the floor priced at each round's "
                      f"read bandwidth ({min(bws):.1f}-{max(bws):.1f} GB/s), median of rounds")  # fmt: skip
    for label, verdicts in res["agreement"].items():
        print(f"greedy {label} vs verispec bf16: {verdicts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="bf16,int8,int4")
    ap.add_argument("--roles", default="target,draft")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (the first N)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-wait", type=float, default=10.0, help="seconds to wait for the machine to go quiet")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    ap.add_argument("--llama-cpp", default=str(LLAMA_CPP_BIN), help="folder of llama.cpp's binaries (llama-bench)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    args.precisions = args.precisions.split(",")
    torch.set_num_threads(args.threads)
    from verispec.bench.prompts import humaneval_prompts

    prompts = humaneval_prompts()[: args.prompts]
    bw = read_bandwidth()
    machine = machine_line()
    print(f"# {machine}, loadavg {os.getloadavg()[0]:.2f}, "
          f"read bandwidth {bw['median']:.1f} GB/s median, {bw['best']:.1f} best (limits use the best)")  # fmt: skip
    results = {"machine": machine, "bandwidth": bw, "args": vars(args), "roles": {}}
    for role in args.roles.split(","):
        results["roles"][role] = run_role(role, args, bw["best"], prompts)
        print_role(results["roles"][role])
    print(f"\n# loadavg at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
