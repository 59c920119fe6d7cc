"""Hypothesis throws malformed and odd request bodies at the server: never a 5xx, always an
OpenAI-style error body for a refusal, and a well-formed answer otherwise."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.serving import tiny_engine
from verispec.server import ServerConfig, create_app

PATHS = ["/v1/completions", "/v1/chat/completions"]
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "stop", "stream",
    "stream_options", "n", "user", "logprobs", "echo", "best_of", "tools", "response_format", "ignore_eos", "extra",
]  # fmt: skip
NUMERIC = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "seed", "max_tokens"]  # fmt: skip
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
numbers = st.one_of(
    st.floats(0.0, 2.0),
    st.integers(0, 64),
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 1e-300, 5e-324, 1e308, 2**63, 2**31, 0.5, 100.0, math.inf, -math.inf, math.nan]),
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
            "content": st.text(max_size=20) | json_values,
        }
    ),
    max_size=3,
)


@pytest.fixture(scope="module")
def client():
    app = create_app(tiny_engine(max_batch=4, max_len=96), ServerConfig(max_tokens_limit=3, max_body_bytes=1 << 16))
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
        yield c


def check(r) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        assert "Traceback" not in error["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
        assert not any('"error"' in e for e in events), events
    else:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length") and "spec" in body


def post(client, path: str, body: object) -> None:
    text = json.dumps(body)  # NaN and Infinity go out as JSON's non-standard literals, as some clients send them
    check(client.post(path, content=text, headers={"content-type": "application/json"}))


@SETTINGS
@given(path=st.sampled_from(PATHS), raw=st.binary(max_size=300))
def test_raw_bytes(client, path: str, raw: bytes) -> None:
    check(client.post(path, content=raw, headers={"content-type": "application/json"}))


@SETTINGS
@given(path=st.sampled_from(PATHS), body=json_values)
def test_any_json_value(client, path: str, body: object) -> None:
    post(client, path, body)


@SETTINGS
@given(path=st.sampled_from(PATHS), fields=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
def test_odd_values_in_known_fields(client, path: str, fields: dict) -> None:
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    post(client, path, base | fields)


@SETTINGS
@given(
    path=st.sampled_from(PATHS),
    params=st.dictionaries(st.sampled_from(NUMERIC), numbers, max_size=5),
    prompt=st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 300), max_size=8)),
    chat=messages,
    stream=st.booleans(),
)
def test_sampling_parameters_at_the_edges(client, path: str, params: dict, prompt, chat, stream: bool) -> None:
    body = {"prompt": prompt} if path == "/v1/completions" else {"messages": chat}
    post(client, path, body | params | {"stream": stream})


valid_params = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 1e-3, 1e3]) | st.floats(1e-3, 10.0),
        "top_p": st.sampled_from([1e-300, 1.0]) | st.floats(0.0, 1.0, exclude_min=True),
        "top_k": st.integers(-1, 400),
        "min_p": st.floats(0.0, 1.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.floats(0.01, 100.0),
        "seed": st.integers(0, 2**63 - 1),
        "logit_bias": st.dictionaries(st.integers(0, 256).map(str), st.floats(-100.0, 100.0), max_size=40),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "max_tokens": st.integers(1, 3),
    },
)


@SETTINGS
@given(path=st.sampled_from(PATHS), params=valid_params, text=st.text(min_size=1, max_size=30), stream=st.booleans())
def test_valid_requests_with_extreme_parameters_are_answered(client, path: str, params: dict, text: str, stream):
    body = {"prompt": text} if path == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    r = client.post(path, json=body | params | {"stream": stream})
    assert r.status_code == 200, r.text
    check(r)


unicode_text = st.text(st.characters(codec=None, categories=None) | st.characters(categories=["Cs"]), max_size=12)


@SETTINGS
@given(
    path=st.sampled_from(PATHS), text=unicode_text, stop=st.lists(unicode_text, max_size=2), name=unicode_text,
    stream=st.booleans(),
)  # fmt: skip
def test_any_unicode_text_including_lone_surrogates_never_gets_a_5xx(client, path, text, stop, name, stream) -> None:
    if path == "/v1/completions":
        body: dict = {"prompt": text, "stop": stop, "user": name}
    else:
        body = {"messages": [{"role": "user", "content": text, "name": name}], "stop": stop}
    post(client, path, body | {"max_tokens": 2, "stream": stream})


@SETTINGS
@given(
    host=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30),
    content_type=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
)
def test_odd_host_and_content_type_headers_never_get_a_5xx(client, host: str, content_type: str) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    r = client.post("/v1/completions", content=body, headers={"host": host, "content-type": content_type})
    check(r)
