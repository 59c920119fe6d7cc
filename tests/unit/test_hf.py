"""Hugging Face folders (verispec.formats.hf): config mapping, safetensors loading, typed errors, and
the generic transformers adapter.

Folders are written by transformers' own ``save_pretrained`` from tiny random models built here
(hidden 64, 2 layers, vocab 101; weights with std 0.2 so logits are far from flat), with a
``tokenizer.json`` built with the ``tokenizers`` library; nothing is downloaded. The runtime loaded
from a folder must reproduce transformers' logits; the adapter must reproduce ``generate`` and
behave like a KVCache under rollback, for an architecture the runtime does not implement (GPT-2,
GPT-NeoX) as well as for Llama.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import Tensor

from verispec.errors import ConfigError, InputError, ModelLoadError, UnsupportedModelError
from verispec.formats.hf import (
    adapt,
    config_from_hf,
    load_adapter,
    load_hf_folder,
    read_hf_config,
    resolve_dtype,
)
from verispec.formats.tokenizer import Tokenizer
from verispec.models.config import ModelConfig, RopeScaling
from verispec.models.hf_adapter import HFCausalLMAdapter
from verispec.models.transformer import Transformer

V = 101
STD = 0.2
FP32_HF_TOL = 1e-4
SELF_TOL = 1e-5

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_SCALING = RopeScaling(
    "llama3", 8.0, 16, (("high_freq_factor", 4.0), ("low_freq_factor", 1.0))
)  # with original_max_position_embeddings=16


# ------------------------------------------------------------------------------ config.json -> config


def llama_json(**overrides: Any) -> dict[str, Any]:
    """A config.json as transformers 4.x wrote it for Llama 3.1 (shrunk)."""
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 16},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": [2, 3, 4],
        "torch_dtype": "bfloat16",
    }
    base.update(overrides)
    return base


def test_config_from_hf_maps_every_field() -> None:
    got = config_from_hf(llama_json(head_dim=32, pad_token_id=5), name="tiny")
    expected = ModelConfig(
        architecture="llama",
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position=256,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_scaling=LLAMA3_SCALING,
        bos_token_id=1,
        eos_token_id=2,  # the first of the list
        pad_token_id=5,
    )
    assert got == expected and got.name == "tiny"


def test_config_from_hf_qwen2_mistral_and_defaults() -> None:
    qwen = config_from_hf(
        llama_json(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            rope_scaling=None,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=32,  # inactive: use_sliding_window is false
            max_window_layers=1,
            eos_token_id=7,
        )
    )
    assert (qwen.architecture, qwen.attention_bias, qwen.tie_word_embeddings) == ("qwen2", True, True)
    assert (qwen.rope_scaling, qwen.max_position, qwen.eos_token_id) == (None, 256, 7)
    mistral = config_from_hf(
        llama_json(architectures=["MistralForCausalLM"], rope_scaling=None, sliding_window=None, head_dim=None)
    )
    assert (mistral.architecture, mistral.head_dim, mistral.max_position) == ("llama", 16, 256)
    # Missing optional keys take transformers' defaults; no architectures -> model_type.
    minimal = {k: v for k, v in llama_json().items() if k.startswith(("vocab", "hidden_", "interm", "num_", "max"))}
    bare = config_from_hf({**minimal, "model_type": "llama", "num_key_value_heads": None})
    assert (bare.num_kv_heads, bare.rope_theta, bare.rms_norm_eps, bare.tie_word_embeddings) == (
        4,
        1e4,
        1e-6,
        False,
    )
    assert (bare.rope_scaling, bare.eos_token_id, bare.bos_token_id) == (None, None, None)


@pytest.mark.parametrize(
    ("spelling", "theta", "scaling"),
    [
        ({"rope_scaling": {"type": "linear", "factor": 4}}, 500000.0, RopeScaling("linear", 4.0)),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 500000.0, RopeScaling("dynamic", 2.0)),
        (
            {
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 16,
                }
            },
            500000.0,
            RopeScaling("yarn", 4.0, 64, (("beta_fast", 16),)),
        ),
        ({"rope_scaling": {"rope_type": "default"}}, 500000.0, None),
        # transformers 5: one rope_parameters block holding rope_theta
        (
            {
                "rope_theta": None,
                "rope_scaling": None,
                "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
            },
            1e6,
            None,
        ),
        (
            {
                "rope_theta": None,
                "rope_scaling": None,
                "rope_parameters": {"rope_theta": 8.0, **LLAMA3, "original_max_position_embeddings": 16},
            },
            8.0,
            LLAMA3_SCALING,
        ),
    ],
    ids=["linear-legacy-type", "dynamic", "yarn-extra", "default", "v5-default", "v5-llama3"],
)
def test_rope_spellings(spelling: dict[str, Any], theta: float, scaling: RopeScaling | None) -> None:
    cfg = llama_json(**spelling)
    cfg = {k: v for k, v in cfg.items() if v is not None or k not in ("rope_theta", "rope_scaling")}
    got = config_from_hf(cfg)
    assert (got.rope_theta, got.rope_scaling) == (theta, scaling)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            {"architectures": ["FalconForCausalLM"]},
            ["FalconForCausalLM", "Qwen2ForCausalLM", "HFCausalLMAdapter"],
        ),
        ({"architectures": None, "model_type": "gpt2"}, ["gpt2", "HFCausalLMAdapter"]),
        ({"hidden_act": "gelu"}, ["gelu"]),
        ({"attention_bias": True}, ["o_proj", "HFCausalLMAdapter"]),
        ({"mlp_bias": True}, ["mlp_bias"]),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ["longrope", "yarn"]),
        ({"partial_rotary_factor": 0.5}, ["partial rotary"]),
        ({"quantization_config": {"quant_method": "gptq"}}, ["gptq"]),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, ["sliding-window", "RoPE scaling"]),
    ],
    ids=["arch", "model-type", "act", "o-bias", "mlp-bias", "longrope", "partial", "quant", "window+scaling"],
)
def test_unsupported_configs_are_typed_errors(overrides: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        config_from_hf(llama_json(**overrides))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [{"hidden_size": None}, {"num_hidden_layers": "2"}, {"num_key_value_heads": 3}, {"rope_scaling": [1]}],
    ids=["missing", "string", "gqa", "rope-list"],
)
def test_malformed_configs_are_load_errors(overrides: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError) as info:
        config_from_hf(llama_json(**overrides))
    assert not isinstance(info.value, UnsupportedModelError)
    assert "config.json" in str(info.value)


def test_sliding_window_lowers_max_position(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="verispec.formats.hf"):
        cfg = config_from_hf(llama_json(architectures=["MistralForCausalLM"], rope_scaling=None, sliding_window=64))
    assert cfg.max_position == 64 and "sliding-window" in caplog.text
    wide = config_from_hf(llama_json(architectures=["MistralForCausalLM"], rope_scaling=None, sliding_window=4096))
    assert wide.max_position == 256  # the window never binds


def test_out_of_vocabulary_token_ids_are_dropped() -> None:
    cfg = config_from_hf(llama_json(eos_token_id=[V + 5, 2], bos_token_id=-1, pad_token_id=V))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (None, None, None)


def test_resolve_dtype() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("FP16") is torch.float16
    assert resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(ConfigError, match="fp32"):
        resolve_dtype("fp8")


# --------------------------------------------------------------------------- tiny transformers models


def _tf() -> Any:
    return pytest.importorskip("transformers")


def randomize(model: Any, seed: int) -> Any:
    """Weights far from transformers' tiny init (std 0.02 gives nearly flat logits): matrices
    N(0, STD), biases N(0, 0.1), norm weights 1 + N(0, 0.1); deterministic, global RNG untouched."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * STD if p.dim() > 1 else noise * 0.1 + (0.0 if name.endswith("bias") else 1.0))
    return model.eval()


