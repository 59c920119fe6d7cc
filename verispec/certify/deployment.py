"""Two-sample certification of a real deployment: plain against speculative decoding, by sampling.

For each prompt, ``samples`` continuations of ``tokens`` tokens from each arm (the same sampling
parameters; every request its own seed, the arms' seeds disjoint), then
:func:`~verispec.certify.twosample.two_sample_test` on the continuations (token-id tuples), and one
decision over the prompts (:func:`~verispec.certify.twosample.combine`). An arm is anything that
turns (prompt ids, parameters, count, seed) into continuations: a local engine
(:func:`engine_arm`), or an HTTP endpoint.

:func:`certify_fit` is the goodness-of-fit mode: where the baseline can score continuations (a
local target, :func:`engine_scorer`; an endpoint with prompt logprobs), only the speculative arm
samples and its samples are tested against the baseline's probabilities (:mod:`verispec.certify.fit`).

Power comes from low-entropy outcomes: a few tokens (``tokens`` = 2..4) after prompts whose
continuation is nearly determined, at temperature 1, so that the outcomes fall in few cells and
each is seen often (the built-in ``certify`` prompt set is made of such prompts; the report gives
each prompt's detectable TV, so a weak run shows as weak). Each arm's samples are also checked for
independence in the order drawn (:func:`~verispec.certify.twosample.independence_p`): a server
that draws several continuations from one seed makes runs of identical ones, and the report is
then marked not valid instead of passing or failing on a broken assumption.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from verispec.certify.fit import fit_cells, fit_test
from verispec.certify.twosample import TwoSampleResult, combine, independence_p, two_sample_test
from verispec.config import SamplingParams
from verispec.errors import ConfigError

#: (prompt text, prompt ids, params with max_tokens, number of samples, first seed) -> continuations
Arm = Callable[[str, Sequence[int], SamplingParams, int, int], list[tuple[int, ...]]]
#: (prompt text, prompt ids, outcomes, params, tokens tested) -> each outcome's probability under
#: the baseline's sampling law (the joint law of its tokens after the prompt; an outcome shorter
#: than ``tokens`` ended at an end of sequence); None: one the scorer cannot score (tested within
#: the rest)
Scorer = Callable[[str, Sequence[int], Sequence[tuple[int, ...]], SamplingParams, int], list[float | None]]
Progress = Callable[[int, int], None]

#: Prompts whose first tokens are nearly determined (code and fixed phrases): the default set.
#: Chosen by the probability of their likeliest 3-token continuation under the default target at
#: temperature 1 (0.98, 0.74, 0.59, 0.55, 0.36, 0.35); "The capital of France is" (0.12) and
#: "print(len(" (0.06) spread over hundreds of outcomes and were dropped.
CERTIFY_PROMPTS = (
    "def fibonacci(n):\n    if n <= 1:\n        return",
    "public static void main(String[]",
    "import matplotlib.pyplot as",
    "if __name__ ==",
    "import numpy as",
    "for i in range(",
)


def engine_arm(engine: Any, batch: int = 32) -> Arm:
    """An arm that samples through a verispec :class:`~verispec.engine.Engine` (``batch`` requests
    at a time; request ``i`` has seed ``seed + i``)."""

    def sample(text: str, prompt: Sequence[int], params: SamplingParams, n: int, seed: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for start in range(0, n, batch):
            count = min(batch, n - start)
            seeded = [replace(params, seed=seed + start + i) for i in range(count)]
            results = engine.generate([list(prompt)] * count, seeded)
            out += [tuple(r.token_ids) for r in results]
        return out

    return sample


def engine_scorer(engine: Any) -> Scorer:
    """A scorer that teacher-forces a verispec engine's target: each outcome's probability is the
    product of its tokens' probabilities under the sampling law (temperature, truncation,
    penalties, the vocabulary cut: :func:`~verispec.sampling.to_probs`, as plain decoding applies
    it); an outcome shorter than ``length`` (the tokens tested) ended at an end-of-sequence id,
    which the engine does not output, so the stop's probability is multiplied in. The pass is a
    prefill rather than plain decoding's one-token passes, so the scores may differ from the
    sampler's law by the kernels' rounding (far below any detectable TV)."""
    import torch

    from verispec.sampling import TokenHistory, cut_vocab, to_probs

    model, vocab = engine.target, engine.vocab_limit
    stops = [t for t in engine.eos_token_ids if 0 <= t < vocab]

    @torch.inference_mode()
    def score(
        text: str, prompt: Sequence[int], outcomes: Sequence[tuple[int, ...]], params: SamplingParams, length: int
    ) -> list[float | None]:
        if not prompt:
            raise ConfigError("scoring needs a prompt of at least one token")
        out: list[float | None] = []
        for outcome in outcomes:
            stopped = len(outcome) < length
            if stopped and not stops:
                out.append(None)  # (cut short with no end-of-sequence id known: tested within the rest)
                continue
            n = len(outcome) + stopped  # (one more row: the stop's law after the outcome)
            ids = list(prompt) + list(outcome if stopped else outcome[:-1])
            cache = model.new_cache(1, len(ids) + 1)
            slot = cache.add_sequence()
            tokens = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, P + n - 1]
            logits = model.forward(tokens, None, cache, num_new=[len(ids)], slots=[slot])[0, len(prompt) - 1 :]
            logits = cut_vocab(logits.float(), vocab)[:, :vocab]  # [n, V]
            history = None
            if params.uses_history:
                history = TokenHistory.from_ids([prompt] * n, [outcome[:i] for i in range(n)], vocab, model.device)
            probs = to_probs(logits, [params] * n, history).to(torch.float64)  # [n, V]
            rows = torch.arange(len(outcome), device=model.device)
            picked = probs[rows, torch.tensor(outcome, dtype=torch.long, device=model.device)]
            stop = float(probs[-1, stops].sum()) if stopped else 1.0
            out.append(float(picked.prod()) * stop)
        return out

    return score


#: Below this, an arm's samples on a prompt are taken to be correlated (the run is not valid).
INDEPENDENCE_ALPHA = 1e-4


@dataclass
class PromptResult:
    prompt: str
    result: TwoSampleResult
    distinct: int  # distinct continuations seen in both arms together
    seconds: float
    independence: dict[str, float] = field(default_factory=dict)  # arm -> independence_p of its samples


@dataclass
class DeploymentReport:
    prompts: list[PromptResult] = field(default_factory=list)
    method: str = "holm"
    alpha: float = 0.01
    samples: int = 0
    tokens: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    mode: str = "two-sample"  # or "goodness-of-fit": the baseline scored the speculative samples
    pilot: int = 0  # goodness of fit: samples drawn first to choose the cells

    @property
    def p_value(self) -> float:
        return combine([p.result.p_value for p in self.prompts], self.method)

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    @property
    def correlated(self) -> list[str]:
        """ "prompt (arm)" for each arm whose samples came in runs of identical outcomes."""
        return [f"{p.prompt!r} ({arm})" for p in self.prompts for arm, v in p.independence.items()
                if v < INDEPENDENCE_ALPHA]  # fmt: skip

    @property
    def valid(self) -> bool:
        """False when some arm's samples were not independent: the p-value then means nothing."""
        return not self.correlated

    @property
    def detectable_tv(self) -> float:
        """The smallest per-prompt detectable TV (the run's best resolution on any one prompt)."""
        return min((p.result.detectable_tv for p in self.prompts), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "valid": self.valid, "correlated": self.correlated, "p_value": self.p_value,
            "combine": self.method, "alpha": self.alpha,
            "mode": self.mode, "samples_per_arm": self.samples, "pilot": self.pilot, "tokens": self.tokens,
            "params": self.params,
            "detectable_tv": self.detectable_tv,
            "prompts": [
                {"prompt": p.prompt, "distinct": p.distinct, "seconds": p.seconds, "independence_p": p.independence,
                 **p.result.to_dict()}
                for p in self.prompts
            ],
        }  # fmt: skip


