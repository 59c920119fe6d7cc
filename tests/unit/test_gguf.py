"""The GGUF loader on tiny files written with gguf.GGUFWriter: config, tensors, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGUFReader
from gguf import quants as gq

from tests.unit.tiny_gguf import TinySpec, gguf_name, stored, write_tiny
from verispec.errors import InputError, ModelLoadError, UnsupportedModelError
from verispec.formats.gguf import GGUFModel, load_gguf, read_config
from verispec.formats.gguf_file import GGUFFile
from verispec.models.config import ModelConfig, RopeScaling


def make(tmp_path: Path, **kw: object) -> tuple[Path, dict[str, np.ndarray], TinySpec]:
    spec = TinySpec(**kw)  # type: ignore[arg-type]
    path = tmp_path / f"{spec.arch}.gguf"
    return path, write_tiny(path, spec), spec


def expected(weights: dict[str, np.ndarray], name: str, type_name: str) -> np.ndarray:
    """What dequantising ``name`` stored as ``type_name`` must give (gguf's reference)."""
    from gguf import GGMLQuantizationType

    value = weights[name]
    if type_name == "F32":
        return value
    if type_name == "F16":
        return value.astype(np.float16).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    return gq.dequantize(gq.quantize(value, qtype), qtype)


# --- config -----------------------------------------------------------------------------------


def test_qwen2_config_round_trips(tmp_path: Path) -> None:
    path, _, spec = make(tmp_path, arch="qwen2")
    cfg = read_config(path)
    assert cfg == ModelConfig(
        architecture="qwen2",
        vocab_size=spec.vocab,
        hidden_size=64,
        intermediate_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position=512,
        tie_word_embeddings=False,
        attention_bias=True,
        rope_scaling=None,
        bos_token_id=spec.vocab - 5,
        eos_token_id=spec.vocab - 3,
        pad_token_id=spec.vocab - 5,
    )
    assert cfg.rms_norm_eps == pytest.approx(1e-6) and cfg.num_kv_groups == 2 and cfg.name == "tiny"


def test_llama_tied_config_and_rope_scaling(tmp_path: Path) -> None:
    meta = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 128,
        "llama.rope.scaling.finetuned": True,
        "llama.rope.freq_base": None,
        "llama.attention.key_length": 16,
    }
    path, _, _ = make(tmp_path, arch="llama", tied=True, metadata=meta)
    cfg = read_config(path)
    assert cfg.architecture == "llama" and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 10000.0  # llama.cpp's default when the key is absent
    assert cfg.rope_scaling == RopeScaling("linear", 4.0, 128, (("finetuned", True),))
    assert "lm_head.weight" not in GGUFModel(path).tensor_names


# --- tensors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["F32", "F16", "Q8_0", "Q5_0", "Q4_0"])
def test_tensors_round_trip(tmp_path: Path, type_name: str) -> None:
    path, weights, _ = make(tmp_path, types={"*": type_name})
    model = GGUFModel(path)
    assert set(model.tensor_names) == set(weights)
    for name in weights:
        info = model.tensor_info(name)
        assert info.shape == weights[name].shape and info.gguf_name == gguf_name(name)
        want = expected(weights, name, info.type_name)
        got = model.load(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
        assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32)), name


def test_k_quant_tensors_equal_reference(tmp_path: Path) -> None:
    down = "model.layers.0.mlp.down_proj.weight"  # 256 columns: one K-quant super-block per row
    for type_name in ("Q4_K", "Q5_K", "Q6_K"):
        path, _, _ = make(tmp_path, types={down: type_name})
        model = GGUFModel(path)
        raw = GGUFReader(path).get_tensor([t.name for t in GGUFReader(path).tensors].index(gguf_name(down)))
        want = gq.dequantize(raw.data, raw.tensor_type)
        assert model.tensor_info(down).type_name == type_name
        assert np.array_equal(model.load(down).numpy().view(np.uint32), want.view(np.uint32))


