"""The gate's quality step: greedy equality over the sweep, perplexity, HumanEval pass@1, and
whether the output law is unchanged (a two-sample test, :mod:`verispec.certify.deployment`).

Each check runs on both deployments and says when it could not run and why (a missing package,
an endpoint without prompt logprobs, ...); the verdict then treats quality as not measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from verispec.bench.gate_types import Deployment, GateProgress, GateSettings, Run, pairs_of
from verispec.bench.loadgen import Client, Load, PromptItem, RequestOptions, RequestRecord, run_level
from verispec.bench.quality import (
    HELD_OUT_TEXT,
    HUMANEVAL_STOP,
    HumanEvalExecutor,
    greedy_equality,
    humaneval_problems,
    pass_at_1_summary,
    perplexity_summary,
    remote_nll,
    teacher_forced_nll,
)
from verispec.errors import ConfigError

PPL_PREFIX = 8  # tokens fed in one pass before scoring starts (the same in both configurations)


def measure_quality(
    baseline: Deployment,
    spec: Deployment,
    prompts: Sequence[PromptItem],
    runs: list[dict[str, list[Run]]],
    settings: GateSettings,
    *,
    progress: GateProgress,
    k_hint: int | None = None,
) -> dict[str, Any]:

    pairs = [(b.text, s.text) for per in runs for b, s in pairs_of(per["baseline"], per["spec"])]
    equality = greedy_equality(pairs)
    if settings.temperature != 0:
        equality["note"] = "sampling (temperature > 0): outputs may differ by design; equality is not a check"
    return {
        "greedy_equality": equality,
        "perplexity": perplexity(baseline, spec, runs, settings, progress, k_hint),
        "humaneval": humaneval(baseline, spec, settings, progress),
        "output_law": output_law(baseline, spec, settings, progress),
    }


LAW_LOOKAHEAD = 4  # tokens asked past the tested ones, so that drafts reach into them


def output_law(
    baseline: Deployment, spec: Deployment, settings: GateSettings, progress: GateProgress
) -> dict[str, Any]:
    """Two-sample test of the deployments' output laws (:mod:`verispec.certify.deployment`): the
    first ``law_tokens`` tokens after each of the low-entropy ``CERTIFY_PROMPTS``, ``law_samples``
    per arm, one request per sample (its own seed), at the gate's temperature (1 when it is greedy),
    through the deployments' APIs."""
    from verispec.certify.deployment import CERTIFY_PROMPTS, certify_arms
    from verispec.certify.endpoint import EndpointError, endpoint_arm
    from verispec.config import SamplingParams

    if settings.law_samples == 0:
        return {"measured": False, "reason": "skipped (--law-samples 0)"}
    tokenizer = spec.local.engine.tokenizer if spec.local is not None else None
    if tokenizer is None and settings.tokenizer:
        from verispec.formats.loader import load_tokenizer

        try:
            tokenizer = load_tokenizer(settings.tokenizer)
        except ConfigError as exc:
            return {"measured": False, "reason": str(exc)}
    if tokenizer is None:
        return {"measured": False, "reason": "external endpoints: give --tokenizer MODEL to compare their output laws"}

    def decode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    concurrency = max(settings.concurrency or (1,))
    baseline_arm, spec_arm = (
        endpoint_arm(
            dep.url,
            dep.model or "",
            decode,
            per_request=1,
            api_key=dep.api_key,
            timeout=settings.timeout,
            concurrency=concurrency,
        )
        for dep in (baseline, spec)
    )
    temperature = settings.temperature if settings.temperature > 0 else 1.0
    prompts = [(text, tokenizer.encode(text, add_special_tokens=False)) for text in CERTIFY_PROMPTS]
    progress.stage(f"output law ({settings.law_samples} + {settings.law_samples} samples per prompt)", len(prompts))
    try:
        report = certify_arms(
            baseline_arm, spec_arm, prompts, SamplingParams(temperature=temperature), samples=settings.law_samples,
            tokens=settings.law_tokens, lookahead=LAW_LOOKAHEAD, seed=settings.seed,
            progress=lambda done, total: progress.advance(),
        )  # fmt: skip
    except (EndpointError, ConfigError) as exc:
        return {"measured": False, "reason": str(exc)}
    note = "at temperature 1 (the gate's runs are greedy)" if settings.temperature == 0 else "at the gate's temperature"
    return {"measured": True, "note": note} | report.to_dict()


def _spec_k(spec: Deployment, runs: list[dict[str, list[Run]]], k_hint: int | None) -> int:
    """K of the speculative configuration's verification passes: fixed K, else the mean measured."""
    if spec.local is not None and spec.local.engine.config.num_draft_tokens:
        return int(spec.local.engine.config.num_draft_tokens)
    if k_hint:
        return k_hint
    drafted = [(d, 1) for per in runs for run in per["spec"] for s in run.steps for d in s.draft_tokens if d > 0]
    if drafted:
        return max(1, round(sum(d for d, _ in drafted) / len(drafted)))
    return 4