def certify_arms(
    baseline: Arm,
    speculative: Arm,
    prompts: Sequence[tuple[str, Sequence[int]]],
    params: SamplingParams,
    *,
    samples: int,
    tokens: int,
    alpha: float = 0.01,
    method: str = "holm",
    seed: int = 0,
    lookahead: int = 8,
    progress: Progress | None = None,
) -> DeploymentReport:
    """Sample both arms on every ``(text, ids)`` prompt and test the first ``tokens`` tokens (module
    docstring). Each request asks for ``tokens + lookahead`` tokens: engines do not draft past
    ``max_tokens``, so without room after the tested prefix its tokens would all come from plain
    decoding steps and the test would see no speculation at all."""
    params, report = _start(params, samples, tokens, lookahead, alpha, method)
    for i, (text, ids) in enumerate(prompts):
        start = time.perf_counter()
        base_seed = seed * 1_000_003 + i * 4 * samples
        a = [c[:tokens] for c in baseline(text, ids, params, samples, base_seed)]
        b = [c[:tokens] for c in speculative(text, ids, params, samples, base_seed + 2 * samples)]  # (disjoint seeds)
        result = two_sample_test(a, b, alpha=alpha / max(1, len(prompts)), seed=seed + i)
        independence = {"baseline": independence_p(a, seed=seed + i), "speculative": independence_p(b, seed=seed + i)}
        report.prompts.append(
            PromptResult(text, result, len(set(a) | set(b)), time.perf_counter() - start, independence)
        )
        if progress is not None:
            progress(i + 1, len(prompts))
    return report


