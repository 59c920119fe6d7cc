"""``verispec analyze`` in-process: printed figures, the heat map, --json, and one-line errors."""

from __future__ import annotations

import argparse
import json
import struct
import zlib
from pathlib import Path

import pytest

from verispec.cli import OneLineParser, main
from verispec.cli.analyze import register

BASE = ["analyze", "--alpha", "0.7", "--k", "4", "--c", "0.1"]
FAST = ["--samples", "20000"]  # the default 100000 is exercised once


def run(*argv: str) -> int:
    """The exit status of ``verispec ARGV``, usage errors (argparse exits) included."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)


def assert_valid_png(path: Path) -> None:
    """PNG signature, a well-formed IHDR and an IEND chunk whose CRCs match."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(data[12:29])
    assert data[-12:] == b"\x00\x00\x00\x00IEND" + struct.pack(">I", zlib.crc32(b"IEND"))


def test_tables_show_the_worked_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "heat.png"
    assert run(*BASE, "--plot", str(plot)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    for figure in ("2.7731", "1.9808", "0.4433", "0.2871", "100,000 steps", "agrees"):
        assert figure in out
    best_row = next(line for line in out.splitlines() if "★ best" in line)
    assert "← --k" in best_row and "1.9808" in best_row  # K = 4 is the best K and the given one
    assert "1.2791" in out  # the table goes up to K = 16
    assert str(plot) in out
    assert_valid_png(plot)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heat.png"]  # no temporary file left over


def test_default_plot_path_is_in_the_current_directory_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "speedup-c0.1.png").write_bytes(b"an older plot")
    assert run(*BASE, *FAST) == 0
    assert_valid_png(tmp_path / "speedup-c0.1.png")
    assert "speedup-c0.1.png" in capsys.readouterr().out
    assert len(list(tmp_path.iterdir())) == 1


def test_no_plot_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(*BASE, *FAST, "--no-plot") == 0
    assert list(tmp_path.iterdir()) == []
    assert "heat map" not in capsys.readouterr().out


def test_json_has_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*BASE, *FAST, "--seed", "3", "--json", "--no-plot") == 0
    report = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON object
    assert round(report["expected_tokens"], 4) == 2.7731
    assert round(report["speedup"], 4) == 1.9808
    assert round(report["break_even_c"], 3) == 0.443
    assert round(report["alpha_min"], 4) == 0.2871
    assert report["optimal_k"] == 4
    assert report["optimal_speedup"] == report["speedup"]
    assert (report["alpha"], report["k"], report["c"], report["k_max"]) == (0.7, 4, 0.1, 16)
    mc = report["monte_carlo"]
    assert (mc["samples"], mc["seed"]) == (20000, 3)
    assert abs(mc["tokens_per_step"] - report["expected_tokens"]) < 5 * mc["tokens_per_step_std_error"]
    assert mc["z"] == pytest.approx(
        (mc["tokens_per_step"] - report["expected_tokens"]) / mc["tokens_per_step_std_error"]
    )
    assert [row["k"] for row in report["by_k"]] == list(range(1, 17))
    assert report["by_k"][3]["speedup"] == report["speedup"]
    assert report["plot"] is None


