"""load_model / load_pair on tiny models: prepared (bf16 from safetensors, fp32 from the GGUF), a
direct .gguf path, a prepared folder path, a Hugging Face folder (through a stand-in hf module), and
the errors that tell the user what to do."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from tests.unit.fake_parts import FakeModel, install_fake_model
from tests.unit.tiny_gguf import TinySpec
from verispec.errors import ConfigError, IncompatibleModelsError, ModelLoadError
from verispec.formats import registry
from verispec.formats.convert import save_tokenizer
from verispec.formats.gguf import load_gguf
from verispec.formats.loader import LoadedModel, bf16_kernel_usable, load_model, load_pair
from verispec.formats.tokenizer import Tokenizer
from verispec.models.transformer import Transformer


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    fake = install_fake_model(tmp_path, monkeypatch)
    registry.prepare(fake.name)
    return fake


def logits(m: LoadedModel | Transformer, ids: list[int]) -> torch.Tensor:
    model = m.model if isinstance(m, LoadedModel) else m
    return model(torch.tensor([ids]), None, model.new_cache(1, 32))


def bf16_source(fake: FakeModel) -> Path:
    """Where a prepared model's bf16 projections come from: the kernel's layout, packed once into
    bf16-packed.safetensors, where bf16 runs on the kernels; else bf16.safetensors as it is."""
    return fake.folder / ("bf16-packed.safetensors" if bf16_kernel_usable() else "bf16.safetensors")


def test_prepared_bf16_loads_the_safetensors_exactly(fake: FakeModel) -> None:
    loaded = load_model(fake.name)
    assert loaded.name == fake.name and loaded.dtype == torch.bfloat16
    assert loaded.source == bf16_source(fake) and loaded.load_seconds > 0
    config, state = load_gguf(fake.gguf, torch.bfloat16)
    assert loaded.config == config
    assert loaded.logits_width == config.vocab_size and loaded.vocab_size == config.vocab_size - 1
    reference = Transformer(config, state, dtype=torch.bfloat16)
    for name, linear in loaded.model.linears().items():  # the same weights, packed for the kernel or not
        expected = reference.lm_weight.float() if name == "lm_head" else reference.get_submodule(name).dequantize()
        assert torch.equal(linear.dequantize(), expected), name
    if bf16_kernel_usable():  # then the loader moved the model onto the kernels
        assert {m.kind for m in loaded.model.linears().values()} == {"bf16"}
        assert loaded.model.cpu_kernels == (config.head_dim % 32 == 0)  # the row kernels' head sizes
        reference = Transformer(config, state, dtype=torch.bfloat16, cpu_kernels=True)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    ids = loaded.tokenizer.encode("the def 1 in")
    assert ids == Tokenizer.from_gguf(fake.gguf).encode("the def 1 in")
    assert torch.equal(logits(loaded, ids), logits(reference, ids))


def test_prepared_fp32_dequantises_the_gguf(fake: FakeModel) -> None:
    stages: list[tuple[str, int, int]] = []
    loaded = load_model(fake.name, dtype="fp32", progress=lambda *a: stages.append(a))
    assert loaded.dtype == torch.float32 and loaded.source == fake.folder / "model.gguf"
    assert stages and stages[-1][0] == "load" and stages[-1][1] == stages[-1][2]
    config, state = load_gguf(fake.gguf, torch.float32)
    for name, tensor in Transformer(config, state).state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


def test_direct_gguf_and_prepared_folder_paths(fake: FakeModel) -> None:
    direct = load_model(fake.gguf, dtype="fp32")
    assert direct.name == fake.gguf.stem and direct.source == fake.gguf
    assert direct.vocab_size == direct.logits_width - 1
    by_folder = load_model(str(fake.folder))
    assert by_folder.name == fake.name and by_folder.source == bf16_source(fake)
    ids = direct.tokenizer.encode("hello the world")
    assert torch.equal(logits(load_model(fake.gguf), ids), logits(by_folder, ids))


def test_not_prepared_says_how_to_prepare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_model(tmp_path, monkeypatch, name="tiny-unprepared")
    with pytest.raises(ModelLoadError, match="run `verispec models prepare tiny-unprepared`"):
        load_model(fake.name)
    registry.prepare(fake.name)
    (fake.folder / "prepared.json").unlink()  # interrupted
    with pytest.raises(ModelLoadError, match="is not prepared"):
        load_model(fake.name)
    (fake.folder / "prepared.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="incomplete prepared model"):
        load_model(fake.folder)


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a known model"):
        load_model(tmp_path / "nothing.gguf")
    with pytest.raises(ModelLoadError, match="neither a prepared verispec model"):
        load_model(tmp_path)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "junk.gguf")
    with pytest.raises(ConfigError, match="dtype must be one of fp32, bf16, int8, int4"):
        load_model(tmp_path, dtype="fp16")  # type: ignore[arg-type]


def test_damaged_prepared_files(fake: FakeModel) -> None:
    config = fake.folder / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps(data | {"format": "other/9"}).ljust(config.stat().st_size))
    with pytest.raises(ModelLoadError, match="--force"):
        load_model(fake.name)


def test_hugging_face_folder_goes_through_hf_module(
    fake: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    save_tokenizer(Tokenizer.from_gguf(fake.gguf), folder)
    calls = []

    def load_hf_folder(path: Path, dtype: torch.dtype, device: str) -> tuple[object, dict[str, torch.Tensor]]:
        calls.append((Path(path), dtype, device))
        return load_gguf(fake.gguf, dtype)

    monkeypatch.setitem(sys.modules, "verispec.formats.hf", types.SimpleNamespace(load_hf_folder=load_hf_folder))
    loaded = load_model(folder, dtype="fp32")
    assert calls == [(folder, torch.float32, "cpu")]
    assert loaded.name == "hf-model" and loaded.source == folder and loaded.dtype == torch.float32
    assert loaded.vocab_size == loaded.tokenizer.vocab_size == loaded.logits_width  # HF: no GGUF types


def test_load_pair_checks_compatibility(fake: FakeModel, tmp_path: Path) -> None:
    target, draft = load_pair(fake.gguf, fake.name)
    assert target.vocab_size == draft.vocab_size
    from tests.unit.tiny_gguf import write_tiny

    other = tmp_path / "other.gguf"
    start = Tokenizer.from_gguf(fake.gguf).token_to_id("<|im_start|>")
    write_tiny(other, TinySpec(metadata={"tokenizer.ggml.eot_token_id": start}))  # one more stop id
    with pytest.raises(IncompatibleModelsError, match="stop ids"):
        load_pair(fake.gguf, other)


def test_the_draft_precision_defaults_to_int8_where_the_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.formats import loader

    monkeypatch.setattr(loader, "bf16_kernel_usable", lambda: True)
    assert loader.default_draft_dtype("bf16", "cpu") == "int8"
    assert loader.default_draft_dtype("int4", "cpu") == "int8"
    assert loader.default_draft_dtype("fp32", "cpu") == "fp32"  # the exact reference stays exact
    assert loader.default_draft_dtype("bf16", "cuda") == "bf16"
    monkeypatch.setattr(loader, "bf16_kernel_usable", lambda: False)
    assert loader.default_draft_dtype("bf16", "cpu") == "bf16"


def test_a_kv_cache_larger_than_the_machine_is_refused_before_weights_load(tmp_path: Path) -> None:
    import json as _json

    from verispec.formats.loader import peek_config
    from verispec.models.kv_cache import check_cache_fits

    folder = tmp_path / "hf"
    folder.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    }  # fmt: skip
    (folder / "config.json").write_text(_json.dumps(config))  # no weights at all: nothing is loaded
    seen = peek_config(folder)
    assert seen is not None and seen.num_layers == 2
    check_cache_fits(seen, 8, 4096, torch.bfloat16, "cpu")  # 2 layers: a few MB
    with pytest.raises(ConfigError, match="more than this machine's"):
        check_cache_fits(seen, 4096, 1 << 24, torch.float32, "cpu")  # 2 TB
    assert peek_config(tmp_path / "nothing") is None
