"""`verispec generate` end to end on tiny GGUF models written in the test (no downloads)."""

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


def test_typical_acceptance_is_labelled_lossy(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    base = ["generate", "hello", "--target", str(target), "--draft", str(draft), "--dtype", "fp32", "--k", "3"]
    assert main([*base, "--rule", "typical", "--allow-lossy", "--max-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lossless"] is False
    assert main([*base, "--rule", "typical", "--allow-lossy", "--max-tokens", "8"]) == 0
    assert "LOSSY" in capsys.readouterr().out


def test_generate_with_a_datastore(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = pair
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))  # the datastore's cache
    (tmp_path / "notes.txt").write_text("hello world, hello world, hello world\n" * 20)
    base = ["generate", "hello world", "--target", str(target), "--max-tokens", "12", "--dtype", "fp32", "--json"]
    assert main([*base, "--drafter", "retrieval", "--datastore", str(tmp_path), "--k", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*base, "--drafter", "none"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    assert len(list((tmp_path / "home" / "datastores").iterdir())) == 1


def test_generate_with_trees_planned_per_step(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path / "home"))  # the target's measured pass costs
    base = ["generate", "hello world", "--target", str(target), "--max-tokens", "16", "--dtype", "fp32"]
    assert main([*base, "--draft", str(draft), "--drafter", "tree", "--tree", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main([*base, "--drafter", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    assert out["spec"]["num_drafts"] > 0 and out["spec"]["rank_reached"]
    assert main([*base, "--draft", str(draft), "--drafter", "tree", "--tree", "auto"]) == 0
    assert "acceptance by child rank" in capsys.readouterr().out


@pytest.mark.parametrize("drafter", ["model", "ngram", "composite", "none"])
def test_generate_json(pair: tuple[Path, Path], drafter: str, capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    code = main(
        ["generate", "hello world", "--target", str(target), "--draft", str(draft), "--drafter", drafter,
         "--k", "3", "--max-tokens", "12", "--dtype", "fp32", "--json"]
    )  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 12 and out["finish_reason"] in ("stop", "length")
    assert set(out["spec"]) >= {"acceptance_rate", "mean_acceptance_length", "acceptance_per_position"}
    assert out["lossless"] is True
    assert 0 <= out["spec"]["num_free_drafts"] <= out["spec"]["num_drafts"]  # lookup drafts: the composite's only
    assert drafter == "composite" or out["spec"]["num_free_drafts"] == 0
    # spec on and spec off give the same greedy text
    plain_args = ["--drafter", "none", "--max-tokens", "12", "--dtype", "fp32", "--json"]
    code = main(["generate", "hello world", "--target", str(target), *plain_args])
    plain = json.loads(capsys.readouterr().out)
    assert plain["token_ids"] == out["token_ids"]


def test_the_report_puts_speculation_against_plain_decoding(
    pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With K chosen from measured costs, the report prices plain decoding at the policy's
    one-token step and sets the decode steps' tokens per second against it."""
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))  # (a calibration of its own)
    target, draft = pair
    args = ["generate", "hello world", "--target", str(target), "--draft", str(draft), "--drafter", "model",
            "--max-tokens", "16", "--dtype", "fp32"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["one_token_pass_s"] > 0 and out["decode_tokens_per_s"] > 0
    assert out["speedup_vs_plain"] == pytest.approx(out["decode_tokens_per_s"] * out["one_token_pass_s"])
    assert main(args) == 0
    assert "vs plain decoding" in capsys.readouterr().out


def test_the_report_shows_the_lookups_drafts_and_the_models_apart() -> None:
    from verispec.cli.generate import free_drafts_line
    from verispec.metrics import SpecStats

    stats = SpecStats()
    stats.observe(6, 6, free=True)
    stats.observe(3, 1)
    stats.observe(2, 2)
    line = free_drafts_line(stats.as_dict())
    assert line == "the lookup 1 of 3 drafts, 6/6 accepted (1.000); the model 2, 3/5 accepted (0.600)"


def test_generate_streams_text_then_stats(pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = pair
    code = main(["generate", "hi", "--target", str(target), "--draft", str(draft), "--max-tokens", "8", "--chat"])
    assert code == 0
    out = capsys.readouterr().out
    assert "acceptance rate" in out and "mean acceptance length" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--drafter", "nope"], "invalid choice"),
        (["--k", "-1"], "--k"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "100000"], "context"),
        (["--target", "/no/such/model.gguf"], "neither a known model"),
        (["--device", "tpu"], "unknown device"),
        (["--drafter", "tree", "--rule", "block"], "verifies chains"),
        (["--drafter", "tree", "--rule", "specinfer"], "verifies sampled children"),
        (["--drafter", "tree", "--tree", "4,2"], "DEPTH,EXPAND,BRANCH"),
        (["--tree", "4,2,2"], "add --drafter tree"),
        (["--drafter", "retrieval"], "needs --datastore"),
        (["--datastore", "."], "add --drafter retrieval"),
        (["--drafter", "retrieval", "--datastore", "/no/such/folder"], "does not exist"),
        (["--drafter", "retrieval", "--rule", "block"], "verifies chains"),
        (["--drafter", "tree", "--tree", "[[1]]"], "paths"),
        (["--drafter", "tree", "--tree", "auto", "--k", "3"], "drop --k"),
        (["--rule", "typical"], "--allow-lossy"),
        (["--rule", "typical", "--allow-lossy", "--drafter", "tree"], "verifies chains"),
        (["--draft-window", "-1"], "--draft-window must be 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    pair: tuple[Path, Path], args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target, draft = pair
    base = ["generate", "hello", "--target", str(target), "--draft", str(draft), "--dtype", "fp32"]
    try:
        code = main(base + args)
    except SystemExit as exc:  # argparse usage errors exit from inside the parser
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert "Traceback" not in err
