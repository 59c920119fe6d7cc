"""The gate's data: its settings, the deployments it measures, one run's records, and the
progress callback. :mod:`verispec.bench.gate` measures and decides with them and
:mod:`verispec.bench.gate_quality` measures quality with them (gate imports gate_quality, never
the other way round)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from verispec.bench.loadgen import LevelResult, Load, RequestRecord
from verispec.bench.local import LocalDeployment
from verispec.engine.recorder import StepRecord
from verispec.errors import ConfigError


@dataclass(frozen=True)
class GateSettings:
    """How much the gate measures (see ``verispec gate --help`` for each field)."""

    concurrency: tuple[int, ...] = (1, 2, 4)
    qps: tuple[float, ...] = ()
    max_tokens: int = 64
    temperature: float = 0.0
    repeats: int = 1
    warmup: int = 1
    humaneval: int = 5
    humaneval_max_tokens: int = 128
    humaneval_timeout: float = 10.0
    humaneval_executor: str = "auto"
    humaneval_untrusted: bool = False  # completions come from endpoints this process did not start
    trust_endpoint_code: bool = False  # run them even without an isolated sandbox
    ppl_tokens: int = 128
    ppl_text: str | None = None
    bootstrap: int = 2000
    confidence: float = 0.95
    ppl_margin: float = 0.01
    law_samples: int = 200  # per arm and prompt of the output-law test (0: skip)
    law_tokens: int = 2
    tokenizer: str | None = None  # external endpoints: turns their text into ids for the output-law test
    seed: int = 0
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.concurrency and not self.qps:
            raise ConfigError("give at least one load level (--concurrency or --qps)")
        if any(c < 1 for c in self.concurrency) or any(not q > 0 for q in self.qps):
            raise ConfigError("concurrency levels must be >= 1 and qps levels > 0")
        for name in ("max_tokens", "repeats", "bootstrap", "humaneval_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.law_tokens <= 64:
            raise ConfigError(f"law-tokens must be in 1..64, got {self.law_tokens}")
        for name in ("humaneval", "ppl_tokens", "warmup", "law_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.5 <= self.confidence < 1.0:
            raise ConfigError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if self.temperature < 0 or self.timeout <= 0 or self.humaneval_timeout <= 0 or self.ppl_margin < 0:
            raise ConfigError("temperature and ppl-margin must be >= 0, timeouts > 0")

    def loads(self, num_prompts: int) -> list[Load]:
        closed = [Load(concurrency=c, num_requests=num_prompts) for c in self.concurrency]
        return closed + [Load(qps=q, num_requests=num_prompts, seed=self.seed) for q in self.qps]


@dataclass
class Deployment:
    """One configuration as the gate reaches it: URL, model name, key, and (local) the engine."""

    name: str  # "baseline" or "spec"
    url: str
    model: str | None = None
    api_key: str | None = None
    local: LocalDeployment | None = None


class GateProgress(Protocol):
    def stage(self, description: str, total: int | None) -> None: ...
    def advance(self) -> None: ...


class Silent:
    """A progress callback that shows nothing."""

    def stage(self, description: str, total: int | None) -> None:
        pass

    def advance(self) -> None:
        pass


@dataclass
class Run:
    """One configuration at one level, one repeat."""

    level: LevelResult
    steps: list[StepRecord] = field(default_factory=list)
    rss_start: int | None = None
    rss_peak: int | None = None
    loadavg: float | None = None


def pairs_of(base: list[Run], spec: list[Run]) -> list[tuple[RequestRecord, RequestRecord]]:
    """(baseline, speculative) records of the same prompt in the same repeat, both completed."""
    out = []
    for b_run, s_run in zip(base, spec, strict=True):
        s_by = {r.prompt_index: r for r in s_run.level.records if r.ok}
        out += [(b, s_by[b.prompt_index]) for b in b_run.level.records if b.ok and b.prompt_index in s_by]
    return out
