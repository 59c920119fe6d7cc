"""The shape of a decoder-only transformer of the Llama / Qwen2 family, as one frozen dataclass.

:class:`ModelConfig` is what every loader produces (:mod:`verispec.formats.gguf` from a GGUF file's
``{arch}.*`` metadata; a Hugging Face ``config.json`` maps onto it one key for one key) and what the
runtime (:mod:`verispec.models.transformer`) consumes. Field names follow Hugging Face's
``LlamaConfig`` / ``Qwen2Config`` where one exists, so a reader who knows those knows these.

Model family facts this dataclass encodes:

- attention is grouped-query: ``num_heads`` query heads share ``num_kv_heads`` key/value heads, so
  ``num_heads % num_kv_heads == 0``; each head has ``head_dim`` channels (usually
  ``hidden_size // num_heads``, but not always, so it is stored, never recomputed);
- rotary position embeddings (RoPE, Su et al. 2021) with base ``rope_theta``, applied in Hugging
  Face's "rotate half" layout (see :mod:`verispec.formats.gguf` for llama.cpp's interleaved layout);
- RMSNorm with ``rms_norm_eps`` and a SwiGLU MLP of width ``intermediate_size``;
- Qwen2 has biases on the q/k/v projections (``attention_bias``), Llama has none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from verispec.errors import ConfigError

#: Architectures the runtime implements, by the name GGUF's ``general.architecture`` uses.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

#: The largest value each size may take: far above any released model of the family (Llama 3.1
#: 405B: 126 layers, hidden 16384, MLP 53248, 128 heads; vocabularies up to 256k), low enough that
#: a crafted file claiming more is refused before anything is allocated or looped over.
MAX_SIZES = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_layers": 1 << 10,
    "num_heads": 1 << 10,
    "num_kv_heads": 1 << 10,
    "head_dim": 1 << 12,
    "max_position": 1 << 24,
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Context-extension scaling of RoPE, as GGUF's ``{arch}.rope.scaling.*`` keys state it.

    ``type`` is llama.cpp's name: ``"linear"``, ``"yarn"`` or ``"longrope"`` (Hugging Face calls
    linear scaling ``"linear"`` too). ``extra`` keeps the other ``rope.scaling.*`` keys (YaRN's
    ``attn_factor``, ``yarn_beta_fast``, ...) as sorted ``(key, value)`` pairs, untouched.
    """

    type: str
    factor: float
    original_max_position: int | None = None
    extra: tuple[tuple[str, float | int | bool | str], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyperparameters of one decoder-only transformer (Llama / Qwen2 family)."""

    architecture: str  # GGUF's general.architecture: "llama" | "qwen2"
    vocab_size: int  # rows of the embedding matrix (may exceed the tokenizer's real vocabulary)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context length the model was trained for
    tie_word_embeddings: bool  # True: lm_head reuses model.embed_tokens.weight
    attention_bias: bool  # q_proj / k_proj / v_proj carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name: str = field(default="", compare=False)  # general.name, for messages only

    def __post_init__(self) -> None:
        for key, limit in MAX_SIZES.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{key} must be a positive integer, got {value!r}")
            if value > limit:
                raise ConfigError(f"ModelConfig.{key} = {value} is beyond any model of this family (at most {limit})")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_kv_heads > self.num_heads:
            raise ConfigError(
                f"ModelConfig.num_kv_heads ({self.num_kv_heads}) cannot exceed num_heads ({self.num_heads})"
            )
        if not (isinstance(self.rope_theta, int | float) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ConfigError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not (
            isinstance(self.rms_norm_eps, int | float) and math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0
        ):
            raise ConfigError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"ModelConfig.{key} = {value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON-able data (``rope_scaling`` as a dict or ``None``, its
        ``extra`` as ``[key, value]`` pairs); :meth:`from_dict` inverts it exactly."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        scaling = self.rope_scaling
        out["rope_scaling"] = (
            None
            if scaling is None
            else {
                "type": scaling.type,
                "factor": scaling.factor,
                "original_max_position": scaling.original_max_position,
                "extra": [[key, value] for key, value in scaling.extra],
            }
        )
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The config :meth:`to_dict` wrote. Unknown keys and bad values raise :class:`ConfigError`
        (the file was written by another program or a newer verispec)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"ModelConfig has no fields {unknown}; the data was not written by ModelConfig.to_dict "
                f"of this verispec version"
            )
        values = dict(data)
        scaling = values.get("rope_scaling")
        if scaling is not None:
            try:
                values["rope_scaling"] = RopeScaling(
                    type=str(scaling["type"]),
                    factor=float(scaling["factor"]),
                    original_max_position=scaling.get("original_max_position"),
                    extra=tuple((str(key), value) for key, value in scaling.get("extra", ())),
                )
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ConfigError(f"ModelConfig.rope_scaling is malformed: {scaling!r} ({exc})") from exc
        try:
            return cls(**values)
        except TypeError as exc:  # a required field is missing
            raise ConfigError(f"incomplete ModelConfig data: {exc}") from exc
