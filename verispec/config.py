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
from verispec.names import RULES

#: The ranges every numeric sampling parameter is held to, checked once by :class:`SamplingParams`
#: for the CLI, the Python API and the server alike. Inside them the fp32 arithmetic of
#: :func:`verispec.sampling.to_probs` cannot overflow: a logit ``x`` becomes at most
#: ``(|x| * 1/MIN_REPETITION_PENALTY + 2 * tokens + 100) / MIN_TEMPERATURE``, about ``1e6 |x|``,
#: finite for any logits below 1e30 in magnitude (real models stay far below 1e4). Values outside
#: them (a temperature of 1e-40 or 1e39, a presence penalty of 1e39: finite in Python's float64,
#: infinite or zero in fp32) are refused here instead of poisoning a decode step.
MIN_TEMPERATURE = 1e-3  # below it, use 0 (greedy)
MAX_TEMPERATURE = 1e4  # the law is already uniform to 4 digits
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3
MAX_ABS_PENALTY = 2.0  # presence / frequency penalties, OpenAI's and vLLM's range
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range; +-inf are allowed too (force / ban a token)
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_MAX_TOKENS = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1024  # characters per stop string
MAX_BATCH = 4096  # sequences an engine runs at once
MAX_LEN = 1 << 24  # tokens per sequence (the longest context a model config may declare)
#: The most prompt tokens a draft model reads by default (``--draft-window``): a longer prompt's
#: draft starts at its last this many tokens (verispec.drafters.model explains and measures it).
DRAFT_CONTEXT_WINDOW = 1024


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}", param=name)
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}", param=name)
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}", param=name)
    return value


def _within(name: str, value: Any, low: float, high: float, hint: str = "") -> float:
    """``value`` as a float, or :class:`ConfigError` unless it is finite and in ``[low, high]``."""
    number = _finite(name, value)
    if not low <= number <= high:
        raise ConfigError(f"{name} must be in [{low:g}, {high:g}]{hint}, got {value!r}", param=name)
    return number


def check_text(name: str, text: str) -> None:
    """:class:`ConfigError` unless ``text`` can be encoded as UTF-8 (a lone surrogate such as
    ``"\\ud800"``, which JSON's ``\\u`` escapes can carry, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"{name} is not valid Unicode text (character {exc.start} is a lone surrogate "
            f"{text[exc.start]!r}); send UTF-8 text",
            param=name,
        ) from None


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns target logits into a next-token law (see :mod:`verispec.sampling`).

    The defaults are plain sampling at temperature 1. ``temperature=0`` means greedy decoding: the
    law is a point mass on the argmax (ties broken by the lowest token id). Penalties follow the
    OpenAI / vLLM definitions: ``repetition_penalty`` divides positive (multiplies negative) logits
    of tokens seen in the prompt or the output; ``presence_penalty`` and ``frequency_penalty``
    subtract a constant and a per-occurrence amount for tokens seen in the output. Every numeric
    field is checked against the range the fp32 arithmetic holds (the ``MIN_`` / ``MAX_``
    constants of this module).
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
        if t != 0.0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise ConfigError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got "
                f"{self.temperature!r}; use temperature=0 for greedy decoding",
                param="temperature",
            )
        k = _integer("top_k", self.top_k)
        if not 0 <= k <= MAX_TOP_K:
            raise ConfigError(f"top_k must be in [0, {MAX_TOP_K}] (0 turns it off), got {k}", param="top_k")
        p = _finite("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}", param="top_p")
        _within("min_p", self.min_p, 0.0, 1.0, " (0 turns it off)")
        _within(
            "repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
            " (1 turns it off)",
        )  # fmt: skip
        _within("presence_penalty", self.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        _within("frequency_penalty", self.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ConfigError(
                    f"logit_bias must map token ids to biases, got {type(self.logit_bias).__name__}", param="logit_bias"
                )
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 2**63:
                    raise ConfigError(f"logit_bias keys must be token ids >= 0, got {token!r}", param="logit_bias")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or math.isnan(bias):
                    raise ConfigError(f"logit_bias[{token}] must be a number, got {bias!r}", param="logit_bias")
                if not (math.isinf(bias) or -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                    raise ConfigError(
                        f"logit_bias[{token}] must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}] "
                        f"(or +inf to force the token, -inf to ban it), got {bias!r}",
                        param="logit_bias",
                    )
            # Freeze the mapping so that the dataclass stays hashable and immutable in practice.
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.seed is not None:
            s = _integer("seed", self.seed)
            if not 0 <= s <= MAX_SEED:
                raise ConfigError(f"seed must be in [0, 2**64 - 1] or None, got {s}", param="seed")
        mt = _integer("max_tokens", self.max_tokens)
        if not 1 <= mt <= MAX_MAX_TOKENS:
            raise ConfigError(f"max_tokens must be in [1, {MAX_MAX_TOKENS}], got {mt}", param="max_tokens")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise ConfigError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise ConfigError(f"stop strings must hold at most {MAX_STOP_LENGTH} characters", param="stop")
        for text in stop:
            check_text("stop", text)
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        """True when the law is a point mass on the (penalised, biased) argmax."""
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """True when the law is the point mass on the logits' own argmax: greedy, with no logit
        bias and no penalty to move it."""
        return self.greedy and not self.logit_bias and not self.uses_history

    @property
    def uses_history(self) -> bool:
        """True when the law depends on the tokens seen so far (any penalty is on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The acceptance rule and its settings (the draft length is :class:`EngineConfig`'s).

    ``rule="typical"`` (Medusa typical acceptance, Cai et al. 2024) does NOT preserve the target
    distribution; it must be enabled with ``allow_lossy=True`` and every result made with it is
    labelled lossy.
    """

    rule: str = "rejection"
    allow_lossy: bool = False
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"unknown acceptance rule {self.rule!r}; choose one of {', '.join(RULES)}")
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
    request and per step from measurements (``max_draft_tokens`` bounds it); then
    ``confidence_stop`` lets a draft model's chain run to ``max_draft_tokens`` and end where its
    confidence says the next token does not pay (:mod:`verispec.engine.confidence`). ``spec``: the
    acceptance rule and its lossy opt-in. ``max_len``: tokens per sequence (prompt + output) the
    KV caches hold.
    """

    max_batch: int = 8
    max_len: int = 4096
    num_draft_tokens: int | None = None
    max_draft_tokens: int = 8
    spec: SpecConfig = SpecConfig()
    prefill_chunk: int = 512
    confidence_stop: bool = True

    def __post_init__(self) -> None:
        for name, limit in (("max_batch", MAX_BATCH), ("max_len", MAX_LEN), ("max_draft_tokens", 256),
                            ("prefill_chunk", MAX_LEN)):  # fmt: skip
            value = _integer(name, getattr(self, name))
            if not 1 <= value <= limit:
                raise ConfigError(f"{name} must be in [1, {limit}], got {value}", param=name)
        if self.num_draft_tokens is not None:
            k = _integer("num_draft_tokens", self.num_draft_tokens)
            if k < 0:
                raise ConfigError(f"num_draft_tokens (K) must be >= 0 (0 = no speculation) or None (auto), got {k}")
            if k > self.max_draft_tokens:
                object.__setattr__(self, "max_draft_tokens", k)
        if not isinstance(self.spec, SpecConfig):
            raise ConfigError(f"spec must be a SpecConfig, got {type(self.spec).__name__}", param="spec")