def tiny_model(family: str, seed: int = 0) -> Any:
    tf = _tf()
    common: dict[str, Any] = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=[2, 3],
        pad_token_id=None,
    )
    if family == "llama":
        cfg = tf.LlamaConfig(rope_theta=5e5, rope_scaling={**LLAMA3, "original_max_position_embeddings": 16}, **common)
        return randomize(tf.LlamaForCausalLM(cfg), seed)
    if family == "qwen2":
        return randomize(tf.Qwen2ForCausalLM(tf.Qwen2Config(rope_theta=1e6, tie_word_embeddings=True, **common)), seed)
    if family == "mistral":
        cfg = tf.MistralConfig(sliding_window=None, head_dim=32, **common)
        return randomize(tf.MistralForCausalLM(cfg), seed)
    if family == "gpt2":  # learned positions, LayerNorm, GELU MLP, fused qkv: not the runtime's family
        cfg = tf.GPT2Config(
            vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2
        )
        return randomize(tf.GPT2LMHeadModel(cfg), seed)
    assert family == "gpt_neox"  # partial rotary embeddings, parallel residual
    cfg = tf.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return randomize(tf.GPTNeoXForCausalLM(cfg), seed)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, V)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))


def save(model: Any, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    write_tokenizer(folder)
    return folder


def toks(*shape: int, seed: int = 0) -> Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tiny_model("llama", seed=1), tmp_path_factory.mktemp("llama"))


