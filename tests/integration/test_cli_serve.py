"""`verispec serve` as a user runs it: a subprocess on tiny GGUF files written in the test, a
completion and a chat answer over HTTP, then Ctrl-C (SIGINT) and a clean exit."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from tests.unit.tiny_gguf import TinySpec, write_tiny  # noqa: E402
from verispec.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_answers_then_exits_cleanly_on_sigint(tmp_path: Path) -> None:
    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(draft, TinySpec(seed=2))
    port = free_port()
    env = {**os.environ, "VERISPEC_API_KEY": "k3y", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "verispec", "serve", "--target", str(target), "--draft", str(draft),
           "--dtype", "fp32", "--k", "2", "--max-len", "256", "--port", str(port), "--served-model-name", "tiny",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer k3y"}
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 8,
                                                       "temperature": 0}, headers=auth)  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] <= 8 and body["spec"]["lossless"] is True
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=auth).status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", json=chat).status_code == 401
        assert "verispec:spec_decode_num_drafts_total" in httpx.get(f"{url}/metrics", headers=auth).text
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "serving tiny" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_serve_rejects_bad_settings_before_loading_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-queue", "-1"]) == 2
    assert "max_queue must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--port", "70000"], "--port must be in [1, 65535]"),
        (["serve", "--port", "-1"], "--port must be in [1, 65535]"),
        (["serve", "--port", "http"], "--port must be an integer"),
        (["serve", "--host", "bad host!"], "--host must be an IP address or a host name"),
        (["serve", "--host", "a" * 300], "--host must be"),
        (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number"),
        (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout must be a finite number"),
        (["serve", "--shutdown-timeout", "-1"], "shutdown_grace_seconds must be a finite number >= 0"),
        (["serve", "--api-key", ""], "--api-key is empty"),
        (["serve", "--max-batch", str(10**30)], "beyond 64 bits"),
        (["serve", "--max-batch", "100000"], "max_batch must be in [1, 4096]"),
        (["serve", "--max-len", str(2**40)], "max_len must be in [1, 16777216]"),
        (["serve", "--allowed-host", "a/b"], "allowed hosts must be host names"),
        (["generate", "x", "--seed", str(2**70)], "beyond 64 bits"),
        (["generate", "x", "--seed", "-1"], "seed must be in [0, 2**64 - 1]"),
        (["generate", "x", "--temperature", "inf"], "--temperature must be a finite number"),
        (["generate", "x", "--temperature", "1e39"], "temperature must be 0 (greedy) or in"),
        (["generate", "x", "--top-p", "nan"], "--top-p must be a finite number"),
        (["generate", "x", "--presence-penalty", "1e39"], "presence_penalty must be in"),
        (["generate", "x", "--max-tokens", "0"], "max_tokens must be in [1,"),
        (["generate", "x", "--stop", "\udcff"], "lone surrogate"),
        (["generate", "\udcff"], "lone surrogate"),
    ],
)
def test_bad_options_are_one_line_and_exit_2_before_models_load(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from verispec import pipeline as api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("models were loaded"))
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)
    with pytest.raises(SystemExit) if needle.startswith(("--port", "--host")) else contextlib.nullcontext():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_an_empty_api_key_in_the_environment_is_an_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VERISPEC_API_KEY", "")
    assert main(["serve"]) == 2
    assert "VERISPEC_API_KEY is empty" in capsys.readouterr().err
