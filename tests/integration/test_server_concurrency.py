"""Many clients at once: nothing lost or mixed between concurrent streams, and clients that leave
mid-request free their engine slots at once while the server keeps answering correctly."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from tests.integration.serving import PRINTABLE_ONLY, LiveServer, metric, reference, tiny_engine, tokenizer, wait_until  # noqa: E402
from verispec.config import SamplingParams  # noqa: E402
from verispec.server import ServerConfig, create_app  # noqa: E402


@pytest.fixture(scope="module")
def live():
    engine = tiny_engine(max_batch=8, max_len=512)
    with LiveServer(create_app(engine, ServerConfig(max_queue=64, served_model_names=("tiny",)))) as server:
        yield server


async def read_stream(client, url: str, body: dict) -> tuple[str, dict]:
    """The streamed text and the finishing chunk; checks that every chunk belongs to one request."""
    texts, ids, final, done = [], set(), None, False
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ") and not done
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            texts.append(chunk["choices"][0]["text"])
            if chunk["choices"][0]["finish_reason"] is not None:
                assert final is None
                final = chunk
    assert done and final is not None and len(ids) == 1
    return "".join(texts), final


def test_64_concurrent_streams_equal_the_same_requests_alone(live) -> None:
    url = f"{live.url}/v1/completions"
    bodies = [
        {"prompt": f"request {i}: " + "xyz" * (i % 7), "max_tokens": 4 + i % 9, "temperature": 0.9, "top_p": 0.95,
         "seed": 1000 + i, "logit_bias": PRINTABLE_ONLY, "stream": True}
        for i in range(64)
    ]  # fmt: skip

    async def together() -> list[tuple[str, dict]]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(read_stream(client, url, b) for b in bodies))

    engine = live.runner.engine
    engine.steps.clear()
    concurrent = asyncio.run(together())
    assert max(s.batch for s in engine.steps) == 8  # the requests really shared the batch
    assert live.runner.num_live == 0

    with httpx.Client(timeout=60) as client:
        for body, (text, final) in zip(bodies, concurrent, strict=True):
            alone = client.post(url, json={**body, "stream": False}).json()
            assert text == alone["choices"][0]["text"] and text.isprintable()
            assert final["choices"][0]["finish_reason"] == alone["choices"][0]["finish_reason"]
            assert final["usage"] == alone["usage"]
            assert final["spec"] == alone["spec"]
    # ... and alone through the server equals alone in the engine, without the server
    body = bodies[5]
    params = SamplingParams(
        temperature=0.9, top_p=0.95, seed=1005, max_tokens=body["max_tokens"],
        logit_bias={int(k): v for k, v in PRINTABLE_ONLY.items()},
    )  # fmt: skip
    assert reference(tokenizer().encode(body["prompt"]), params).text == concurrent[5][0]


def test_disconnect_storm_frees_every_slot(live) -> None:
    url = f"{live.url}/v1/completions"
    before = httpx.get(f"{live.url}/metrics").text
    long = {"prompt": "go", "max_tokens": 480, "temperature": 1.0, "logit_bias": {"256": -100}}  # no early EOS

    async def leave_mid_stream(client, i: int) -> None:
        async with client.stream("POST", url, json={**long, "seed": i, "stream": True}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 1 + i % 3:
                    break  # leaving the block closes the connection mid-stream

    async def leave_before_the_answer(client, i: int) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(url, json={**long, "seed": i}, timeout=httpx.Timeout(60, read=0.2))

    async def storm() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            await asyncio.gather(
                *(leave_mid_stream(client, i) for i in range(24)),
                *(leave_before_the_answer(client, i) for i in range(8)),
            )

    asyncio.run(storm())
    engine = live.runner.engine
    wait_until(
        lambda: not engine.has_unfinished() and not engine.cache.active_slots and live.runner.num_live == 0,
        timeout=10, what="the engine to drop the abandoned requests",
    )  # fmt: skip
    after = httpx.get(f"{live.url}/metrics").text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("verispec:request_success_total", finished_reason="abort") == 32  # aborted, not run to the end
    assert delta("verispec:request_success_total") == 32
    assert metric(after, "verispec:num_requests_running") == metric(after, "verispec:num_requests_waiting") == 0
    # the server still answers, and correctly
    r = httpx.post(url, json={"prompt": "after the storm", "max_tokens": 16, "temperature": 0})
    ref = reference(tokenizer().encode("after the storm"), SamplingParams(temperature=0, max_tokens=16))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text
