"""`verispec serve` as a user runs it: a subprocess on tiny GGUF files written in the test, a
completion and a chat answer over HTTP, then Ctrl-C (SIGINT) and a clean exit."""

from __future__ import annotations

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