def perplexity(
    baseline: Deployment, spec: Deployment, runs: list[dict[str, list[Run]]], settings: GateSettings,
    progress: GateProgress, k_hint: int | None,
) -> dict[str, Any]:  # fmt: skip
    if settings.ppl_tokens == 0:
        return {"measured": False, "reason": "skipped (--ppl-tokens 0)"}
    text = settings.ppl_text or HELD_OUT_TEXT
    if baseline.local is not None and spec.local is not None:
        k = _spec_k(spec, runs, k_hint)
        engines = (baseline.local.engine, spec.local.engine)
        tokenizer = engines[1].tokenizer
        if tokenizer is None:
            return {"measured": False, "reason": "the engines have no tokenizer"}
        ids = tokenizer.encode(text, add_special_tokens=True)[: PPL_PREFIX + settings.ppl_tokens]
        progress.stage("perplexity (teacher forced)", 2)
        nll = []
        for engine, per_pass in zip(engines, (1, k + 1), strict=True):
            try:
                nll.append(teacher_forced_nll(engine.target, ids, tokens_per_pass=per_pass, prefix=PPL_PREFIX,
                                              vocab_limit=engine.vocab_limit))  # fmt: skip
            except ConfigError as exc:
                return {"measured": False, "reason": str(exc)}
            progress.advance()
        method = (f"teacher forced through the shared target: baseline 1 token per pass, speculative {k + 1} "
                  "tokens per pass (the verification shape), after the same prefill")  # fmt: skip
    else:
        progress.stage("perplexity (prompt logprobs)", 2)
        nll = []
        for dep in (baseline, spec):
            try:
                nll.append(remote_nll(dep.url, dep.model or "", text, dep.api_key, settings.timeout))
            except ConfigError as exc:
                return {"measured": False, "reason": f"{dep.name}: {exc}"}
            progress.advance()
        nll = [x[: settings.ppl_tokens] for x in nll]
        method = "prompt logprobs (echo) from each endpoint"
    out = perplexity_summary(nll[0], nll[1], resamples=settings.bootstrap, confidence=settings.confidence,
                             seed=settings.seed)  # fmt: skip
    return out | {"method": method}


def humaneval(baseline: Deployment, spec: Deployment, settings: GateSettings, progress: GateProgress) -> dict[str, Any]:
    if settings.humaneval == 0:
        return {"measured": False, "reason": "skipped (--humaneval 0)"}
    try:
        problems = humaneval_problems(settings.humaneval)
        executor = HumanEvalExecutor(
            settings.humaneval_timeout, settings.humaneval_executor,
            untrusted=settings.humaneval_untrusted, trust_code=settings.trust_endpoint_code,
        )  # fmt: skip
    except ConfigError as exc:
        return {"measured": False, "reason": str(exc)}
    items = [PromptItem(prompt=p["prompt"]) for p in problems]
    load = Load(concurrency=max(settings.concurrency or (1,)), num_requests=len(items))
    completions: dict[str, list[str | None]] = {}
    failures: dict[str, list[str]] = {}
    for dep in (baseline, spec):
        options = RequestOptions(model=dep.model or "", max_tokens=settings.humaneval_max_tokens, temperature=0.0,
                                 stop=HUMANEVAL_STOP, timeout=settings.timeout)  # fmt: skip
        progress.stage(f"HumanEval completions: {dep.name}", len(items))

        async def go(dep: Deployment = dep, options: RequestOptions = options) -> list[RequestRecord]:
            async with Client(dep.url, dep.api_key, timeout=options.timeout) as client:
                level = await run_level(client, items, load, options, on_done=lambda _: progress.advance(),
                                        scrape=False)  # fmt: skip
            return level.records

        records = asyncio.run(go())
        completions[dep.name] = [r.text if r.ok else None for r in records]
        failures[dep.name] = [f"request failed ({r.error}: {r.error_message})" for r in records]
    progress.stage(f"HumanEval tests ({executor.mode})", 2 * len(problems))
    results: dict[str, list[dict[str, Any]]] = {"baseline": [], "spec": []}
    for name, texts in completions.items():
        for problem, text, failure in zip(problems, texts, failures[name], strict=True):
            if text is None:
                results[name].append({"passed": False, "result": failure})
            else:
                results[name].append(executor.check(problem, text))
            progress.advance()
    out = pass_at_1_summary(problems, results["baseline"], results["spec"], confidence=settings.confidence,
                            executor_note=executor.note)  # fmt: skip
    same = sum(1 for a, b in zip(completions["baseline"], completions["spec"], strict=True) if a == b)
    return out | {"identical_completions": same, "max_tokens": settings.humaneval_max_tokens}
