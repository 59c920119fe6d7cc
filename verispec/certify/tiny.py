"""Tiny random transformers built in code: for certification and tests (nothing is downloaded).

:func:`tiny_pair` makes a target and a draft that resembles it (the target's weights plus noise),
so that speculation accepts often but not always, on a vocabulary small enough for exact laws
(:mod:`verispec.certify.exact`).
"""

from __future__ import annotations

import torch

from verispec.models.config import ModelConfig
from verispec.models.transformer import Transformer, random_state_dict


def tiny_config(vocab: int = 8, hidden: int = 32, layers: int = 2, eos: int | None = None) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=hidden // 4,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position=512,
        tie_word_embeddings=False,
        attention_bias=True,
        eos_token_id=eos,
        name=f"tiny-{vocab}",
    )


def tiny_pair(
    vocab: int = 8,
    seed: int = 0,
    std: float = 0.35,
    draft_noise: float = 0.15,
    eos: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[Transformer, Transformer]:
    """A target and a draft resembling it (each weight plus ``draft_noise`` times its std of noise),
    on ``device`` (the weights are drawn on the CPU, so every device gets the same models)."""
    config = tiny_config(vocab, eos=eos)
    target_sd = random_state_dict(config, seed=seed, std=std)
    gen = torch.Generator().manual_seed(seed + 1000)
    draft_sd = {
        k: v + draft_noise * torch.randn(v.shape, generator=gen) * (v.std() if v.numel() > 1 else 1.0)
        for k, v in target_sd.items()
    }
    return (
        Transformer(config, target_sd, dtype=dtype, device=device),
        Transformer(config, draft_sd, dtype=dtype, device=device),
    )


def kernel_draft(vocab: int = 8, seed: int = 0) -> Transformer:
    """A random bf16 draft on verispec's CPU kernels (the shapes they take: inputs multiples of 32,
    head size 32), over the tiny vocabulary: certification of drafting on the kernels
    (:meth:`~verispec.models.transformer.Transformer.draft`). Any model may draft; the target's
    law is what is certified."""
    config = ModelConfig(
        architecture="qwen2", vocab_size=vocab, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, max_position=512,
        tie_word_embeddings=False, attention_bias=True, name=f"tiny-kernels-{vocab}",
    )  # fmt: skip
    return Transformer(config, random_state_dict(config, seed=seed, std=0.08), dtype=torch.bfloat16, cpu_kernels=True)
