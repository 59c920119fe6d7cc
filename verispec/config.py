"""Frozen, validated configuration objects.

Everything a user sets is a frozen dataclass checked in ``__post_init__``: a bad value raises
:class:`~verispec.errors.ConfigError` at construction, with a message that says which values are
allowed, instead of failing (or silently misbehaving) deep inside a forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verispec.errors import ConfigError

RULE_NAMES = ("rejection", "greedy", "typical")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into a next-token law (see :mod:`verispec.sampling`).

    The defaults are plain sampling at temperature 1. ``temperature=0`` means greedy decoding: the
    law is a point mass on the argmax (ties broken by the lowest token id). Penalties follow the
    OpenAI / vLLM definitions: ``repetition_penalty`` divides positive (multiplies negative) logits
    of tokens seen in the prompt or the output; ``presence_penalty`` and ``frequency_penalty``
    subtract a constant and a per-occurrence amount for tokens seen in the output.
    """

    temperature: float = 1.0  # 0.0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off
    min_p: float = 0.0  # 0.0 => off
    repetition_penalty: float = 1.0  # 1.0 => off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        t = _finite("temperature", self.temperature)
        if t < 0:
            raise ConfigError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}; "
                "use temperature=0 for greedy decoding"
            )
        k = _integer("top_k", self.top_k)
        if k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 turns it off), got {k}")
        p = _finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        m = _finite("min_p", self.min_p)
        if not 0.0 <= m <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p!r}")
        r = _finite("repetition_penalty", self.repetition_penalty)
        if r <= 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 turns it off), got {self.repetition_penalty!r}")
        _finite("presence_penalty", self.presence_penalty)
        _finite("frequency_penalty", self.frequency_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ConfigError(f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ConfigError(f"logit_bias keys must be token ids >= 0, got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
                    raise ConfigError(f"logit_bias[{token}] must be a number, got {bias!r}")
            # Freeze the mapping so that the dataclass stays hashable and immutable in practice.
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.seed is not None:
            s = _integer("seed", self.seed)
            if s < 0:
                raise ConfigError(f"seed must be >= 0 or None, got {s}")
        mt = _integer("max_tokens", self.max_tokens)
        if mt < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {mt}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        """True when the law is a point mass on the (penalised, biased) argmax."""
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """True when the law depends on the tokens seen so far (any penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculation settings: draft length and acceptance rule.

    ``rule="typical"`` (Medusa typical acceptance, Cai et al. 2024) does NOT preserve the target
    distribution; it must be enabled with ``allow_lossy=True`` and every result made with it is
    labelled lossy.
    """

    num_draft_tokens: int = 4
    rule: str = "rejection"
    allow_lossy: bool = False
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        k = _integer("num_draft_tokens", self.num_draft_tokens)
        if k < 1:
            raise ConfigError(
                f"num_draft_tokens (K) must be >= 1, got {k}; to turn speculation off, decode without a drafter"
            )
        if self.rule not in RULE_NAMES:
            raise ConfigError(f"unknown acceptance rule {self.rule!r}; choose one of {', '.join(RULE_NAMES)}")
        if self.rule == "typical" and not self.allow_lossy:
            raise ConfigError(
                "rule 'typical' does not preserve the target distribution; "
                "pass allow_lossy=True (CLI: --allow-lossy) to use it knowingly"
            )
        eps = _finite("typical_epsilon", self.typical_epsilon)
        delta = _finite("typical_delta", self.typical_delta)
        if not 0.0 < eps <= 1.0:
            raise ConfigError(f"typical_epsilon must be in (0, 1], got {eps}")
        if delta <= 0.0:
            raise ConfigError(f"typical_delta must be > 0, got {delta}")

    @property
    def lossless(self) -> bool:
        return self.rule != "typical"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine runs: batch and context limits, draft length, acceptance rule.

    ``num_draft_tokens``: a fixed K (0 = no speculation), or None to let the policy choose K per
    request and per step from measurements (``max_draft_tokens`` bounds it).
    ``max_len``: tokens per sequence (prompt + output) the KV caches hold.
    """

    max_batch: int = 8
    max_len: int = 4096
    num_draft_tokens: int | None = None
    max_draft_tokens: int = 8
    rule: str = "rejection"
    allow_lossy: bool = False
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    prefill_chunk: int = 512

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_len", "max_draft_tokens", "prefill_chunk"):
            value = _integer(name, getattr(self, name))
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.num_draft_tokens is not None:
            k = _integer("num_draft_tokens", self.num_draft_tokens)
            if k < 0:
                raise ConfigError(f"num_draft_tokens (K) must be >= 0 (0 = no speculation) or None (auto), got {k}")
            if k > self.max_draft_tokens:
                object.__setattr__(self, "max_draft_tokens", k)
        # Reuse SpecConfig's checks of the rule and its lossy opt-in.
        SpecConfig(
            num_draft_tokens=1,
            rule=self.rule,
            allow_lossy=self.allow_lossy,
            typical_epsilon=self.typical_epsilon,
            typical_delta=self.typical_delta,
        )

    def spec_config(self) -> SpecConfig:
        return SpecConfig(
            num_draft_tokens=max(1, self.num_draft_tokens or 1),
            rule=self.rule,
            allow_lossy=self.allow_lossy,
            typical_epsilon=self.typical_epsilon,
            typical_delta=self.typical_delta,
        )
