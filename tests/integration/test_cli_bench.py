"""`verispec bench` end to end on tiny GGUF models (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.cli import main


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    target, draft = root / "target.gguf", root / "draft.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(draft, TinySpec(seed=2))
    return target, draft


def test_bench_json_and_plot(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    plot = tmp_path / "acc.png"
    code = main(
        ["bench", "--target", str(target), "--draft", str(draft), "--sets", "summarize,chat", "--num-prompts", "2",
         "--max-tokens", "10", "--k", "3", "--dtype", "fp32", "--plot", str(plot), "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["set"] for s in out["sets"]] == ["summarize", "chat"]
    for s in out["sets"]:
        assert s["num_prompts"] == 2
        assert s["greedy_equal"] == 1.0  # greedy: speculation never changes the text
        assert s["speedup"] is not None and s["acceptance_rate"] >= 0
        assert 0.0 <= s["free_draft_share"] <= 1.0  # the composite (the default): its lookup's share of drafts
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_input(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target = pair[0]
    assert main(["bench", "--target", str(target), "--sets", "nope"]) == 2
    assert "unknown prompt set" in capsys.readouterr().err
    assert main(["bench", "--target", str(target), "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    assert "drafter other than none" in err and len(err.strip().splitlines()) == 1
