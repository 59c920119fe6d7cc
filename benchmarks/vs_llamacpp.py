"""verispec against llama.cpp on the CPU, on the same GGUF pair and prompts, in one run.

The default pair (Qwen2.5-Coder-1.5B-Instruct Q4_K_M target, 0.5B draft; ``verispec models
prepare``), the first ``--prompts`` HumanEval prompts, greedy, batch 1, ``--tokens`` new tokens,
the same ``--threads`` for everyone. For every prompt, in rotating order so that a busy spell of
the (shared) machine hits all of them alike:

- **llama.cpp plain**: ``llama-server -m TARGET`` (end to end: prompt + generation, from the
  server's own timings), and once, ``llama-bench -p 0 -n TOKENS`` (text generation only);
- **llama.cpp spec (server)**: ``llama-server -m TARGET -md DRAFT --spec-type draft-simple``;
- **llama.cpp spec (simple)**: ``llama-speculative-simple`` with the same pair (its printed prompt
  and decode times, added: end to end as the others; a fresh process per prompt, so its prompt
  time includes touching its weights' pages);
- **verispec plain** at each target precision of ``--configs``, and **verispec spec** for each
  ``TARGET:DRAFT`` precision pair of ``--configs`` (K auto, ``--draft-vocab``) and each drafter of
  ``--drafters`` (``model``; ``composite``: the suffix lookup, else the model, named
  ``verispec spec+composite``).

Reported: median tokens/s per configuration, acceptance (accepted / drafted draft tokens),
whether each speculative output equals its own plain output token for token (llama.cpp: the
text; its passes over several tokens can round a near tie differently from its one-token passes,
so its speculative text can leave its plain text), and the ratios the issue sets targets for:
verispec's best speculative / llama.cpp plain, verispec plain int4 / llama.cpp plain, verispec's
best / llama.cpp's best speculative.

llama.cpp comes from ``../shared/tools/build-llamacpp.sh`` (``--llama-cpp BIN``, default the folder
it builds into); without it the llama.cpp rows are skipped with a message. Where llama.cpp's AMX
path dies on batched passes (an illegal instruction where its worker threads lack the AMX
permission, or a crash in its server), the run measures that configuration (plain, or
speculative) with ``--no-repack`` and says so; the other keeps its default.

    python benchmarks/vs_llamacpp.py [--prompts 5] [--tokens 128] [--threads 2]
        [--configs int4:int8,bf16:int8] [--drafters model,composite] [--draft-vocab 32768] [--draft-max 4]
        [--json out.json] [--plot out.png]
    python benchmarks/vs_llamacpp.py --plot-from out.json --plot out.png   (draw a saved run)

``--plot`` draws the run as a PNG: each configuration's tokens/s on every prompt (dots) and its
median (bar), the ratios in the title.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from verispec.bench.prompts import humaneval_prompts
from verispec.bench.stats import per_unit_ratios
from verispec.cli.doctor import machine_line
from verispec.config import SamplingParams
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET
from verispec.formats.registry import GGUF_FILE, model_dir
from verispec.pipeline import build

# What every engine completes once before it is timed: none of the measured prompts, so that no
# drafter (the composite's suffix index learns from what it has seen) starts with one of them.
WARM_UP = 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n'
LLAMA_CPP_BIN = Path.home() / ".cache/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"


def verispec_run(engine: Any, ids: list[int], tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=tokens))[0]
    seconds = time.perf_counter() - start
    return {
        "tokens": list(out.token_ids), "tps": len(out.token_ids) / seconds, "seconds": seconds,
        "drafted": out.stats.num_draft_tokens, "accepted": out.stats.num_accepted_tokens,
    }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """One ``llama-server`` process for the duration of a ``with`` block."""

    def __init__(self, binary: Path, args: list[str]) -> None:
        self.port = free_port()
        self.cmd = [str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port), "-np", "1"]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("llama-server did not come up in 120 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def complete(self, prompt: str, tokens: int) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "seed": 0, "ignore_eos": False}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=1800) as r:
                out = json.loads(r.read())
        except OSError as exc:
            assert self.proc is not None
            raise RuntimeError(f"llama-server failed (exit {self.proc.poll()}): {exc}") from exc
        wall = time.perf_counter() - start
        t = out.get("timings", {})
        n = int(t.get("predicted_n", 0))
        seconds = (t.get("prompt_ms", 0.0) + t.get("predicted_ms", 0.0)) / 1e3 or wall
        return {"text": out.get("content", ""), "tps": n / seconds if seconds else 0.0, "seconds": seconds,
                "wall": wall, "drafted": int(t.get("draft_n", 0)),
                "accepted": int(t.get("draft_n_accepted", 0))}  # fmt: skip


def speculative_simple(binary: Path, target: Path, draft: Path, prompt: str, args: argparse.Namespace,
                       extra: list[str]) -> dict[str, Any]:  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        # llama.cpp's -f drops one trailing newline from the file (common/arg.cpp); HumanEval prompts
        # end in one, and without it the model continues another text: one more keeps the prompt whole
        f.write(prompt + "\n")
    try:
        cmd = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "-t",
               str(args.threads), "-td", str(args.threads), "-f", f.name, "-n", str(args.tokens), "--temp", "0",
               "--spec-draft-n-max", str(args.draft_max), *extra]  # fmt: skip
        run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    if run.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple exited with {run.returncode}")
    log = run.stderr
    encoded = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if decoded is None or encoded is None:
        raise RuntimeError("could not read llama-speculative-simple's timings")
    # prompt + generation, as every other row counts it
    n, seconds = int(decoded.group(1)), float(encoded.group(1)) + float(decoded.group(2))
    # stdout is the prompt as detokenised, then the generation
    text = run.stdout[run.stdout.find(prompt) + len(prompt) :] if prompt in run.stdout else run.stdout[len(prompt) :]
    return {"text": text, "tps": n / seconds, "seconds": seconds, "drafted": int(drafted.group(1)) if drafted else 0,
            "accepted": int(accepted.group(1)) if accepted else 0}  # fmt: skip


def llama_bench(binary: Path, target: Path, args: argparse.Namespace, extra: list[str]) -> float | None:
    cmd = [str(binary), "-m", str(target), "-t", str(args.threads), "-p", "0", "-n", str(args.tokens), "-r", "3",
           "-o", "json", *extra]  # fmt: skip
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return None
    rows = json.loads(run.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="int4:int8,bf16:int8", help="verispec TARGET:DRAFT precisions")
    ap.add_argument("--drafters", default="model", help="verispec drafters with a draft model: model, composite")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="verispec restricted draft head (0: off)")
    ap.add_argument("--draft-max", type=int, default=4, help="llama.cpp --spec-draft-n-max")
    ap.add_argument("--llama-cpp", type=Path, default=LLAMA_CPP_BIN)
    ap.add_argument("--no-llama", dest="llama", action="store_false")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="draw the run into this PNG")
    ap.add_argument("--plot-from", type=Path, default=None, help="draw a saved --json run (runs nothing)")
    args = ap.parse_args()
    if args.plot_from is not None:
        if args.plot is None:
            ap.error("--plot-from needs --plot")
        plot(json.loads(args.plot_from.read_text()), args.plot)
        return
    torch.set_num_threads(args.threads)
    pairs = [tuple(c.split(":")) for c in args.configs.split(",")]
    target_gguf, draft_gguf = model_dir(DEFAULT_TARGET) / GGUF_FILE, model_dir(DEFAULT_DRAFT) / GGUF_FILE
    texts = humaneval_prompts()[: args.prompts]

    runners: dict[str, Any] = {}
    plains = {}
    for target_dtype in dict.fromkeys(t for t, _ in pairs):
        plains[target_dtype] = build(DEFAULT_TARGET, None, drafter="none", dtype=target_dtype, max_batch=1,
                                     max_len=2048)  # fmt: skip
        runners[f"verispec plain {target_dtype}"] = lambda text, p=plains[target_dtype]: verispec_run(
            p.engine, p.target.tokenizer.encode(text), args.tokens
        )
    drafters = [d for d in args.drafters.split(",") if d]
    if not drafters or not set(drafters) <= {"model", "composite"}:
        ap.error("--drafters takes model and/or composite")
    for (target_dtype, draft_dtype), drafter in ((pair, d) for pair in pairs for d in drafters):
        spec = build(DEFAULT_TARGET, DEFAULT_DRAFT, drafter=drafter, dtype=target_dtype, draft_dtype=draft_dtype,
                     max_batch=1, max_len=2048, draft_head=args.draft_vocab or None)  # fmt: skip
        label = "verispec spec" if drafter == "model" else f"verispec spec+{drafter}"
        runners[f"{label} {target_dtype}/{draft_dtype}"] = lambda text, s=spec: verispec_run(
            s.engine, s.target.tokenizer.encode(text), args.tokens
        )

    notes: list[str] = []
    tg = None
    bin_dir: Path = args.llama_cpp
    if args.llama and (bin_dir / "llama-server").exists():
        base = ["-m", str(target_gguf), "-t", str(args.threads), "-c", "4096"]
        spec_args = [*base, "-md", str(draft_gguf), "--spec-type", "draft-simple", "-td", str(args.threads),
                     "--spec-draft-n-max", str(args.draft_max)]  # fmt: skip

        def repack_or_not(kind: str, server_args: list[str]) -> list[str]:
            """[] where the server runs with its default weight repacking, else ["--no-repack"]
            (probed per configuration: one that crashes must not slow the other)."""
            try:
                with LlamaServer(bin_dir / "llama-server", server_args) as srv:
                    srv.complete(texts[0], 8)
                return []
            except RuntimeError as exc:
                notes.append(
                    f"llama.cpp {kind} failed with its default weight repacking ({exc}); measured with --no-repack"
                )
                return ["--no-repack"]

        plain_extra, spec_extra = repack_or_not("plain", base), repack_or_not("speculative", spec_args)
        tg = llama_bench(bin_dir / "llama-bench", target_gguf, args, [])
        runners["llama.cpp plain (server)"] = lambda text: _served(bin_dir, [*base, *plain_extra], text, args.tokens)
        runners["llama.cpp spec (server)"] = lambda text: _served(bin_dir, [*spec_args, *spec_extra], text, args.tokens)
        runners["llama.cpp spec (simple)"] = lambda text: speculative_simple(
            bin_dir / "llama-speculative-simple", target_gguf, draft_gguf, text, args, spec_extra
        )
    elif args.llama:
        notes.append(f"llama.cpp is not built in {bin_dir} (../shared/tools/build-llamacpp.sh): its rows are skipped")

    for name, run in runners.items():  # warm-up: allocators, page mappings, calibration
        if name.startswith("verispec"):
            run(WARM_UP)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    names = list(runners)
    for i, text in enumerate(texts):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            results[name].append(runners[name](text))
            print(f"prompt {i + 1}/{len(texts)} {name}: {results[name][-1]['tps']:.2f} tok/s", flush=True)

    med = {name: statistics.median(r["tps"] for r in rs) for name, rs in results.items()}
    accept = {
        name: sum(r["accepted"] for r in rs) / max(sum(r["drafted"] for r in rs), 1)
        for name, rs in results.items()
        if " spec" in name
    }
    same: dict[str, list[bool]] = {}
    for name, rs in results.items():
        if name.startswith("verispec spec"):
            plain = results[f"verispec plain {name.split()[-1].split('/')[0]}"]
            same[name] = [a["tokens"] == b["tokens"] for a, b in zip(rs, plain, strict=True)]
        elif name.startswith("llama.cpp spec"):
            plain = results["llama.cpp plain (server)"]
            # (speculative-simple may overshoot the token budget by a draft: one output is a prefix of the other)
            same[name] = [_prefix_equal(a["text"], b["text"]) for a, b in zip(rs, plain, strict=True)]
    cpu = machine_line()  # (torch runs --threads threads, as llama.cpp does)
    print(f"\n### verispec vs llama.cpp: {cpu}, {len(texts)} HumanEval prompts, "
          f"{args.tokens} tokens, greedy, batch 1")  # fmt: skip
    print("| configuration | median tok/s | acceptance | spec == plain |\n|---|---|---|---|")
    for name, v in med.items():
        flags = same.get(name)
        rate = f"{accept[name]:.3f}" if name in accept else "-"
        print(f"| {name} | {v:.2f} | {rate} | "
              f"{'-' if flags is None else f'{sum(flags)}/{len(flags)}'} |")  # fmt: skip
    if tg is not None:
        print(f"| llama.cpp plain (llama-bench tg{args.tokens}) | {tg:.2f} | - | - |")
    ratios: dict[str, float] = {}
    best_spec = max((v for n, v in med.items() if n.startswith("verispec spec")), default=None)
    llama_plain = med.get("llama.cpp plain (server)")
    if best_spec is not None and llama_plain:
        ratios["verispec best spec / llama.cpp plain"] = best_spec / llama_plain
        llama_spec = max(v for n, v in med.items() if n.startswith("llama.cpp spec"))
        ratios["verispec best spec / llama.cpp best spec"] = best_spec / llama_spec
        if "verispec plain int4" in med:
            ratios["verispec plain int4 / llama.cpp plain"] = med["verispec plain int4"] / llama_plain
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    per_prompt = against_llama_plain(results)
    if per_prompt:
        print("per prompt against llama.cpp plain (geometric mean of the ratios): "
              + ", ".join(f"{n} {v:.2f}x" for n, v in per_prompt.items()))  # fmt: skip
    for note in notes:
        print(f"note: {note}")
    if args.json is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu": cpu, "median_tps": med,
                   "llama_bench_tg": tg, "acceptance": accept, "identical": same, "ratios": ratios,
                   "per_prompt_vs_llama_plain": per_prompt, "notes": notes,
                   "runs": {n: [{k: v for k, v in r.items() if k not in ("tokens", "text")} for r in rs]
                            for n, rs in results.items()}}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2))
    if args.plot is not None:
        plot({"cpu": cpu, "median_tps": med, "ratios": ratios, "identical": same, "llama_bench_tg": tg,
              "runs": {n: [{"tps": r["tps"]} for r in rs] for n, rs in results.items()}}, args.plot)  # fmt: skip


def against_llama_plain(runs: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Each configuration against llama.cpp's plain decoding prompt by prompt: the geometric mean
    of the per-prompt tokens/s ratios (the medians above compare whole configurations, and prompts
    whose answers differ in length move them apart; this pairs each prompt with itself)."""
    base = [r["tps"] for r in runs.get("llama.cpp plain (server)", [])]
    if not base or min(base) <= 0:
        return {}
    return {
        name: per_unit_ratios([r["tps"] for r in rs], base)["geomean_ratio"]
        for name, rs in runs.items()
        if name != "llama.cpp plain (server)" and all(r["tps"] > 0 for r in rs)
    }