def certify_fit(
    scorer: Scorer,
    speculative: Arm,
    prompts: Sequence[tuple[str, Sequence[int]]],
    params: SamplingParams,
    *,
    samples: int,
    tokens: int,
    pilot: int | None = None,
    alpha: float = 0.01,
    method: str = "holm",
    seed: int = 0,
    lookahead: int = 8,
    progress: Progress | None = None,
) -> DeploymentReport:
    """The goodness-of-fit mode (:mod:`verispec.certify.fit`): per prompt, ``pilot`` speculative
    samples (default ``max(50, samples // 4)``) choose the cells, the baseline scores them, and
    ``samples`` further speculative samples are tested against the scores."""
    params, report = _start(params, samples, tokens, lookahead, alpha, method)
    pilot = max(50, samples // 4) if pilot is None else pilot
    if pilot < 1:
        raise ConfigError(f"the pilot sample must be >= 1, got {pilot}")
    report.mode, report.pilot = "goodness-of-fit", pilot
    for text, ids in prompts[:1]:  # a scorer that cannot score says so now, not after the first sampling
        scorer(text, ids, [], params, tokens)
    for i, (text, ids) in enumerate(prompts):
        start = time.perf_counter()
        drawn = [
            c[:tokens] for c in speculative(text, ids, params, pilot + samples, seed * 1_000_003 + i * 4 * samples)
        ]
        cells = fit_cells(drawn[:pilot])
        scores = scorer(text, ids, cells, params, tokens)
        if len(scores) != len(cells):
            raise ConfigError(f"the scorer returned {len(scores)} scores for {len(cells)} outcomes")
        test = drawn[pilot:]
        result = fit_test(
            test, dict(zip(cells, scores, strict=True)), alpha=alpha / max(1, len(prompts)), seed=seed + i
        )
        independence = {"speculative": independence_p(drawn, seed=seed + i)}
        report.prompts.append(PromptResult(text, result, len(set(test)), time.perf_counter() - start, independence))
        if progress is not None:
            progress(i + 1, len(prompts))
    return report


def _start(
    params: SamplingParams, samples: int, tokens: int, lookahead: int, alpha: float, method: str
) -> tuple[SamplingParams, DeploymentReport]:
    """The checked parameters of a run (``max_tokens`` = tested tokens + lookahead) and its empty report."""
    if samples < 2 or not 1 <= tokens <= 64:
        raise ConfigError("--samples must be >= 2 and --tokens in 1..64")
    if params.temperature == 0:
        raise ConfigError("a two-sample test compares sampled laws: use a temperature > 0 (greedy output is "
                          "compared token for token by verispec bench and the test suite)")  # fmt: skip
    if lookahead < 0:
        raise ConfigError(f"lookahead must be >= 0, got {lookahead}")
    params = replace(params, max_tokens=tokens + lookahead)
    report = DeploymentReport(method=method, alpha=alpha, samples=samples, tokens=tokens)
    report.params = {k: v for k, v in asdict(params).items() if k not in ("seed", "stop", "logit_bias")}
    return params, report
