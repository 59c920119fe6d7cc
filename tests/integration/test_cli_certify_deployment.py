"""``verispec certify --target``: a real deployment (tiny GGUF models written in the test) is
certified by two samples, with the report's figures in JSON and a one-line error on bad input."""

from __future__ import annotations

import json
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
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("certify")
    target, draft = root / "target.gguf", root / "draft.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(draft, TinySpec(seed=2))
    prompts = root / "prompts.txt"
    prompts.write_text("hello 1 world\nhello 2\n")
    return {"target": target, "draft": draft, "prompts": prompts}


def test_a_deployment_is_certified_by_two_samples(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    args = ["certify", "--target", str(models["target"]), "--draft", str(models["draft"]), "--dtype", "fp32",
            "--prompts", str(models["prompts"]), "--samples", "150", "--tokens", "2", "--k", "2", "--json"]  # fmt: skip
    assert run(*args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["samples_per_arm"] == 150 and len(out["prompts"]) == 2
    first = out["prompts"][0]
    assert 0.0 <= first["p_value"] <= 1.0 and 0.0 < first["detectable_tv"] <= 1.0 and first["n_a"] == 150


def test_goodness_of_fit_with_prompts_from_jsonl_and_an_html_page(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("hello <b>1</b>\nworld") + "\n" + json.dumps({"prompt": "hello 2"}) + "\n")
    page = tmp_path / "certify.html"
    args = ["certify", "--target", str(models["target"]), "--draft", str(models["draft"]), "--dtype", "fp32",
            "--prompts", str(prompts), "--samples", "200", "--tokens", "2", "--k", "2", "--fit", "--html", str(page),
            "--json"]  # fmt: skip
    assert run(*args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "goodness-of-fit" and out["pilot"] == 50 and out["prompts"][0]["prompt"].endswith("\nworld")
    assert all(p["n_a"] == 0 and p["method"] == "goodness-of-fit" for p in out["prompts"])
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "detectable TV" in text
    assert "<b>1" not in text and "&lt;b&gt;1" in text  # (prompts are escaped)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    assert run(*args[:-6], "--prompts", str(bad)) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "0.5,1"], "one value each"),
        (["--temperature", "0"], "temperature > 0"),
        (["--drafter", "tree"], "--drafter is model"),
        (["--prompts", "/no/such/file"], "neither certify"),
        (["--html", "/no/such/folder/c.html"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    models: dict[str, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["certify", "--target", str(models["target"]), "--draft", str(models["draft"]), "--dtype", "fp32",
            "--samples", "10", *extra]  # fmt: skip
    assert run(*args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.fixture
def servers():  # type: ignore[no-untyped-def]
    """Two fake OpenAI-compatible servers on real sockets: a faithful one and one that applies the
    temperature twice (:mod:`tests.stats.test_certify_endpoint`'s laws)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np

    from tests.stats.test_certify_endpoint import sampler

    def make(broken: str | None) -> ThreadingHTTPServer:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rng = np.random.default_rng(body["seed"])
                draw = sampler(broken)
                texts = [draw(rng, body["temperature"], body["max_tokens"]) for _ in range(body["n"])]
                data = json.dumps({"choices": [{"index": i, "text": t} for i, t in enumerate(texts)]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    running = {name: make(broken) for name, broken in (("plain", None), ("spec", None), ("bad", "temperature-twice"))}
    yield {name: f"http://127.0.0.1:{s.server_address[1]}/v1" for name, s in running.items()}
    for s in running.values():
        s.shutdown()


@pytest.mark.parametrize(("spec", "status"), [("spec", 0), ("bad", 1)])
def test_two_endpoints_are_certified(
    servers: dict[str, str], models: dict[str, Path], spec: str, status: int, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["certify", "--endpoint-baseline", servers["plain"], "--endpoint-spec", servers[spec], "--model", "m",
            "--tokenizer", str(models["target"]), "--prompts", str(models["prompts"]), "--samples", "600",
            "--tokens", "2", "--temperature", "0.8", "--concurrency", "4", "--json"]  # fmt: skip
    assert run(*args) == status
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] is (status == 0) and out["tokenizer"] == str(models["target"])


def test_endpoints_need_a_model_and_a_tokenizer(servers: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run("certify", "--endpoint-baseline", servers["plain"], "--endpoint-spec", servers["spec"]) == 2
    assert "--tokenizer" in capsys.readouterr().err
