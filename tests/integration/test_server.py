"""The OpenAI-compatible server end to end: the official ``openai`` client against a live uvicorn
server on a tiny pair built in code; answers equal the engine's; errors, limits, auth, metrics."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.integration.serving import (  # noqa: E402
    PRINTABLE_ONLY,
    GatedEngine,
    LiveServer,
    metric,
    reference,
    tiny_engine,
    tokenizer,
    wait_until,
)
from verispec.config import SamplingParams  # noqa: E402
from verispec.server import ServerConfig, create_app  # noqa: E402

BIAS = {int(k): v for k, v in PRINTABLE_ONLY.items()}


@pytest.fixture(scope="module")
def live():
    app = create_app(tiny_engine(), ServerConfig(served_model_names=("tiny", "tiny-alias")))
    with LiveServer(app) as server:
        yield server


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def spec_of(out) -> dict:
    s = out.stats
    return {
        "drafts": s.num_drafts,
        "drafted": s.num_draft_tokens,
        "accepted": s.num_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_acceptance_length": s.mean_acceptance_length,
        "accepted_per_pos": list(s.accepted_per_pos),
        "free_drafts": s.num_free_drafts,
        "free_drafted": s.num_free_draft_tokens,
        "free_accepted": s.num_free_accepted_tokens,
        "lossless": True,
        "warnings": [],
    }


def chat_ids(messages: list[dict]) -> list[int]:
    tok = tokenizer()
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


SAMPLED = {
    "temperature": 0.8, "top_p": 0.9, "seed": 7, "presence_penalty": 0.5, "frequency_penalty": 0.25,
}  # fmt: skip
EXTENSIONS = {"top_k": 60, "min_p": 0.01, "repetition_penalty": 1.1, "logit_bias": PRINTABLE_ONLY}


def test_completion_equals_the_engine_run_alone(client) -> None:
    prompt = "def fib(n):"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    ref = reference(tokenizer().encode(prompt), SamplingParams(temperature=0, max_tokens=12))
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == "tiny"
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason == ref.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(prompt) + 12
    assert resp.model_extra["spec"] == spec_of(ref)
    assert resp.model_extra["spec"]["drafted"] > 0


def test_every_sampling_field_reaches_the_engine(client) -> None:
    resp = client.completions.create(
        model="tiny-alias", prompt="abc", max_tokens=20, **SAMPLED, extra_body=EXTENSIONS, user="someone"
    )
    params = SamplingParams(max_tokens=20, **SAMPLED, top_k=60, min_p=0.01, repetition_penalty=1.1, logit_bias=BIAS)
    ref = reference(tokenizer().encode("abc"), params)
    assert resp.model == "tiny-alias"
    assert resp.choices[0].text == ref.text and resp.choices[0].text.isprintable()
    assert resp.model_extra["spec"] == spec_of(ref)
    # a stop string ends the text where it starts
    stop = ref.text[6:8]
    cut = client.completions.create(
        model="tiny", prompt="abc", max_tokens=20, stop=[stop], **SAMPLED, extra_body=EXTENSIONS
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == ref.text[: ref.text.index(stop)]


def test_streaming_equals_non_streaming(client) -> None:
    kw = {"model": "tiny", "prompt": "hello", "max_tokens": 24, **SAMPLED, "extra_body": EXTENSIONS}
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finishing[0].model_extra["spec"] == whole.model_extra["spec"]
    last = chunks[-1]  # stream_options.include_usage: a usage chunk with no choices ends the stream
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.model_extra["spec"] == whole.model_extra["spec"]


def test_chat_through_the_template(client) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
    ]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, temperature=0)
    plain = [messages[0], {"role": "user", "content": "Say hi"}]
    ref = reference(chat_ids(plain), SamplingParams(temperature=0, max_tokens=16))
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(chat_ids(plain))
    assert resp.model_extra["spec"] == spec_of(ref)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["spec"] == spec_of(ref)


def test_models_health_and_unknown_model(client, live) -> None:
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b"\xff\xfe\x00", 400, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "'temperature'"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be 0 (greedy) or in"),
        ("/v1/completions", {"prompt": "x", "temperature": 1e-9}, 400, "temperature=0 for greedy"),
        ("/v1/completions", {"prompt": "x", "temperature": 1e39}, 400, "temperature must be 0 (greedy) or in"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 1e39}, 400, "presence_penalty must be in"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-46}, 400, "repetition_penalty must be in"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 1e39}}, 400, "logit_bias[1] must be in"),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed must be in"),
        ("/v1/completions", {"prompt": "x\ud800"}, 400, "lone surrogate"),
        ("/v1/completions", {"prompt": "x", "stop": ["\udfff"]}, 400, "lone surrogate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]}, 400, "lone surrogate"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            400,
            "lone surrogate",
        ),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "'max_tokens'"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "at most"),
        ("/v1/completions", {"prompt": "x" * 400, "max_tokens": 200}, 400, "context"),
        ("/v1/completions", {"prompt": "x" * 600}, 400, "at most 511"),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n must be 1"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "seed": -3}, 400, "seed"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "token ids"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"9999": 1}}, 400, "outside the vocabulary"),
        ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "unrecognized request argument 'frobnicate'"),
        ("/v1/completions", {"prompt": [[1, 2], [3]]}, 400, "one prompt per request"),
        ("/v1/completions", {"prompt": [1, 999]}, 400, "outside the vocabulary"),
        ("/v1/completions", {"prompt": ""}, 400, "empty"),
        ("/v1/completions", {"max_tokens": 3}, 400, "missing required field 'prompt'"),
        ("/v1/completions", {"prompt": "x", "stream": True, "top_k": -5}, 400, "'top_k'"),
        ("/v1/chat/completions", {"messages": []}, 400, "'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "does not"),
    ],
)
def test_bad_requests_get_openai_errors(live, path: str, body, status: int, needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # lone surrogates go out escaped
    r = httpx.post(live.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"], error
    assert "pydantic" not in error["message"] and "Traceback" not in error["message"]


def test_transport_level_errors(live) -> None:
    r = httpx.post(
        f"{live.url}/v1/completions", content=b"x" * (5 * 2**20), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.get(f"{live.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(f"{live.url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_move_with_the_spec_objects(client, live) -> None:
    before = httpx.get(f"{live.url}/metrics").text
    specs, usages = [], []
    for seed in range(3):
        r = client.completions.create(
            model="tiny", prompt=f"p{seed}", max_tokens=10 + seed, **{**SAMPLED, "seed": seed}
        )
        specs.append(r.model_extra["spec"])
        usages.append(r.usage)
        for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"m{seed}"}], max_tokens=9, temperature=0.7,
            seed=seed, stream=True, stream_options={"include_usage": True},
        ):  # fmt: skip
            if not c.choices:
                specs.append(c.model_extra["spec"])
                usages.append(c.usage)
    after = httpx.get(f"{live.url}/metrics").text

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, model_name="tiny", **labels) - metric(before, name, model_name="tiny", **labels)

    assert delta("verispec:spec_decode_num_drafts_total") == sum(s["drafts"] for s in specs) > 0
    assert delta("verispec:spec_decode_num_draft_tokens_total") == sum(s["drafted"] for s in specs)
    assert delta("verispec:spec_decode_num_accepted_tokens_total") == sum(s["accepted"] for s in specs)
    for pos in range(3):
        per_pos = sum(s["accepted_per_pos"][pos] for s in specs if len(s["accepted_per_pos"]) > pos)
        assert delta("verispec:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == per_pos
    free = (("drafts", "free_drafts"), ("draft_tokens", "free_drafted"), ("accepted_tokens", "free_accepted"))
    for name, key in free:
        assert delta(f"verispec:spec_decode_num_free_{name}_total") == sum(s[key] for s in specs)
    assert delta("verispec:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("verispec:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("verispec:request_success_total") == 6
    assert delta("verispec:time_to_first_token_seconds_count") == 6
    assert delta("verispec:e2e_request_latency_seconds_count") == 6
    assert delta("verispec:inter_token_latency_seconds_count") > 0
    assert metric(after, "verispec:num_requests_running") == metric(after, "verispec:num_requests_waiting") == 0


def test_api_key() -> None:
    app = create_app(tiny_engine(max_len=64), ServerConfig(api_key="s3cret"))
    with LiveServer(app) as server:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret"},
            {"Authorization": "Basic s3cret"},
        ):
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
        assert httpx.get(f"{server.url}/metrics").status_code == 401  # scrapers do (unless --public-metrics)
        assert httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):  # the API's description is closed with a key
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 404
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        # greedy: an unseeded sample may draw the end-of-sequence token first and stop at 0 tokens
        done = good.completions.create(model="tiny-257", prompt="x", max_tokens=2, temperature=0)
        assert done.usage is not None and done.usage.completion_tokens == 2


def test_full_queue_gets_429_and_shutdown_gets_503() -> None:
    engine = tiny_engine(max_batch=1, max_len=64, cls=GatedEngine)
    app = create_app(engine, ServerConfig(max_queue=1))
    with LiveServer(app) as server:
        engine.gate.clear()  # hold the requests in flight
        results: list[httpx.Response] = []

        def send() -> None:  # (greedy: an unseeded sample may draw the end-of-sequence token before 5 tokens)
            body = {"prompt": "ab", "max_tokens": 5, "temperature": 0}
            results.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))

        threads = [threading.Thread(target=send) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: server.runner.num_live == 2, what="two requests in flight")
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 5})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert (
            metric(httpx.get(f"{server.url}/metrics").text, "verispec:requests_rejected_total", reason="queue_full")
            == 1
        )
        server.runner.begin_shutdown()  # what `verispec serve` does on SIGINT / SIGTERM
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and "retry-after" in r.headers
        assert httpx.get(f"{server.url}/health").status_code == 503
        engine.gate.set()  # the requests in flight still finish
        for t in threads:
            t.join(timeout=60)
        assert [x.status_code for x in results] == [200, 200]
        assert all(x.json()["usage"]["completion_tokens"] == 5 for x in results)
        server.stop()
        assert not server.runner.alive  # the engine thread was joined
    assert not engine.has_unfinished()


def test_a_failing_step_fails_the_requests_in_flight_and_the_server_goes_on() -> None:
    engine = tiny_engine(max_len=64, cls=GatedEngine)
    with LiveServer(create_app(engine)) as server:
        engine.fail_next = True
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 5})
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        engine.fail_next = True
        with httpx.stream("POST", f"{server.url}/v1/completions", json={"prompt": "ab", "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert s.status_code == 200 and '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 5, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert not engine.has_unfinished()
