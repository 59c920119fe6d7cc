"""verispec loadgen: against a live verispec server (tiny model) and a fake OpenAI endpoint."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.integration.fake_openai import FakeState, fake_app
from tests.integration.serving import tiny_engine
from verispec.bench.loadgen import (
    EndpointError,
    Load,
    PromptItem,
    RequestOptions,
    builtin_prompts,
    load_prompt_file,
    parse_endpoint,
    sweep,
)
from verispec.bench.local import LocalServer
from verispec.cli import main
from verispec.errors import ConfigError

PROMPTS = [PromptItem(prompt="hello there"), PromptItem(messages=({"role": "user", "content": "hi"},))]


def run(url: str, loads: list[Load], prompts: list[PromptItem] = PROMPTS, **kw: object) -> list:
    options = RequestOptions(model="", max_tokens=kw.pop("max_tokens", 12))  # type: ignore[arg-type]
    return asyncio.run(sweep(url, prompts, loads, options, **kw))  # type: ignore[arg-type]


def test_live_verispec_server_closed_and_open_loop() -> None:
    from verispec.server import create_app

    with LocalServer(create_app(tiny_engine(max_batch=4))) as server:
        closed, opened = run(server.url + "/v1", [Load(concurrency=2, num_requests=4), Load(qps=50.0, num_requests=4)])
    for level in (closed, opened):
        s = level.summary()
        assert s["model"] == "tiny-257"
        assert s["completed"] == 4 and s["errors"] == {} and s["error_rate"] == 0
        assert s["output_tokens_from_usage"] is True
        assert all(r.output_tokens == 12 and r.ttft is not None and r.ttft <= r.e2e for r in level.records)
        assert s["output_tokens"] == 48 and s["output_tokens_per_s"] > 0 and s["ttft_s"]["p50"] is not None
        assert [r.prompt_index for r in level.records] == [0, 1, 0, 1]
        # The server's counters over the level equal the sums of the answers' spec objects.
        metrics, responses = s["spec_metrics"], s["spec_responses"]["token_weighted"]
        assert metrics["source"] == "verispec"
        assert metrics["num_draft_tokens"] == responses["num_draft_tokens"] > 0
        assert metrics["num_accepted_tokens"] == responses["num_accepted_tokens"]
        assert metrics["acceptance_rate"] == pytest.approx(responses["acceptance_rate"])
        assert s["spec_responses"]["per_request"]["num_requests"] == 4


def test_vllm_metrics_usage_and_error_accounting() -> None:
    state = FakeState(scheme="vllm", chunks=4)
    prompts = [PromptItem(prompt="ok"), PromptItem(prompt="FAIL429"), PromptItem(prompt="ok"),
               PromptItem(prompt="FAIL500"), PromptItem(prompt="MIDSTREAM")]  # fmt: skip
    with LocalServer(fake_app(state)) as server:
        (level,) = run(server.url, [Load(concurrency=3, num_requests=10)], prompts, warmup=0)
    s = level.summary()
    assert s["requests"] == 10 and s["completed"] == 4
    assert s["errors"] == {"http_429": 2, "http_500": 2, "stream_error": 2}
    assert s["error_rate"] == pytest.approx(0.6)
    bad = {r.error: r for r in level.records if not r.ok}
    assert bad["http_429"].status == 429 and bad["http_429"].error_message == "queue full"
    assert bad["stream_error"].error_message == "engine died"
    ok = [r for r in level.records if r.ok]
    assert all(r.output_tokens == 8 and r.tokens_from_usage and len(r.chunk_times) == 4 for r in ok)
    assert all(r.tpot == pytest.approx((r.e2e - r.ttft) / 7) for r in ok)
    m = s["spec_metrics"]  # 4 completed requests x (4 drafts of K=2, 6 accepted, position 0 accepted 4 times)
    assert m["source"] == "vllm"
    assert (m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"]) == (16, 32, 24)
    assert m["acceptance_rate"] == pytest.approx(0.75)
    assert m["mean_acceptance_length"] == pytest.approx(2.5)
    assert m["acceptance_per_position"] == pytest.approx([1.0, 0.5])
    assert s["server"]["preemptions"] == 0


def test_sglang_gauges_chat_chunks_without_usage() -> None:
    state = FakeState(scheme="sglang", chunks=3)
    chat = [PromptItem(messages=({"role": "user", "content": "hi"},))]
    with LocalServer(fake_app(state)) as server:
        options = RequestOptions(model="m", include_usage=False)
        (level,) = asyncio.run(sweep(server.url + "/v1/", chat, [Load(concurrency=1, num_requests=2)], options))
    s = level.summary()
    assert all(r.output_tokens == 3 and not r.tokens_from_usage and r.text == "t0 t1 t2 " for r in level.records)
    assert s["output_tokens_from_usage"] is False
    assert s["spec_metrics"]["source"] == "sglang"
    assert s["spec_metrics"]["accept_length_gauge"] == 2.5 and s["spec_metrics"]["accept_rate_gauge"] == 0.75
    assert "stream_options" not in state.bodies[-1] and state.bodies[-1]["messages"][0]["content"] == "hi"


def test_poisson_arrivals_do_not_wait_and_duration_bounds_a_level() -> None:
    state = FakeState(scheme="missing", chunks=2, delay=0.15)
    with LocalServer(fake_app(state)) as server:
        start = time.perf_counter()
        (opened,) = run(server.url, [Load(qps=40.0, num_requests=6, seed=3)], warmup=0)
        open_time = time.perf_counter() - start
        (again,) = run(server.url, [Load(qps=40.0, num_requests=6, seed=3)], warmup=0)
        assert state.max_in_flight >= 3  # open loop: requests overlap although each takes 0.3 s
        (bounded,) = run(server.url, [Load(concurrency=1, num_requests=50, duration=0.5)], warmup=0)
    starts = [r.start for r in opened.records]
    assert starts == sorted(starts) and starts[-1] < 1.0 and open_time < 1.5
    # seeded arrivals: both runs follow the same schedule (exponential gaps from the seed), each request
    # leaving at its time, never before, and not a request's 0.3 s later as a closed loop would (a
    # busy machine delays it: one CI run saw 0.48 s late against 0.15 s allowed; rounding both runs'
    # measured times to 0.1 s flipped at the boundaries)
    gaps = np.random.default_rng(3).exponential(1 / 40.0, size=6)
    schedule = np.concatenate([[0.0], np.cumsum(gaps[:5])])
    for level in (opened, again):
        for record, at in zip(level.records, schedule, strict=True):
            assert at - 0.01 <= record.start <= at + 0.75, (record.start, at)
    assert 1 <= len(bounded.records) <= 4  # stops sending after the duration
    assert opened.summary()["spec_metrics"] is None  # no /metrics there


def test_prompt_files_and_endpoint_errors(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    items = load_prompt_file(path)
    assert [i.kind for i in items] == ["completion", "chat"]
    for text, match in (("", "holds no prompt"), ("{bad\n", ":1: not JSON"), ('{"x": 1}\n', "expected")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_prompt_file(path)
    assert len(builtin_prompts("summarize", limit=3)) == 3
    assert builtin_prompts("chat", limit=1)[0].kind == "chat"
    assert parse_endpoint("http://h:8000/v1/") == "http://h:8000"
    for bad in ("localhost:8000", "ftp://h", "http://:80", "http://h:99999"):
        with pytest.raises(ConfigError, match="bad endpoint URL"):
            parse_endpoint(bad)
    with LocalServer(fake_app(FakeState())) as server:
        url = server.url
    with pytest.raises(EndpointError, match="cannot reach"):
        run(url, [Load(concurrency=1, num_requests=1)])


def test_cli(tmp_path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    out = tmp_path / "load.json"
    with LocalServer(fake_app(FakeState(chunks=3))) as server:
        status = main(["loadgen", "--endpoint", server.url + "/v1", "--prompts", str(prompts),
                       "--concurrency", "1,2", "--qps", "20", "--num-requests", "3", "--json", str(out)])  # fmt: skip
    assert status == 0
    data = json.loads(out.read_text())
    assert [lv["label"] for lv in data["levels"]] == ["concurrency 1", "concurrency 2", "20 qps"]
    assert data["model"] == "fake-model" and all(len(lv["records"]) == 3 for lv in data["levels"])
    assert "verispec loadgen" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for argv in (["--endpoint", "nonsense"], ["--endpoint", "http://127.0.0.1:9/v1", "--num-prompts", "1"],
                 ["--endpoint", "http://127.0.0.1:9", "--prompts", str(empty)]):  # fmt: skip
        assert main(["loadgen", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("verispec: error:") and err.count("\n") == 1, err
