"""Two-sample certification of a real deployment: plain against speculative decoding, by sampling.

For each prompt, ``samples`` continuations of ``tokens`` tokens from each arm (the same sampling
parameters; every request its own seed, the arms' seeds disjoint), then
:func:`~verispec.certify.twosample.two_sample_test` on the continuations (token-id tuples), and one
decision over the prompts (:func:`~verispec.certify.twosample.combine`). An arm is anything that
turns (prompt ids, parameters, count, seed) into continuations: a local engine
(:func:`engine_arm`), or an HTTP endpoint.

Power comes from low-entropy outcomes: a few tokens (``tokens`` = 2..4) after prompts whose
continuation is nearly determined, at temperature 1, so that the outcomes fall in few cells and
each is seen often (the built-in ``certify`` prompt set is made of such prompts; the report gives
each prompt's detectable TV, so a weak run shows as weak).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from verispec.certify.twosample import TwoSampleResult, combine, two_sample_test
from verispec.config import SamplingParams
from verispec.errors import ConfigError

#: (prompt text, prompt ids, params with max_tokens, number of samples, first seed) -> continuations
Arm = Callable[[str, Sequence[int], SamplingParams, int, int], list[tuple[int, ...]]]
Progress = Callable[[int, int], None]

#: Prompts whose first tokens are nearly determined (code and fixed phrases): the default set.
CERTIFY_PROMPTS = (
    "def fibonacci(n):\n    if n <= 1:\n        return",
    "import numpy as",
    "for i in range(",
    "The capital of France is",
    "x = [1, 2, 3, 4, 5]\nprint(len(",
    "if __name__ ==",
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


@dataclass
class PromptResult:
    prompt: str
    result: TwoSampleResult
    distinct: int  # distinct continuations seen in both arms together
    seconds: float


@dataclass
class DeploymentReport:
    prompts: list[PromptResult] = field(default_factory=list)
    method: str = "holm"
    alpha: float = 0.01
    samples: int = 0
    tokens: int = 0
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def p_value(self) -> float:
        return combine([p.result.p_value for p in self.prompts], self.method)

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    @property
    def detectable_tv(self) -> float:
        """The smallest per-prompt detectable TV (the run's best resolution on any one prompt)."""
        return min((p.result.detectable_tv for p in self.prompts), default=1.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "p_value": self.p_value, "combine": self.method, "alpha": self.alpha,
            "samples_per_arm": self.samples, "tokens": self.tokens, "params": self.params,
            "detectable_tv": self.detectable_tv,
            "prompts": [
                {"prompt": p.prompt, "distinct": p.distinct, "seconds": p.seconds, **p.result.to_dict()}
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
    if samples < 2 or not 1 <= tokens <= 64:
        raise ConfigError("--samples must be >= 2 and --tokens in 1..64")
    if params.temperature == 0:
        raise ConfigError("a two-sample test compares sampled laws: use a temperature > 0 (greedy output is "
                          "compared token for token by verispec bench and the test suite)")  # fmt: skip
    params = replace(params, max_tokens=tokens + lookahead)
    report = DeploymentReport(method=method, alpha=alpha, samples=samples, tokens=tokens)
    if lookahead < 0:
        raise ConfigError(f"lookahead must be >= 0, got {lookahead}")
    report.params = {k: v for k, v in asdict(params).items() if k not in ("seed", "stop", "logit_bias")}
    for i, (text, ids) in enumerate(prompts):
        start = time.perf_counter()
        base_seed = seed * 1_000_003 + i * 4 * samples
        a = [c[:tokens] for c in baseline(text, ids, params, samples, base_seed)]
        b = [c[:tokens] for c in speculative(text, ids, params, samples, base_seed + 2 * samples)]  # (disjoint seeds)
        result = two_sample_test(a, b, alpha=alpha / max(1, len(prompts)), seed=seed + i)
        report.prompts.append(PromptResult(text, result, len(set(a) | set(b)), time.perf_counter() - start))
        if progress is not None:
            progress(i + 1, len(prompts))
    return report
