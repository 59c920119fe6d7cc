"""Rotary position embeddings (RoPE, Su et al. 2021, "RoFormer") and their context-extension variants.

Each pair of channels ``(i, i + D/2)`` of a query or key at position ``m`` is rotated by the angle
``m * inv_freq[i]``, with ``inv_freq[i] = theta ** (-2i / D)``; the dot product of a rotated query
and key then depends only on their distance. The layout is the "rotate half" one of Llama and
transformers (channel ``i`` pairs with ``i + D/2``), not the interleaved one of the original paper.

Scalings (``ModelConfig.rope_scaling``, a :class:`~verispec.models.config.RopeScaling` whose ``type``
names the kind and whose ``extra`` pairs hold the kind's other parameters under transformers' or
llama.cpp's names), computed as transformers does so that checkpoints behave as trained:

- ``linear``: position interpolation (Chen et al. 2023, "Extending Context Window of Large Language
  Models via Positional Interpolation"): ``inv_freq / factor``.
- ``dynamic``: dynamic NTK-aware scaling (bloc97, 2023; transformers' ``dynamic``): for a sequence
  whose longest position ``s`` exceeds ``max_position``, the base becomes
  ``theta * (factor * s / max_position - (factor - 1)) ** (D / (D - 2))``. The base is computed per
  sequence from the positions of the current step, so it depends on the step; like in
  transformers, keys cached by earlier steps keep the rotation they were written with.
- ``llama3``: Llama 3.1's band-wise scaling (Dubey et al. 2024): long wavelengths divided by
  ``factor``, short ones kept, a smooth interpolation between (extra: ``low_freq_factor``,
  ``high_freq_factor``).
- ``yarn``: YaRN (Peng et al. 2023): per-band blend of interpolated and extrapolated frequencies and
  an attention temperature folded into cos/sin (extra, optional: ``attention_factor`` /
  ``attn_factor``, ``beta_fast`` / ``yarn_beta_fast``, ``beta_slow`` / ``yarn_beta_slow``,
  ``mscale``, ``mscale_all_dim``, ``truncate``).

``original_max_position`` defaults to ``max_position``, as in transformers.

Frequency factors (llama.cpp's ``rope_freqs`` tensor, which GGUF files of Llama 3.1+ carry instead
of a "llama3" scaling block; ``model.rope_freqs`` in a state dict) divide the inverse frequencies:
``inv_freq[i] / freq_factors[i]``, as in llama.cpp's ``ggml_rope_ext``.

Angles are computed in fp32 (``position * inv_freq``) and cos/sin cast to the activation dtype,
as in transformers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from verispec.errors import ModelLoadError, UnsupportedModelError
from verispec.models.config import ModelConfig, RopeScaling


def _default_inv_freq(theta: float, dim: int) -> Tensor:
    """``[dim / 2]`` fp32: ``1 / theta ** (2i / dim)``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim  # [dim/2] fp32
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: Tensor, params: dict[str, Any], max_position: int) -> Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params.get("original_max_position_embeddings", max_position))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [dim/2] fp32
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(theta: float, dim: int, params: dict[str, Any], max_position: int) -> tuple[Tensor, float]:
    original = float(params.get("original_max_position_embeddings", max_position))
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero, as transformers does
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)  # [dim/2] fp32
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # [dim/2]
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn")

