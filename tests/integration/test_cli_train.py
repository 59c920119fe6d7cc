"""``verispec train data`` / ``train medusa`` / ``train eagle``, ``generate --drafter medusa|eagle``
and ``models list`` showing what was trained, end to end on tiny GGUF models written in the test
(no downloads)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.cli import main


def run(*argv: str) -> int:
    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as patch:  # (the trained files are recorded under VERISPEC_HOME)
        patch.setenv("VERISPEC_HOME", str(root / "home"))
        yield _train(root)


def _train(root: Path) -> dict[str, Path]:
    target, other = root / "target.gguf", root / "other.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(other, TinySpec(seed=5))
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(f"hello {i} world {i * 7}" for i in range(12)) + "\n")
    data, heads = root / "data", root / "heads.safetensors"
    common = ["--target", str(target), "--dtype", "fp32"]
    assert run("train", "data", *common, "--drafter", "none", "--prompts", str(prompts), "--num-prompts", "12",
               "--max-tokens", "12", "--out", str(data)) == 0  # fmt: skip
    assert run("train", "medusa", *common, "--data", str(data), "--heads", "2", "--head-size", "200", "--epochs", "2",
               "--batch", "16", "--out", str(heads)) == 0  # fmt: skip
    draft = root / "draft.gguf"
    write_tiny(draft, TinySpec(seed=2))
    distilled = root / "distilled"
    assert run("train", "distill", *common, "--draft", str(draft), "--data", str(data), "--head-size", "200",
               "--rank", "4", "--batch", "64", "--out", str(distilled)) == 0  # fmt: skip
    eagle = root / "eagle.safetensors"
    assert run("train", "eagle", *common, "--data", str(data), "--head-size", "200", "--epochs", "2",
               "--batch", "64", "--out", str(eagle)) == 0  # fmt: skip
    return {
        "target": target, "other": other, "data": data, "heads": heads, "eagle": eagle, "prompts": prompts,
        "draft": draft, "distilled": distilled,
    }  # fmt: skip


def test_train_writes_data_and_heads(trained: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads((trained["data"] / "manifest.json").read_text())
    assert len(manifest["sequences"]) == 12 and manifest["sampling"]["temperature"] == 0.0
    assert any(p.suffix == ".safetensors" for p in trained["data"].iterdir())
    assert trained["heads"].is_file() and trained["eagle"].is_file()


def test_models_list_shows_the_trained_drafters(trained: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert run("models", "list", "--json") == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    heads, eagle = listed[str(trained["heads"].resolve())], listed[str(trained["eagle"].resolve())]
    assert heads["role"] == "medusa heads" and eagle["role"] == "eagle head" and eagle["state"] == "trained"
    assert eagle["base"] == heads["base"] and "held-out chain AL" in eagle["summary"] and eagle["disk_bytes"] > 0
    distilled = listed[str(trained["distilled"].resolve())]
    assert distilled["role"] == "distilled draft" and "acceptance" in distilled["summary"]
    assert run("models", "list") == 0
    assert "eagle head" in capsys.readouterr().out


def test_a_distilled_draft_loads_like_any_other(
    trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from verispec.formats.loader import load_model
    from verispec.train.distill import read_manifest

    manifest = read_manifest(trained["distilled"])
    assert manifest is not None and manifest["objective"] == "fkl" and manifest["heldout"]["positions"] > 0
    loaded = load_model(trained["distilled"], dtype="fp32")
    base = load_model(trained["draft"], dtype="fp32")
    assert loaded.tokenizer.encode("hello 3 <|im_end|>") == base.tokenizer.encode("hello 3 <|im_end|>")
    assert loaded.tokenizer.eos_token_ids == base.tokenizer.eos_token_ids
    assert loaded.vocab_size == base.vocab_size  # (the GGUF's padding placeholders are not real tokens)
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    base_args = ["generate", "hello 3 world", "--target", str(trained["target"]), "--dtype", "fp32", "--max-tokens",
                 "12", "--json"]  # fmt: skip
    assert run(*base_args, "--drafter", "none") == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert run(*base_args, "--draft", str(trained["distilled"]), "--draft-dtype", "fp32", "--k", "3") == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain
    assert run("train", "distill", "--target", str(trained["target"]), "--dtype", "fp32", "--draft",
               str(trained["draft"]), "--data", str(trained["data"]), "--out", str(trained["data"])) == 2  # fmt: skip
    assert "not a distilled draft" in capsys.readouterr().err


def test_generate_with_medusa_heads_equals_plain(
    trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))  # (--tree auto measures the target's pass costs)
    base = [
        "generate",
        "hello 3 world",
        "--target",
        str(trained["target"]),
        "--dtype",
        "fp32",
        "--max-tokens",
        "16",
        "--json",
    ]
    assert run(*base, "--drafter", "medusa", "--heads", str(trained["heads"]), "--k", "2") == 0
    spec = json.loads(capsys.readouterr().out)
    assert run(*base, "--drafter", "none") == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == spec["token_ids"]
    assert spec["spec"]["num_drafts"] > 0
    for shape in ("[[0],[1],[0,0]]", "auto"):
        assert run(*base, "--drafter", "medusa", "--heads", str(trained["heads"]), "--tree", shape) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == spec["token_ids"]
    typical = ["--drafter", "medusa", "--heads", str(trained["heads"]), "--rule", "typical", "--allow-lossy"]
    assert run(*base, *typical, "--temperature", "0.7", "--seed", "1") == 0  # Medusa's default rule: lossy, and says so
    assert json.loads(capsys.readouterr().out)["lossless"] is False
    eagle = ["--drafter", "eagle", "--heads", str(trained["eagle"])]
    for extra in (["--k", "3"], ["--tree", "3,2,2,6"]):
        assert run(*base, *eagle, *extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["token_ids"] == spec["token_ids"] and out["spec"]["num_drafts"] > 0
    # K from measured costs: whether drafting pays depends on this CPU's timings, so only the output is checked
    assert run(*base, *eagle) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == spec["token_ids"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--drafter", "medusa"], "needs --heads"),
        (["generate", "hi", "--heads", "x.safetensors"], "add --drafter medusa"),
        (["generate", "hi", "--drafter", "medusa", "--heads", "/no/such/heads"], "is not a file"),
        (["generate", "hi", "--drafter", "medusa", "--heads", "HEADS", "--tree", "4,2,2"], "static"),
        (["generate", "hi", "--drafter", "medusa", "--heads", "HEADS", "--rule", "specinfer"], "verifies sampled"),
        (["train", "medusa", "--data", "/no/such/folder", "--out", "h"], "not a folder"),
        (["train", "medusa", "--data", "DATA", "--heads", "0", "--out", "h"], "--heads"),
        (["train", "data", "--prompts", "nope", "--out", "d"], "neither a prompt set"),
        (["generate", "hi", "--drafter", "eagle"], "verispec train eagle"),
        (["generate", "hi", "--drafter", "eagle", "--heads", "EAGLE", "--tree", "auto"], "dynamically"),
        (["generate", "hi", "--drafter", "eagle", "--heads", "HEADS"], "not an EAGLE head"),
        (["generate", "hi", "--drafter", "medusa", "--heads", "EAGLE"], "not a verispec Medusa"),
        (["train", "eagle", "--data", "DATA", "--unroll", "9", "--out", "h"], "--unroll"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    trained: dict[str, Path], args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    names = {"HEADS": "heads", "DATA": "data", "EAGLE": "eagle"}
    args = [str(trained[names[a]]) if a in names else a for a in args]
    target = ["--target", str(trained["target"]), "--dtype", "fp32"]
    assert run(*args, *target) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_heads_of_another_target_are_refused(trained: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "hi", "--target", str(trained["other"]), "--dtype", "fp32", "--drafter", "medusa"]
    assert run(*args, "--heads", str(trained["heads"])) == 2
    assert "trained for" in capsys.readouterr().err
    train = ["train", "medusa", "--target", str(trained["other"]), "--dtype", "fp32", "--data", str(trained["data"])]
    assert run(*train, "--out", str(trained["data"].parent / "h2.safetensors")) == 2
    assert "was made with" in capsys.readouterr().err


def test_the_heads_score_the_ids_they_were_trained_on(trained: dict[str, Path]) -> None:
    from verispec.pipeline import build

    pipe = build(trained["target"], None, drafter="medusa", heads=trained["heads"], dtype="fp32", k=2, max_batch=1)
    assert pipe.engine.drafter.ids.numel() == 200  # type: ignore[attr-defined]  (--head-size 200, not the vocabulary)
    pipe = build(trained["target"], None, drafter="medusa", heads=trained["heads"], dtype="fp32", k=2, draft_head=50)
    assert pipe.engine.drafter.ids.numel() == 50  # type: ignore[attr-defined]