def plot(payload: dict[str, Any], path: Path) -> None:
    """Tokens/s per configuration: one dot per prompt, a bar at the median; the ratios on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["median_tps"])
    top = max(r["tps"] for rs in payload["runs"].values() for r in rs)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 2.2))
    for i, name in enumerate(names):
        color = "#dd8452" if name.startswith("verispec") else "#4c72b0"
        tps = [r["tps"] for r in payload["runs"][name]]
        ax.barh(i, payload["median_tps"][name], color=color, alpha=0.55)
        ax.plot(tps, [i] * len(tps), "o", color=color, ms=4)
        flags = payload.get("identical", {}).get(name)
        equal = f", {sum(flags)}/{len(flags)} equal to plain" if flags else ""
        ax.text(max(tps) + top * 0.02, i, f"median {payload['median_tps'][name]:.1f}{equal}", va="center", fontsize=8)
    if payload.get("llama_bench_tg"):
        ax.axvline(payload["llama_bench_tg"], color="#4c72b0", ls="--", lw=1)
        ax.text(payload["llama_bench_tg"], len(names) - 0.4, " llama-bench tg (generation only)", fontsize=7,
                color="#4c72b0")  # fmt: skip
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s, end to end with the prompt (dots: prompts, bars: medians)")
    ratios = "\n".join(f"{k}: {v:.2f}x" for k, v in payload.get("ratios", {}).items())
    ax.set_title(f"{payload.get('cpu', '')}\n{ratios}", fontsize=8)
    ax.set_xlim(0, top * 1.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _prefix_equal(a: str, b: str) -> bool:
    a, b = a.strip(), b.strip()
    return bool(a and b) and (a.startswith(b) or b.startswith(a))


def _served(bin_dir: Path, server_args: list[str], text: str, tokens: int) -> dict[str, Any]:
    """One completion from a server started for it (no idle server spins beside the others), after
    a short one on WARM_UP: its weights' pages touched and its buffers allocated, as verispec's
    engines are warm when they are timed."""
    with LlamaServer(bin_dir / "llama-server", server_args) as srv:
        srv.complete(WARM_UP, 8)
        return srv.complete(text, tokens)


if __name__ == "__main__":
    main()