# llama.cpp's names (GGUF rope.scaling.*) for the parameters transformers names otherwise.
_ALIASES = {"attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def scaling_params(scaling: RopeScaling | None) -> dict[str, Any]:
    """The scaling as a transformers-style dictionary: ``rope_type``, ``factor``,
    ``original_max_position_embeddings`` (when known) and the ``extra`` keys (llama.cpp aliases
    renamed). ``None`` and the types ``"none"`` / ``"default"`` mean plain RoPE."""
    if scaling is None or scaling.type in ("none", "default"):
        return {"rope_type": "default"}
    params: dict[str, Any] = {_ALIASES.get(k, k): v for k, v in scaling.extra}
    params["rope_type"] = scaling.type
    params["factor"] = scaling.factor
    if scaling.original_max_position is not None:
        params["original_max_position_embeddings"] = scaling.original_max_position
    return params


class RotaryEmbedding:
    """The rotary embedding of one checkpoint: inverse frequencies plus the rule that turns
    positions into ``(cos, sin)``. Holds no per-request state."""

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", freq_factors: Tensor | None = None
    ) -> None:
        self.dim = config.head_dim
        self.theta = float(config.rope_theta)
        self.max_position = config.max_position
        params = scaling_params(config.rope_scaling)
        self.kind = str(params.get("rope_type", "default"))
        if self.kind not in ROPE_KINDS:
            raise UnsupportedModelError(
                f"RoPE scaling {self.kind!r} is not implemented; supported: {', '.join(ROPE_KINDS)}"
            )
        self.attention_factor = 1.0
        self.dynamic_factor = float(params.get("factor", 1.0))
        inv_freq = _default_inv_freq(self.theta, self.dim)  # [D/2] fp32
        if self.kind == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif self.kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params, self.max_position)
        elif self.kind == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(self.theta, self.dim, params, self.max_position)
        if freq_factors is not None:
            if tuple(freq_factors.shape) != (self.dim // 2,):
                raise ModelLoadError(
                    f"rope_freqs has shape {tuple(freq_factors.shape)}, expected ({self.dim // 2},) "
                    "(one divisor per frequency of a head)"
                )
            if self.kind == "dynamic":
                raise UnsupportedModelError("rope_freqs together with dynamic RoPE scaling is not supported")
            inv_freq = inv_freq / freq_factors.to(torch.float32).cpu()
        self.inv_freq = inv_freq.to(device)  # [D/2] fp32
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}  # (table)

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        """The frequency table on ``device`` (moved once if the model was moved)."""
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def _dynamic_inv_freq(self, positions: Tensor, valid: Tensor | None) -> Tensor:
        """``[B, 1, D/2]`` fp32: dynamic-NTK inverse frequencies per sequence, from the largest
        valid position of its step (no host synchronisation)."""
        pos = positions if valid is None else torch.where(valid, positions, 0)  # [B, T] int64
        seq_len = (pos.amax(dim=1) + 1).clamp(min=self.max_position).to(torch.float32)  # [B]
        factor, dim = self.dynamic_factor, self.dim
        base = self.theta * ((factor * seq_len / self.max_position) - (factor - 1)) ** (dim / (dim - 2))  # [B]
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32) / dim
        return (1.0 / (base[:, None] ** exponents[None, :]))[:, None, :]  # [B, 1, D/2]

    def table(self, length: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``[P, D]`` in ``dtype`` of positions ``0 .. P - 1``, ``P >= length``: what
        :meth:`cos_sin` gives each of those positions, element for element (its arithmetic is
        elementwise; ``tests/unit/test_rope.py`` checks the bits), made once and grown by doubling.
        For the kernels' native passes, which look each token's rows up by its position. Not for
        dynamic scaling, whose values depend on the whole step."""
        if self.kind == "dynamic":
            raise UnsupportedModelError("dynamic RoPE scaling has no table: its angles depend on each step")
        key = (dtype, torch.device(device))
        held = self._tables.get(key)
        if held is None or held[0].shape[0] < length:
            size = max(length, 2 * held[0].shape[0] if held is not None else 0, 1)
            positions = torch.arange(size, dtype=torch.int64, device=key[1])[None, :]  # [1, P]
            cos, sin = self.cos_sin(positions, dtype)  # [1, P, 1, D] each
            held = (cos.reshape(size, self.dim).contiguous(), sin.reshape(size, self.dim).contiguous())
            self._tables[key] = held
        return held

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``positions`` ``[B, T]`` int64 -> ``(cos, sin)``, each ``[B, T, 1, D]`` in ``dtype``
        (the trailing 1 broadcasts over heads). ``valid`` ``[B, T]`` bool marks real (non-padding)
        tokens; only the dynamic scaling looks at it."""
        if self.kind == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions, valid)  # [B, 1, D/2]
        else:
            inv_freq = self._inv_freq_on(positions.device)[None, None, :]  # [1, 1, D/2]
        angles = positions.to(torch.float32)[:, :, None] * inv_freq  # [B, T, D/2] fp32
        emb = torch.cat((angles, angles), dim=-1)  # [B, T, D] fp32
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by ``cos``/``sin`` ``[B, T, 1, D]`` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, T, H, D]
    return x * cos + rotated * sin
