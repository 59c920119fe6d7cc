"""`verispec certify` as a user runs it: rules on Markov chains, the engine on tiny transformers."""

from __future__ import annotations

import json

import pytest

from verispec.cli import main


def test_certify_rule_with_negative_controls(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["certify", "--k", "2", "--temperature", "1", "--top-p", "1", "--samples", "4000",
                 "--negative-controls", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_as_expected"]
    verdicts = {(r["case"]["rule"], r["passed"]) for r in out["results"]}
    assert ("rejection", True) in verdicts
    assert any(not passed for _, passed in verdicts)  # the broken rules were caught


def test_certify_engine_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["certify", "--engine", "--drafter", "composite", "--k", "2,auto", "--temperature", "0.9",
                 "--top-p", "1", "--samples", "2500", "--negative-controls", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_as_expected"] and out["engine"]
    lossless = [r for r in out["results"] if r["claims_lossless"]]
    broken = [r for r in out["results"] if not r["claims_lossless"]]
    assert len(lossless) == 2 and all(r["passed"] and r["acceptance_rate"] > 0 for r in lossless)
    assert len(broken) == 2 and not any(r["passed"] for r in broken)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k", "auto"], "--k auto needs --engine"),
        (["--drafter", "ngram"], "needs --engine"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--engine", "--drafter", "point-mass"], "certifies a drafter"),
        (["--engine", "--draft-vocab", "9"], "--draft-vocab must be in 1..4"),
        (["--engine", "--device", "tpu"], "unknown device"),
        (["--k", "x"], "comma-separated"),
    ],
)
def test_certify_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["certify", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err