# ------------------------------------------------------------------------------------ the loader


@pytest.mark.parametrize("case", ["llama", "qwen2", "mistral", "llama-sharded"])
def test_runtime_from_folder_matches_transformers(case: str, tmp_path: Path) -> None:
    family = case.split("-", maxsplit=1)[0]
    hf = tiny_model(family, seed=2)
    folder = save(hf, tmp_path, **({"max_shard_size": "20KB"} if case.endswith("sharded") else {}))
    if case.endswith("sharded"):
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 3
    cfg, sd = load_hf_folder(folder, dtype="fp32")
    assert cfg == config_from_hf(hf.config.to_dict()) == read_hf_config(folder)
    assert (cfg.attention_bias, cfg.tie_word_embeddings) == (family == "qwen2", family == "qwen2")
    assert cfg.rope_scaling == (LLAMA3_SCALING if family == "llama" else None)
    assert (cfg.eos_token_id, cfg.name) == (2, folder.name)
    assert all(t.dtype == torch.float32 for t in sd.values())
    ours = Transformer(cfg, sd)
    x = toks(2, 24, seed=3)
    with torch.no_grad():
        ref = hf(x).logits.float()
    got = ours(x, None, ours.new_cache(2, 24))
    assert ref.abs().max() > 1.0
    assert (got - ref).abs().max().item() < FP32_HF_TOL
    assert Tokenizer.from_hf_folder(folder).vocab_size == V


def test_load_converts_dtype(llama_folder: Path) -> None:
    _, sd = load_hf_folder(llama_folder)  # bf16 by default
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    _, sd16 = load_hf_folder(llama_folder, dtype=torch.float16, device=torch.device("cpu"))
    assert {t.dtype for t in sd16.values()} == {torch.float16}


def _break(folder: Path, how: str) -> None:
    index = folder / "model.safetensors.index.json"
    shards = sorted(folder.glob("model-*.safetensors"))
    if how == "no-config":
        (folder / "config.json").unlink()
    elif how == "bad-json":
        (folder / "config.json").write_text("{not json")
    elif how == "unknown-arch":
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(architectures=["FalconForCausalLM"], model_type="falcon")
        (folder / "config.json").write_text(json.dumps(cfg))
    elif how == "missing-shard":
        shards[1].unlink()
    elif how == "truncated-shard":
        shards[0].write_bytes(shards[0].read_bytes()[:100])
    elif how == "index-mismatch":
        data = json.loads(index.read_text())
        data["weight_map"]["model.extra.weight"] = shards[0].name
        index.write_text(json.dumps(data))
    elif how in ("bin-only", "no-weights"):
        for f in [index, folder / "model.safetensors", *shards]:
            f.unlink(missing_ok=True)
        if how == "bin-only":
            (folder / "pytorch_model.bin").write_bytes(b"pickle")


@pytest.mark.parametrize(
    ("how", "error", "words"),
    [
        ("no-config", ModelLoadError, ["config.json", "Hugging Face model folder"]),
        ("bad-json", ModelLoadError, ["config.json", "re-download"]),
        ("unknown-arch", UnsupportedModelError, ["FalconForCausalLM", "HFCausalLMAdapter"]),
        ("missing-shard", ModelLoadError, ["model-00002-of", "missing", "download"]),
        ("truncated-shard", ModelLoadError, ["model-00001-of", "truncated"]),
        ("index-mismatch", ModelLoadError, ["model.extra.weight", "index"]),
        ("bin-only", ModelLoadError, ["pickle", "save_pretrained", "safe_serialization=True"]),
        ("no-weights", ModelLoadError, ["model.safetensors"]),
    ],
)
def test_bad_folders_raise_typed_errors(
    how: str, error: type[Exception], words: list[str], tmp_path: Path, llama_folder: Path
) -> None:
    folder = tmp_path / "model"
    if how in ("missing-shard", "truncated-shard", "index-mismatch", "bin-only", "no-weights"):
        save(tiny_model("llama"), folder, max_shard_size="20KB")
    else:
        shutil.copytree(llama_folder, folder)
    _break(folder, how)
    with pytest.raises(error) as info:
        load_hf_folder(folder)
    message = str(info.value)
    assert str(folder) in message or "config.json" in message
    for word in words:
        assert word in message


def test_foreign_tensors_in_a_single_file(tmp_path: Path, llama_folder: Path) -> None:
    shutil.copytree(llama_folder, tmp_path / "m")
    _, sd = load_hf_folder(tmp_path / "m", dtype="fp32")
    save_file({**sd, "step": torch.tensor([3])}, tmp_path / "m" / "model.safetensors")
    _, again = load_hf_folder(tmp_path / "m", dtype="bf16")
    assert again["step"].dtype == torch.int64  # only floating-point tensors are converted


# ------------------------------------------------------------------------------------ the adapter


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding through the runtime interface (Transformer or adapter)."""
    cache = model.new_cache(1, len(prompt) + n)
    slot = cache.add_sequence()
    logits = model(torch.tensor([prompt]), None, cache, slots=[slot], logits_at=torch.tensor([[len(prompt) - 1]]))
    out: list[int] = []
    while True:
        out.append(int(logits[0, -1].argmax()))
        if len(out) == n:
            return out
        logits = model(torch.tensor([[out[-1]]]), cache.next_positions(1), cache)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_adapter_greedy_equals_generate(family: str) -> None:
    hf = tiny_model(family, seed=4)
    adapter = adapt(hf)
    prompt = toks(1, 7, seed=5)[0].tolist()
    n = 25
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
    assert greedy(adapter, prompt, n) == ref
    assert adapter.dtype == torch.float32 and adapter.device == torch.device("cpu")


def test_adapter_config() -> None:
    gpt2 = adapt(tiny_model("gpt2")).config
    assert (gpt2.architecture, gpt2.vocab_size, gpt2.num_layers, gpt2.hidden_size) == ("gpt2", V, 2, 64)
    assert (gpt2.num_heads, gpt2.head_dim, gpt2.max_position, gpt2.tie_word_embeddings) == (4, 16, 256, True)
    assert (gpt2.intermediate_size, gpt2.bos_token_id, gpt2.eos_token_id) == (256, 1, 2)
    llama = tiny_model("llama")
    assert adapt(llama).config == config_from_hf(llama.config.to_dict())


def test_adapter_from_folder_matches_runtime(llama_folder: Path) -> None:
    adapter = load_adapter(llama_folder)
    ours = Transformer(*load_hf_folder(llama_folder, dtype="fp32"))
    x = toks(1, 16, seed=6)
    cache = adapter.new_cache(1, 16)
    cache.add_sequence()
    out = adapter.forward_with_hidden(x, None, cache)
    ref = ours.forward_with_hidden(x, None, ours.new_cache(1, 16))
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 16, V)
    assert (out.logits - ref.logits).abs().max().item() < FP32_HF_TOL
    assert (out.hidden - ref.hidden).abs().max().item() < FP32_HF_TOL
    assert adapter.config == ours.config and adapter.weight_bytes() > 0


def _fresh(adapter: HFCausalLMAdapter, prefix: Tensor, max_len: int = 40) -> Any:
    cache = adapter.new_cache(1, max_len)
    cache.add_sequence()
    adapter(prefix, None, cache)
    return cache


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_adapter_rollback_then_reextend_equals_never_extending(family: str) -> None:
    adapter = adapt(tiny_model(family, seed=7))
    x = toks(1, 20, seed=8)
    prompt, draft, other = x[:, :8], x[:, 8:13], x[:, 13:17]
    cache = _fresh(adapter, prompt)
    adapter(draft, cache.next_positions(5), cache, num_new=[5])
    assert cache.lengths.tolist() == [13] and cache.step_start.tolist() == [8]
    cache.keep_step_prefix([2])  # accept 2 of 5
    assert cache.lengths.tolist() == [10] and cache.dynamic.get_seq_length() == 10
    got = adapter(other, None, cache)
    ref = adapter(other, None, _fresh(adapter, torch.cat([prompt, draft[:, :2]], 1)))
    assert (got - ref).abs().max().item() < SELF_TOL
    cache.truncate(torch.tensor([9]))  # absolute length, as a device tensor
    cache.truncate([30])  # lengths only shrink
    assert cache.lengths.tolist() == [9]
    got = adapter(other, None, cache)
    ref = adapter(other, None, _fresh(adapter, x[:, :9]))
    assert (got - ref).abs().max().item() < SELF_TOL
    cache.truncate([0])
    assert (adapter(x[:, :5], None, cache) - adapter(x[:, :5], None, _fresh(adapter, x[:, :0]))).abs().max() == 0


def test_adapter_k_token_pass_equals_single_token_passes() -> None:
    adapter = adapt(tiny_model("gpt2", seed=9))
    x = toks(1, 15, seed=10)
    k = 6
    one = _fresh(adapter, x[:, :9])
    chunk = adapter(x[:, 9:], one.next_positions(k), one)
    step = _fresh(adapter, x[:, :9])
    singles = torch.cat([adapter(x[:, 9 + i : 10 + i], None, step) for i in range(k)], dim=1)
    assert chunk.shape == singles.shape == (1, k, V)
    assert (chunk - singles).abs().max().item() < SELF_TOL


def test_adapter_padding_and_logits_at() -> None:
    adapter = adapt(tiny_model("gpt2", seed=11))
    x = toks(1, 10, seed=12)
    cache = _fresh(adapter, x[:, :4])
    padded = torch.cat([x[:, 4:7], torch.full((1, 2), -1)], dim=1)  # 3 real tokens, 2 padding
    got = adapter(padded, None, cache, num_new=torch.tensor([3]), logits_at=torch.tensor([[2, 0]]))
    assert cache.lengths.tolist() == [7] and got.shape == (1, 2, V)
    ref = adapter(x[:, 4:7], None, _fresh(adapter, x[:, :4]))
    assert (got[0, 0] - ref[0, 2]).abs().max() < SELF_TOL and (got[0, 1] - ref[0, 0]).abs().max() < SELF_TOL
    # The gather path (the LM head over every row, then logits_at) agrees with logits_to_keep.
    cache.truncate([4])
    both = adapter.forward_with_hidden(padded, None, cache, num_new=[3], logits_at=torch.tensor([[2, 0]]))
    assert (both.logits - got).abs().max() < SELF_TOL and both.hidden.shape == (1, 5, 64)
    assert both.hidden[0, 3:].abs().max() == 0  # padding rows


def test_adapter_serves_one_sequence_and_no_trees() -> None:
    adapter = adapt(tiny_model("gpt2"))
    cache = _fresh(adapter, toks(1, 4))
    with pytest.raises(ConfigError, match="one sequence"):
        adapter(toks(2, 3), None, cache)
    with pytest.raises(ConfigError, match="one sequence"):
        adapter.new_cache(2, 16)
    with pytest.raises(ConfigError, match="one sequence"):
        adapter(toks(1, 3), None, cache, slots=[1])
    with pytest.raises(ConfigError, match="tree"):
        adapter(toks(1, 3), None, cache, torch.ones(1, 3, 3, dtype=torch.bool))
    with pytest.raises(ConfigError, match="chains only"):
        adapter(toks(1, 3), torch.tensor([[4, 5, 5]]), cache)
    with pytest.raises(ConfigError, match="trees"):
        cache.compact(0, torch.tensor([0, 1]))
    with pytest.raises(InputError, match="in use"):
        cache.add_sequence()
    with pytest.raises(InputError, match="max_len"):
        adapter(toks(1, 40), None, cache)
    assert cache.lengths.tolist() == [4]  # failed calls changed nothing
    cache.remove_sequence(0)
    assert cache.active_slots == [] and cache.add_sequence() == 0 and cache.lengths.tolist() == [0]
    with pytest.raises(ConfigError, match="training mode"):
        adapt(tiny_model("gpt2").train())


def test_adapter_from_bad_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_folder: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_adapter(tmp_path)
    shutil.copytree(llama_folder, tmp_path / "bin")
    _break(tmp_path / "bin", "bin-only")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_adapter(tmp_path / "bin")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if transformers were not installed
    with pytest.raises(ModelLoadError, match="pip install"):
        load_adapter(llama_folder)