def test_json_with_plot_for_a_free_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "free.png"  # c = 0: S >= 1 everywhere, no S = 1 contour inside the map
    assert run("analyze", "--alpha", "0.5", "--c", "0", *FAST, "--json", "--plot", str(plot)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plot"] == str(plot)
    assert report["alpha_min"] == 0.0
    assert report["optimal_k"] == 16
    assert_valid_png(plot)


def test_json_when_speculation_cannot_pay(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("analyze", "--alpha", "0.9", "--c", "1.2", "--samples", "1", "--json", "--no-plot") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["alpha_min"] is None  # c > 1: no acceptance rate is enough
    assert report["optimal_k"] == 0
    assert report["optimal_speedup"] == 1.0
    assert report["speedup"] < 1
    assert report["monte_carlo"]["tokens_per_step_std_error"] is None  # one step: no spread (NaN -> null)
    assert report["plot"] is None


def test_tables_when_speculation_cannot_pay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "slow.png"
    assert run("analyze", "--alpha", "0.9", "--c", "1.2", *FAST, "--plot", str(plot)) == 0
    out = capsys.readouterr().out
    assert "plain decoding is faster" in out
    assert "no K beats plain decoding" in out
    assert "★ best" not in out
    assert_valid_png(plot)  # no S = 1 contour to draw: still a valid heat map


def test_k_above_k_max_extends_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("analyze", "--alpha", "0.95", "--k", "20", "--c", "0.01", *FAST, "--json", "--no-plot") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["k_max"] == 20
    assert len(report["by_k"]) == 20


@pytest.mark.parametrize(
    "argv",
    [
        ["--alpha", "1.5", "--c", "0.1"],
        ["--alpha", "-0.1", "--c", "0.1"],
        ["--alpha", "nan", "--c", "0.1"],
        ["--alpha", "0.7", "--c", "-0.1"],
        ["--alpha", "0.7", "--c", "inf"],
        ["--alpha", "0.7", "--c", "0.1", "--k", "0"],
        ["--alpha", "0.7", "--c", "0.1", "--k", "5000"],
        ["--alpha", "0.7", "--c", "0.1", "--k-max", "0"],
        ["--alpha", "0.7", "--c", "0.1", "--samples", "0"],
        ["--alpha", "0.7", "--c", "0.1", "--samples", "1000000000"],
        ["--alpha", "0.7", "--c", "0.1", "--seed", "-1"],
        ["--alpha", "abc", "--c", "0.1"],
        ["--alpha", "0.7"],
        ["--alpha", "0.7", "--c", "0.1", "--plot", "x.png", "--no-plot"],
        ["--alpha", "0.7", "--c", "0.1", "--frobnicate"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run("analyze", *argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "error" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_range_errors_say_the_allowed_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("analyze", "--alpha", "1.5", "--c", "0.1", "--no-plot") == 2
    assert "[0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["missing-dir/heat.png", "."])
def test_unwritable_plot_path_is_one_line(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(*BASE, "--samples", "10", "--plot", where) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and ("--no-plot" in err or "directory" in err)
    assert list(tmp_path.iterdir()) == []  # the temporary file was removed


def test_every_option_is_explained() -> None:
    parser = OneLineParser(prog="verispec")
    register(parser.add_subparsers(parser_class=OneLineParser))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    analyze = sub.choices["analyze"]
    for action in analyze._actions:
        assert action.help, action.dest
        if action.default not in (None, False, argparse.SUPPRESS):
            assert f"default: {action.default}" in action.help, action.dest


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("analyze", "--help") == 0
    assert "--samples" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- trees
TREE = ["analyze", "--tree-acceptance", "0.6,0.2,0.1"]


def test_trees_table_best_tree_and_written_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file, plot = tmp_path / "tree.json", tmp_path / "trees.png"
    assert run(*TREE, "--tree-nodes", "8", "--c", "0.2", "--tree-out", str(out_file), "--plot", str(plot)) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "Best tree of each size" in out and "S tree" in out and str(out_file) in out
    assert_valid_png(plot)
    paths = json.loads(out_file.read_text())
    from verispec.analysis import optimal_tree, parents_from_paths, tree_expected_tokens

    assert parents_from_paths(paths) == optimal_tree([0.6, 0.2, 0.1], 8).parents
    assert f"{tree_expected_tokens(parents_from_paths(paths), [0.6, 0.2, 0.1]):.4f}" in out
    # the file is a --tree the drafters take
    from verispec.drafters.tree import TreeShape

    assert TreeShape.parse(str(out_file)).parents == parents_from_paths(paths)


def test_trees_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*TREE, "--tree-nodes", "6", "--tree-depth", "2", "--tree", "2,2,2,6", "--json", "--no-plot") == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["nodes"] for row in report["by_nodes"]] == [1, 2, 3, 4, 5, 6]
    assert all(row["depth"] <= 2 and row["speedup"] is None for row in report["by_nodes"])
    assert all(row["expected_tokens"] >= row["chain_expected_tokens"] - 1e-12 for row in report["by_nodes"])
    assert report["by_nodes"][0]["expected_tokens"] == pytest.approx(1.6)
    given = report["given"]
    assert given["nodes"] == 6 and given["depth"] == 2  # root: 2 children; each: 2 children
    assert given["expected_tokens"] == pytest.approx(1 + 0.8 + 0.8 * 0.8)
    assert given["expected_tokens"] <= report["best"]["expected_tokens"] + 1e-12


@pytest.mark.parametrize(
    "argv",
    [
        ["--tree-acceptance", "0.7,0.5"],  # sums past 1
        ["--tree-acceptance", "abc"],
        ["--tree-acceptance", "0.5", "--tree-nodes", "0"],
        ["--tree-acceptance", "0.5", "--tree-nodes", "100000"],
        ["--tree-acceptance", "0.5", "--tree-depth", "0"],
        ["--tree-acceptance", "0.5", "--c", "-1"],
        ["--tree-acceptance", "0.5", "--tree", "[[1]]"],
        ["--tree-acceptance", "0.5", "--tree", "missing.json"],
        ["--c", "0.1"],  # neither --alpha nor --tree-acceptance
    ],
)
def test_bad_tree_input_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run("analyze", *argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []
