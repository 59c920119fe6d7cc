"""The server under attack: poisoned parameters beside healthy streams, prompts far too long,
cross-origin and DNS-rebinding requests, an empty API key, and what stays open with a key."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.integration.serving import PRINTABLE_ONLY, LiveServer, tiny_engine  # noqa: E402
from tests.integration.test_server_concurrency import read_stream  # noqa: E402
from verispec.errors import ConfigError  # noqa: E402
from verispec.server import ServerConfig, create_app  # noqa: E402
from verispec.server.hosts import host_allowed  # noqa: E402

# Values finite in JSON (float64) that fp32 cannot hold, or that overflow it in a decode step.
POISON = [
    ("temperature", 1e39), ("temperature", 1e-40), ("temperature", 5e-324), ("presence_penalty", 1e39),
    ("frequency_penalty", -1e39), ("repetition_penalty", 1e-46), ("repetition_penalty", 1e39),
    ("top_k", 2**63), ("seed", 2**64), ("max_tokens", 2**40), ("top_p", 1e-330), ("min_p", 1.0000001),
]  # fmt: skip


@pytest.fixture(scope="module")
def live():
    engine = tiny_engine(max_batch=8, max_len=512)
    with LiveServer(create_app(engine, ServerConfig(served_model_names=("tiny",)))) as server:
        yield server


def test_poisoned_requests_beside_healthy_streams(live) -> None:
    url = f"{live.url}/v1/completions"
    healthy = [
        {"prompt": f"healthy {i}", "max_tokens": 40, "temperature": 0.9, "seed": 7 + i,
         "logit_bias": PRINTABLE_ONLY | {"256": -100}, "stream": True}
        for i in range(4)
    ]  # fmt: skip

    async def poisoned(client, name: str, value: float) -> None:
        await asyncio.sleep(0.05)  # while the healthy streams run
        for stream in (True, False):
            body = {"prompt": "poison", "max_tokens": 8, "temperature": 0.7, name: value, "stream": stream}
            r = await client.post(url, json=body)
            assert r.status_code == 400, (name, value, r.text)
            assert r.json()["error"]["param"] == name, r.text

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(read_stream(client, url, b) for b in healthy), *(poisoned(client, n, v) for n, v in POISON)
            )

    results = asyncio.run(together())
    with httpx.Client(timeout=60) as client:
        for body, (text, final) in zip(healthy, results[: len(healthy)], strict=True):
            alone = client.post(url, json={**body, "stream": False}).json()
            assert final["choices"][0]["finish_reason"] == "length"
            assert text == alone["choices"][0]["text"] and final["spec"] == alone["spec"]


def test_a_huge_prompt_is_refused_before_it_is_tokenized(live, monkeypatch) -> None:
    tokenizer = live.runner.engine.tokenizer
    seen: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: seen.append(len(text)) or encode(text, *a, **kw))
    huge = "x" * (3 << 20)  # under the 4 MiB body limit, far over 511 tokens
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": huge}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    chat = {"messages": [{"role": "user", "content": "x" * (1 << 20)}]}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]
    many = {"messages": [{"role": "user", "content": "x"}] * 100_000}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=many, timeout=60)
    assert r.status_code == 400 and "100000 messages" in r.json()["error"]["message"]
    assert not seen  # nothing was tokenized
    ok = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and seen == [200]


def test_a_stream_keeps_going_while_a_huge_prompt_is_refused(live) -> None:
    url = f"{live.url}/v1/completions"
    body = {"prompt": "steady", "max_tokens": 120, "temperature": 0, "logit_bias": {"256": -100}, "stream": True}

    async def flood(client) -> None:
        for _ in range(3):
            r = await client.post(url, json={"prompt": "y" * (3 << 20)})
            assert r.status_code == 400

    async def together():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(read_stream(client, url, body), flood(client))

    (_, final), _ = asyncio.run(together())
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 120


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_json_endpoints_refuse_bodies_a_web_page_can_send_without_asking(live, content_type) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    r = httpx.post(f"{live.url}/v1/completions", content=body, headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(
        f"{live.url}/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200


def test_the_host_header_is_checked_against_dns_rebinding(live) -> None:
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", ""):
        r = httpx.get(f"{live.url}/v1/models", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
    for host in ("127.0.0.1:1234", "localhost", "LOCALHOST:80", "[::1]:8000", "10.1.2.3"):
        assert httpx.get(f"{live.url}/v1/models", headers={"host": host}).status_code == 200, host
    assert host_allowed("models.example.com:443", ("models.example.com",))
    assert host_allowed("anything", ("*",)) and not host_allowed("other.example.com", ("models.example.com",))


@pytest.mark.parametrize("key", ["", " ", "a b", "k\u00e9y", "\x00"])
def test_an_empty_or_unprintable_api_key_is_an_error_not_auth_turned_off(key: str) -> None:
    with pytest.raises(ConfigError, match="API key"):
        ServerConfig(api_key=key)


def test_with_a_key_health_stays_open_and_metrics_can_be_opened() -> None:
    app = create_app(tiny_engine(max_len=64), ServerConfig(api_key="k", public_metrics=True))
    with LiveServer(app) as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        assert httpx.get(f"{server.url}/openapi.json").status_code == 404
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
    app = create_app(tiny_engine(max_len=64), ServerConfig())
    with LiveServer(app) as server:  # without a key, on loopback, the description is there
        assert httpx.get(f"{server.url}/openapi.json").status_code == 200


def test_a_seed_under_k_auto_comes_with_a_warning() -> None:
    app = create_app(tiny_engine(max_len=64, k=None), ServerConfig())
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"
        seeded = httpx.post(url, json={"prompt": "x", "max_tokens": 3, "seed": 1}).json()
        assert "reproducible" in seeded["spec"]["warnings"][0]
        assert (
            httpx.post(url, json={"prompt": "x", "max_tokens": 3, "seed": 1, "temperature": 0}).json()["spec"][
                "warnings"
            ]
            == []
        )  # greedy: nothing random
    app = create_app(tiny_engine(max_len=64, k=3), ServerConfig())
    with LiveServer(app) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3, "seed": 1})
        assert r.json()["spec"]["warnings"] == []
