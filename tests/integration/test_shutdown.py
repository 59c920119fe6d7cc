"""A forced shutdown (a second Ctrl-C) while requests are in flight: every stream ends with an error
event and [DONE], every non-streaming request gets an OpenAI-style 503 with Retry-After."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.integration.serving import tiny_engine, wait_until  # noqa: E402
from verispec.server import ServerConfig, create_app  # noqa: E402
from verispec.server.shutdown import GracefulServer  # noqa: E402

LONG = {"prompt": "go", "max_tokens": 480, "temperature": 1.0, "logit_bias": {"256": -100}}  # no early EOS


@pytest.mark.parametrize("grace", [300.0, 0.0])
def test_a_forced_shutdown_tells_every_client(grace: float) -> None:
    app = create_app(tiny_engine(max_batch=4, max_len=512), ServerConfig(shutdown_grace_seconds=grace))
    runner = app.state.server.runner
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    server = GracefulServer(uvicorn.Config(app, log_level="warning"), runner, grace)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, timeout=30, what="the server to start")

    async def stream(client, seed: int) -> list[str]:
        events = []
        async with client.stream("POST", url, json={**LONG, "seed": seed, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line:
                    events.append(line)
        return events

    async def plain(client, seed: int) -> httpx.Response:
        return await client.post(url, json={**LONG, "seed": seed})

    async def clients():
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.ensure_future(stream(client, i)) for i in range(3)]
            tasks += [asyncio.ensure_future(plain(client, 10 + i)) for i in range(3)]  # 2 run, the rest wait
            deadline = time.monotonic() + 30
            while runner.num_live < 6 and time.monotonic() < deadline:  # every request admitted
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the streams are under way
            server.handle_exit(signal.SIGINT, None)
            server.handle_exit(signal.SIGINT, None)  # the second Ctrl-C
            return await asyncio.gather(*tasks)

    start = time.monotonic()
    results = asyncio.run(clients())
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - start < 20
    for events in results[:3]:
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: ") :])
        assert last["error"]["code"] == "shutting_down", events[-2]
    for r in results[3:]:
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["retry-after"] == "1"
