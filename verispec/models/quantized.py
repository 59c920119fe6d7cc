"""The quantised precisions "int4", "int4-all" and "int8": which projection runs on which kernel.

Norms, embeddings, attention and the KV cache stay bf16 in both; only the projections (q/k/v/o,
gate/up/down, the LM head) change, each by the rule below applied to the GGML type the GGUF file
stores it in (:func:`choose_kind`). Both kinds of packed projection quantise their input
activations to int8 in blocks of 64 (W8A8, like llama.cpp's Q8 activations; see
:mod:`verispec.kernels.linear`).

=========  ==========================================  ==========================================
precision  stored as Q4_K                              stored otherwise (Q6_K, Q5_0, Q8_0, F16, ...)
=========  ==========================================  ==========================================
"int4"     ``q4k``: the GGUF blocks repacked, used     ``int8``: per-output-channel int8 of the
           exactly (:class:`~verispec.kernels.Q4KLinear`;  exact (dequantised fp32) weights: a SECOND
           no second quantisation)                     rounding, for these tensors only (Q6_K:
                                                       ``q6k``, its blocks used exactly, where
                                                       ``VERISPEC_Q6K=1``; see below)
"int4-all" ``q4k``, as for "int4"                       ``q4k`` requantised from the exact weights
                                                       (:mod:`verispec.formats.requantize`: a
                                                       second, 4-bit rounding); the LM head as
                                                       for "int4"
"int8"     ``int8`` of the exact weights               ``int8`` of the exact weights
=========  ==========================================  ==========================================

"int4-all" is for drafts: a draft's precision moves only its acceptance, never the output's law,
and the 0.5B draft of the default pair, stored mostly as Q5_0 / Q8_0, streams about 40% fewer
bytes per token in it than in "int4" (its 896-input rows padded to 1024 for the fit, stored as
896: :func:`verispec.kernels.linear.q4k_packed_in_features`).

A projection whose input size is not a multiple of 32 (no GGUF K-quant or 32-block type has one)
stays ``dense`` bf16. Q4_K_M files keep Q6_K for the LM head and half of the ``ffn_down`` /
``attn_v`` tensors, so an "int4" Qwen2.5-1.5B runs 169 projections on Q4_K and 29 on int8; the
0.5B file stores nearly everything as Q5_0 or Q8_0 (its hidden size 896 is not a multiple of
Q4_K's 256), so there "int4" is mostly int8. A source without GGUF blocks (a Hugging Face folder)
has no Q4_K tensors: "int4" is refused there, "int8" quantises its floating-point weights.

Native Q6_K (``VERISPEC_Q6K=1``): the Q6_K tensors run on :class:`~verispec.kernels.Q6KLinear`,
the file's weights exactly, 0.82 bytes per weight where their int8 streams 1.0 (the 1.5B's pass:
983 MB instead of 1058). Exact and tested on every tier, but not the default: its kernel costs
more per weight than int8's (6-bit codes to assemble, a scale per 16 inputs applied in integers),
and on the CPU measured the whole int4 pass came out no faster with it (0.96-1.06x the time at
1 to 8 tokens; ``benchmarks/q6k_ab.py``, ``benchmarks/results/q6k_zen4.md``).

Packing the weights into these layouts, and the packed-weight cache beside a prepared model, are
:mod:`verispec.formats.packing`'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from verispec.errors import ConfigError
from verispec.models.config import ModelConfig

logger = logging.getLogger(__name__)

PRECISIONS = ("int4", "int4-all", "int8")
#: Version of the packed layouts (bump when csrc's layouts change: caches then rebuild).
PACK_FORMAT = "verispec.packed/5"  # 5: codes first (packing._layout); 4: Q4_K half records; 3: integer layouts
#: "1": the "int4" precision reads Q6_K tensors natively (see the module docstring)
Q6K_ENV = "VERISPEC_Q6K"


def native_q6k() -> bool:
    """Whether Q6_K tensors run natively in "int4" (``VERISPEC_Q6K=1``) rather than as int8."""
    return os.environ.get(Q6K_ENV) == "1"


INT8_ALIGN = 32


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One projection of the model: where its weights come from and its shape."""

    prefix: str  # module path, e.g. "model.layers.3.mlp.down_proj" or "lm_head"
    source: str  # tensor holding its weights ("model.embed_tokens.weight" for a tied LM head)
    out_features: int
    in_features: int
    bias: bool


def linear_specs(config: ModelConfig) -> list[LinearSpec]:
    """Every projection of a model with ``config``, in module order, the LM head last."""
    c, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv, bias = config.num_heads * d, config.num_kv_heads * d, config.attention_bias
    specs = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name, out, inp, has_bias in (
            ("self_attn.q_proj", q, c, bias),
            ("self_attn.k_proj", kv, c, bias),
            ("self_attn.v_proj", kv, c, bias),
            ("self_attn.o_proj", c, q, False),
            ("mlp.gate_proj", f, c, False),
            ("mlp.up_proj", f, c, False),
            ("mlp.down_proj", c, f, False),
        ):
            specs.append(LinearSpec(p + name, p + name + ".weight", out, inp, has_bias))
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    specs.append(LinearSpec("lm_head", head, config.vocab_size, c, False))
    return specs


def choose_kind(precision: str, stored_type: str, in_features: int, head: bool = False) -> str:
    """ "q4k", "q6k", "int8" or "dense" for a projection stored as ``stored_type`` (see the module
    table); ``head``: it is the LM head."""
    if precision not in PRECISIONS:
        raise ConfigError(f"quantised precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if in_features % INT8_ALIGN:
        return "dense"
    if precision != "int8" and stored_type == "Q4_K":
        return "q4k"
    if precision == "int4-all" and not head:
        return "q4k"
    if precision != "int8" and stored_type == "Q6_K" and in_features % 256 == 0 and native_q6k():
        return "q6k"
    return "int8"