def test_state_dict_dtype_and_progress(tmp_path: Path) -> None:
    path, weights, _ = make(tmp_path, types={"*": "Q8_0"})
    seen: list[tuple[str, int, int]] = []
    sd = GGUFModel(path).state_dict(torch.bfloat16, progress=lambda n, i, t: seen.append((n, i, t)))
    assert set(sd) == set(weights) and all(t.dtype == torch.bfloat16 for t in sd.values())
    assert [i for _, i, _ in seen] == list(range(1, len(weights) + 1))
    model = GGUFModel(path)
    assert all(torch.equal(sd[n], model.load(n).to(torch.bfloat16)) for n in sd)
    cfg, sd2 = load_gguf(path, torch.float16)
    assert cfg == model.config and sd2.keys() == sd.keys() and sd2["model.norm.weight"].dtype == torch.float16


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_llama_qk_rows_are_unpermuted(tmp_path: Path, type_name: str) -> None:
    path, weights, spec = make(tmp_path, arch="llama", types={"*": type_name})
    model = GGUFModel(path)
    for i in range(spec.layers):
        for proj, heads in (("q_proj", spec.heads), ("k_proj", spec.kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert model.tensor_info(name).rope_heads == heads
            want = expected(weights, name, type_name)  # HF layout: the writer permuted, we undid it
            assert np.array_equal(model.load(name).numpy(), want)
            # Sanity: the file itself holds the permuted rows.
            raw_rows = GGUFFile(path).data(gguf_name(name))
            assert not np.array_equal(raw_rows, stored(weights[name], type_name, np.random.default_rng()))
    assert model.tensor_info("model.layers.0.self_attn.v_proj.weight").rope_heads == 0


def test_qwen2_rows_are_not_permuted(tmp_path: Path) -> None:
    path, weights, _ = make(tmp_path, arch="qwen2")
    model = GGUFModel(path)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias"):
        assert model.tensor_info(name).rope_heads == 0
        assert np.array_equal(model.load(name).numpy(), weights[name])


def test_quantized_blocks(tmp_path: Path) -> None:
    down = "model.layers.1.mlp.down_proj.weight"
    path, weights, _ = make(tmp_path, arch="llama", types={"*": "Q8_0", down: "Q6_K"})
    model = GGUFModel(path)
    q = model.quantized(down)
    assert (q.type_name, q.shape, q.block_size, q.type_size) == ("Q6_K", (64, 256), 256, 210)
    assert q.blocks.dtype == np.uint8 and q.blocks.shape == (64, 210)
    assert np.array_equal(q.blocks, GGUFFile(path).data(gguf_name(down)))
    assert np.array_equal(gq.dequantize(q.blocks, gq.GGMLQuantizationType.Q6_K), model.load(down).numpy())
    # llama k_proj: raw block rows come back in HF order, i.e. quantise(HF weight) row for row.
    k = "model.layers.0.self_attn.k_proj.weight"
    qk = model.quantized(k)
    assert np.array_equal(qk.blocks, gq.quantize(weights[k], gq.GGMLQuantizationType.Q8_0))
    assert not np.array_equal(qk.blocks, GGUFFile(path).data(gguf_name(k)))
    with pytest.raises(InputError, match="not a quantised matrix"):
        model.quantized("model.norm.weight")
    with pytest.raises(InputError, match="tensor_names"):
        model.load("model.layers.9.mlp.up_proj.weight")


# --- the container reader agrees with gguf.GGUFReader -----------------------------------------


def test_file_reader_matches_gguf_reader(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, types={"*": "Q8_0"}, metadata={"test.flag": True, "test.str": "ünï 😀"})
    ours, ref = GGUFFile(path), GGUFReader(path)
    assert ours.data_offset == ref.data_offset
    keys = {k for k in ref.fields if not k.startswith("GGUF.")}
    assert set(ours.metadata) == keys
    for key in keys:
        value = ours.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == ref.fields[key].contents(), key
    for t in ref.tensors:
        entry = ours.tensors[t.name]
        assert (entry.type_name, entry.shape, entry.nbytes) == (
            t.tensor_type.name,
            tuple(t.shape[::-1]),
            t.n_bytes,
        )
        assert np.array_equal(ours.data(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8))


def test_reader_without_strings_steps_over_string_arrays(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, types={"*": "Q8_0"}, metadata={"test.str": "kept"})
    full, light = GGUFFile(path), GGUFFile(path, strings=False)
    arrays = {k for k, v in full.metadata.items() if isinstance(v, list)}
    assert "tokenizer.ggml.tokens" in arrays and "tokenizer.ggml.merges" in arrays
    assert set(light.metadata) == set(full.metadata) - arrays and light.metadata["test.str"] == "kept"
    assert light.tensors == full.tensors and light.data_offset == full.data_offset


# --- errors -----------------------------------------------------------------------------------


def test_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        GGUFModel(tmp_path / "absent.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFModel(junk)


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated_file(tmp_path: Path, keep: float) -> None:
    path, _, _ = make(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFModel(cut)


def test_truncated_header(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:2000])  # inside the vocabulary array
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(cut)
    with pytest.raises(ModelLoadError, match="truncated"):  # stepping over it sees the cut too
        GGUFFile(cut, strings=False)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, arch="gpt2")
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama, qwen2"):
        GGUFModel(path)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K"])
def test_unsupported_tensor_type(tmp_path: Path, type_name: str) -> None:
    down = "model.layers.0.mlp.down_proj.weight"
    path, _, _ = make(tmp_path, types={down: type_name})
    with pytest.raises(UnsupportedModelError, match=type_name) as info:
        GGUFModel(path)
    assert "Q4_K" in str(info.value) and "blk.0.ffn_down.weight" in str(info.value)


def test_big_endian_is_refused(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, big_endian=True, tokenizer=False)
    with pytest.raises(UnsupportedModelError, match="big-endian"):
        GGUFModel(path)


def test_missing_metadata_and_tensors(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, metadata={"qwen2.block_count": None})
    with pytest.raises(ModelLoadError, match=r"qwen2\.block_count"):
        GGUFModel(path)
    path, _, _ = make(tmp_path, skip_tensors=("model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        GGUFModel(path)


def test_inconsistent_shapes_and_unknown_tensors(tmp_path: Path) -> None:
    path, _, _ = make(tmp_path, metadata={"qwen2.feed_forward_length": 128})
    with pytest.raises(ModelLoadError, match="implies"):
        GGUFModel(path)
    extra = {"blk.0.ffn_gate_exps.weight": (np.zeros((4, 32), np.float32), "F32")}
    path, _, _ = make(tmp_path, extra_tensors=extra)
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        GGUFModel(path)
    path, _, _ = make(tmp_path, metadata={"qwen2.attention.head_count_kv": 3})
    with pytest.raises(ModelLoadError, match="num_kv_heads"):
        GGUFModel(path)
