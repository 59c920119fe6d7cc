"""The measurement gate: should speculation be deployed for this pair, at which load levels?

Two deployments answer the same prompts: a baseline (plain decoding) and a speculative one, either
started here (:mod:`verispec.bench.local`: one loaded target, two engines, two in-process servers)
or external (two URLs of OpenAI-compatible servers). For every load level, each configuration runs
every prompt once per repeat (closed loop at concurrency C, or open-loop Poisson arrivals), in
alternating order (baseline first, then speculative first, ...) so that drift in the machine's
speed hits both alike. Measured per level (:mod:`verispec.bench.loadgen`):

- latency and throughput of each configuration (TTFT, ITL, TPOT, end-to-end, output tokens/s);
- acceptance: exact per-position reach from the engine's step records (local), else the
  ``/metrics`` counters, else the answers' ``spec`` objects; alpha by maximum likelihood;
- c = median draft time per draft pass / median verification time per step, from the engine's
  step records (local); externally inferred from the per-request TPOT ratio,
  ``c = (AL * TPOT_spec / TPOT_base - 1) / K`` (assumes verification costs one target step);
- the throughput ratio with a paired bootstrap interval over prompts (and repeats): per prompt the
  output tokens and end-to-end time of both configurations, so the interval is the spread of
  per-request rates (Little's law: closed-loop throughput = C * sum tokens / sum latency).

Then quality (:mod:`verispec.bench.quality`): greedy equality, perplexity of held-out text under
both configurations, HumanEval pass@1 with a paired interval; memory (:mod:`verispec.bench.local`);
and the verdicts (:mod:`verispec.bench.verdict`). The result is one JSON-able dict, rendered to
HTML by :mod:`verispec.bench.report`.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from verispec.analysis import expected_tokens, speedup
from verispec.bench.gate_quality import measure_quality
from verispec.bench.gate_types import Deployment, GateProgress, GateSettings, Run, Silent, pairs_of
from verispec.bench.loadgen import (
    Client,
    LevelResult,
    Load,
    PromptItem,
    RequestOptions,
    record_dict,
    resolve_model,
    run_level,
    summarize,
)
from verispec.bench.local import RssMonitor, StepWindow, iter_entries, memory_accounting
from verispec.bench.stats import Acceptance, acceptance_from_counts, acceptance_from_steps, paired_ratio_ci
from verispec.bench.verdict import LevelMeasurement, QualityMeasurement, decide
from verispec.errors import ConfigError


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


async def _with_client(dep: Deployment, timeout: float, fn: Callable[[Client], Any]) -> Any:
    async with Client(dep.url, dep.api_key, timeout=timeout) as client:
        return await fn(client)


def _level(dep: Deployment, prompts: Sequence[PromptItem], load: Load, options: RequestOptions,
           progress: GateProgress, scrape: bool = True) -> LevelResult:  # fmt: skip
    async def go(client: Client) -> LevelResult:
        return await run_level(client, prompts, load, options, on_done=lambda _: progress.advance(), scrape=scrape)

    result: LevelResult = asyncio.run(_with_client(dep, options.timeout, go))
    return result


def run_gate(
    baseline: Deployment,
    spec: Deployment,
    prompts: Sequence[PromptItem],
    settings: GateSettings,
    *,
    pair: dict[str, Any] | None = None,
    k_hint: int | None = None,
    progress: GateProgress | None = None,
) -> dict[str, Any]:
    """Measure both deployments and decide; returns the whole result as plain data. ``k_hint``: the
    speculative deployment's draft length when known (default: the local engine's fixed K, else the
    mean measured per level)."""
    from verispec import __version__

    if not prompts:
        raise ConfigError("the gate needs at least one prompt")
    progress = progress or Silent()
    deps = (baseline, spec)
    if k_hint is None and spec.local is not None:
        k_hint = spec.local.engine.config.num_draft_tokens  # a fixed K (None: the policy's, measured per level)
    local = baseline.local is not None and spec.local is not None
    loads0 = _loadavg()
    for dep in deps:

        async def model_of(client: Client, dep: Deployment = dep) -> str:
            return await resolve_model(client, dep.model)

        dep.model = asyncio.run(_with_client(dep, settings.timeout, model_of))
    options = {
        dep.name: RequestOptions(model=dep.model or "", max_tokens=settings.max_tokens,
                                 temperature=settings.temperature, timeout=settings.timeout)
        for dep in deps
    }  # fmt: skip
    if settings.warmup:
        progress.stage("warm-up", 2 * settings.warmup)
        for dep in deps:
            warm = Load(concurrency=1, num_requests=settings.warmup)
            short = RequestOptions(**{**asdict(options[dep.name]), "max_tokens": min(8, settings.max_tokens)})
            level = _level(dep, prompts, warm, short, progress, scrape=False)
            bad = [r for r in level.records if not r.ok]
            if bad:
                raise ConfigError(f"the {dep.name} deployment failed its warm-up request ({bad[0].error}): "
                                  f"{bad[0].error_message}")  # fmt: skip
    rss = RssMonitor() if local else None
    loads = settings.loads(len(prompts))
    runs: list[dict[str, list[Run]]] = []
    for li, load in enumerate(loads):
        per: dict[str, list[Run]] = {"baseline": [], "spec": []}
        for rep in range(settings.repeats):
            order = deps if (li + rep) % 2 == 0 else deps[::-1]
            for dep in order:
                suffix = f", repeat {rep + 1}/{settings.repeats}" if settings.repeats > 1 else ""
                progress.stage(f"{dep.name}: {load.label}{suffix}", load.num_requests)
                window = StepWindow(dep.local.engine) if dep.local is not None else None
                if window is not None:
                    window.open()
                start = rss.start() if rss is not None else None
                level = _level(dep, prompts, load, options[dep.name], progress)
                run = Run(level, window.close() if window is not None else [], start,
                          rss.peak() if rss is not None else None, _loadavg())  # fmt: skip
                per[dep.name].append(run)
        runs.append(per)
    quality = measure_quality(baseline, spec, prompts, runs, settings, progress=progress, k_hint=k_hint)
    lossless = spec.local.engine.lossless if spec.local is not None else None
    levels = [
        analyze_level(load, per, settings, quality, k_hint=k_hint, lossless=lossless)
        for load, per in zip(loads, runs, strict=True)
    ]
    memory = None
    if local:
        assert baseline.local is not None and spec.local is not None and rss is not None
        memory = {
            "method": rss.method,
            "baseline": memory_accounting(baseline.local),
            "spec": memory_accounting(spec.local),
            "note": "tensor bytes are per configuration (the target's weights are shared by both and counted "
            "in each); RSS is of the whole process",
        }
    loads_seen = [x for x in [loads0, *(r.loadavg for per in runs for rs in per.values() for r in rs), _loadavg()]
                  if x is not None]  # fmt: skip
    return {
        "verispec_version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": "local" if local else "external",
        "pair": (pair or {}) | {"lossless": lossless},
        "endpoints": {d.name: {"url": d.url, "model": d.model} for d in deps},
        "settings": asdict(settings) | {"ppl_text": "custom" if settings.ppl_text else "built-in"},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_1min": {"min": min(loads_seen), "max": max(loads_seen)} if loads_seen else None,
        },
        "num_prompts": len(prompts),
        "levels": levels,
        "quality": quality,
        "memory": memory,
        "verdicts": [lv["verdict"] for lv in levels],
        "records": [
            {name: [[record_dict(r, keep_text=False) for r in run.level.records] for run in rs]
             for name, rs in per.items()}
            for per in runs
        ],
    }  # fmt: skip


# ------------------------------------------------------------------------------ level analysis
def _merged(runs: list[Run]) -> dict[str, Any]:
    """Summary of one configuration at one level, all repeats together."""
    records = [r for run in runs for r in run.level.records]
    first, last = runs[0].level, runs[-1].level
    merged = LevelResult(first.load, records, sum(run.level.wall for run in runs), first.metrics_before,
                         last.metrics_after, first.model)  # fmt: skip
    summary = summarize(merged)
    summary["rss_start_bytes"] = min((r.rss_start for r in runs if r.rss_start is not None), default=None)
    summary["rss_peak_bytes"] = max((r.rss_peak for r in runs if r.rss_peak is not None), default=None)
    return summary


def _acceptance(spec_runs: list[Run], summary: dict[str, Any]) -> tuple[Acceptance | None, str]:
    steps = [s for run in spec_runs for s in run.steps]
    if steps:
        return acceptance_from_steps(iter_entries(steps)), "engine step records (exact per-position reach)"
    metrics = summary.get("spec_metrics")
    if metrics and metrics.get("num_draft_tokens") is not None:
        acc = acceptance_from_counts(metrics["num_drafts"] or 0, metrics["num_draft_tokens"],
                                     metrics["num_accepted_tokens"], metrics["accepted_per_pos"],
                                     metrics.get("num_free_drafts"))  # fmt: skip
        return acc, f"{metrics['source']} /metrics counters (reach assumes a constant K)"
    responses = summary.get("spec_responses")
    if responses:
        t = responses["token_weighted"]
        counts = [x * t["num_drafts"] for x in t["acceptance_per_position"]]
        acc = acceptance_from_counts(t["num_drafts"], t["num_draft_tokens"], t["num_accepted_tokens"], counts,
                                     t.get("num_free_drafts"))  # fmt: skip
        return acc, "per-response spec objects (reach assumes a constant K)"
    return None, "not measured"


def alpha_from_length(al: float, k: int) -> float:
    """The alpha whose expected acceptance length E(alpha, K) is ``al`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < al else (lo, mid)
    return (lo + hi) / 2


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyze_level(
    load: Load, per: dict[str, list[Run]], settings: GateSettings, quality: dict[str, Any], *,
    k_hint: int | None = None, lossless: bool | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every figure of one level, and its verdict."""
    base, spec = _merged(per["baseline"]), _merged(per["spec"])
    acc, acc_source = _acceptance(per["spec"], spec)
    alpha = acc.alpha if acc is not None else None
    k = k_hint
    if k is None and acc is not None and acc.mean_k:
        k = max(1, round(acc.mean_k))
    metrics = spec.get("spec_metrics") or {}
    if alpha is None and metrics.get("accept_length_gauge") and k:
        alpha = alpha_from_length(float(metrics["accept_length_gauge"]), k)
        acc_source = "SGLang's spec_accept_length gauge, inverted through E(alpha, K)"
    al = acc.mean_acceptance_length if acc is not None else metrics.get("accept_length_gauge")
    tpot_b, tpot_s = base["tpot_s"]["p50"], spec["tpot_s"]["p50"]
    c_inferred = None
    if al and k and tpot_b and tpot_s:
        c_inferred = max(0.0, (al * tpot_s / tpot_b - 1.0) / k)
    steps = [s for run in per["spec"] for s in run.steps if s.num_passes > 0]
    c, c_source = None, "unknown: no engine step records and no TPOT measurement"
    draft = _median([s.draft_seconds / s.passes for s in steps if s.passes > 0])  # (lookup-only steps: no pass)
    verify = _median([s.verify_seconds for s in steps])
    if draft is not None and verify:
        c, c_source = draft / verify, "measured from engine step records"
    elif c_inferred is not None:
        c, c_source = c_inferred, "inferred from the TPOT ratio (assumes verification costs one target step)"
    pairs = pairs_of(per["baseline"], per["spec"])
    ci = paired_ratio_ci(
        [b.output_tokens for b, _ in pairs], [b.e2e or 0.0 for b, _ in pairs],
        [s.output_tokens for _, s in pairs], [s.e2e or 0.0 for _, s in pairs],
        resamples=settings.bootstrap, confidence=settings.confidence, seed=settings.seed,
    )  # fmt: skip
    ratio = None
    tb, ts = base["output_tokens_per_s"], spec["output_tokens_per_s"]
    if ci is not None and tb and ts:
        point = ts / tb  # measured over the wall clock; the bootstrap gives its relative spread
        ratio = type(ci)(point, point * ci.low / ci.value, point * ci.high / ci.value, ci.confidence, ci.method)
    repeat_ratios = [
        s.level.summary()["output_tokens_per_s"] / b.level.summary()["output_tokens_per_s"]
        for b, s in zip(per["baseline"], per["spec"], strict=True)
        if b.level.summary()["output_tokens_per_s"] and s.level.summary()["output_tokens_per_s"]
    ]
    predicted = speedup(min(max(alpha, 0.0), 1.0), k, c) if alpha is not None and k and c is not None else None
    equal = [b.text == s.text for b, s in pairs]
    notes = _latency_notes(base, spec)
    if settings.temperature == 0 and equal:
        notes.append(f"greedy outputs equal for {sum(equal)}/{len(equal)} prompts")
    for name, summary in (("baseline", base), ("spec", spec)):
        if summary["errors"]:
            notes.append(f"{name} errors: {summary['errors']}")
    measurement = LevelMeasurement(load.label, alpha, k, c, c_source, ratio, notes)
    verdict = decide(measurement, quality_measurement(quality, settings, lossless))
    return {
        "label": load.label,
        "mode": load.mode,
        "concurrency": load.concurrency,
        "qps": load.qps,
        "baseline": base,
        "spec": spec,
        "acceptance": acc.as_dict() if acc is not None else None,
        "acceptance_source": acc_source,
        "acceptance_per_request": (spec.get("spec_responses") or {}).get("per_request"),
        "k": k,
        "alpha": alpha,
        "c": c,
        "c_source": c_source,
        "c_inferred_from_tpot": c_inferred,
        "predicted_speedup": predicted,
        "throughput_ratio": ratio.as_dict() if ratio is not None else None,
        "throughput_ratio_per_repeat": repeat_ratios,
        "tpot_speedup": tpot_b / tpot_s if tpot_b and tpot_s else None,
        "greedy_equal": {"equal": sum(equal), "pairs": len(equal)},
        "verdict": verdict.as_dict(),
    }


def _latency_notes(base: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    notes = []
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT")):
        for q in ("p50", "p95"):
            b, s = base[key][q], spec[key][q]
            if b and s:
                notes.append(f"{name} {q} {1e3 * b:.0f} -> {1e3 * s:.0f} ms ({s / b:.2f}x)")
    return notes


def quality_measurement(quality: dict[str, Any], settings: GateSettings, lossless: bool | None) -> QualityMeasurement:
    from verispec.bench.stats import Interval

    q = QualityMeasurement(ppl_margin=settings.ppl_margin, lossless=lossless)
    he, ppl = quality.get("humaneval") or {}, quality.get("perplexity") or {}
    if he.get("measured") and he.get("difference"):
        q.pass_at_1_diff = Interval(**he["difference"])
        q.pass_at_1_problems = he["problems"]
    else:
        q.skipped.append(f"HumanEval: {he.get('reason', 'not run')}")
    if ppl.get("measured"):
        q.delta_nll = Interval(**ppl["delta_nll"])
    else:
        q.skipped.append(f"perplexity: {ppl.get('reason', 'not run')}")
    law = quality.get("output_law") or {}
    if law.get("measured") and law.get("valid") is False:
        q.skipped.append("output law: not valid (a deployment's samples came in runs of identical outcomes)")
    elif law.get("measured"):
        q.law = law
    else:
        q.skipped.append(f"output law: {law.get('reason', 'not run')}")
    return q
