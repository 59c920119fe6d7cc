"""Two-sample certification against OpenAI-compatible endpoints, on fake servers (httpx mock
transports: no sockets, no downloads). A faithful speculative server passes against a faithful
plain one (p-values uniform over repeated runs); three deliberately broken ones are caught at the
N the test uses (a biased residual, a bonus token taken from the draft, the temperature applied
twice); the client retries 429/503,
refuses malformed answers, and never sends more requests than it was allowed. The goodness-of-fit
mode (the baseline scores by echo, the speculative arm returns token ids) passes the faithful
server, catches the broken ones with fewer samples, and refuses what it cannot score."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from scipy import stats

from verispec.certify.deployment import certify_arms, certify_fit
from verispec.certify.endpoint import EndpointError, endpoint_arm, endpoint_scorer
from verispec.config import SamplingParams

LETTERS = "abcdef"
# a Markov chain over six letters (the "target"), and a nearby one (the "draft")
TARGET = np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]] * 6) + np.eye(6) * 0.3
TARGET /= TARGET.sum(1, keepdims=True)
DRAFT = np.roll(TARGET, 1, axis=1) * 0.5 + TARGET * 0.5


def law(matrix: np.ndarray, prev: int, temperature: float) -> np.ndarray:
    logits = np.log(matrix[prev]) / temperature
    p = np.exp(logits - logits.max())
    return p / p.sum()


def sampler(broken: str | None) -> Callable[[np.random.Generator, float, int], str]:
    """One continuation of ``n`` letters from the target's law, or as a broken server draws it."""

    def draw(rng: np.random.Generator, temperature: float, n: int) -> str:
        prev, out = 0, []
        for pos in range(n):
            p = law(TARGET, prev, temperature)
            if pos == 1 and broken == "bonus-from-draft":
                p = law(DRAFT, prev, temperature)
            elif pos == 1 and broken == "biased-residual" and rng.random() < 0.3:  # residual = the draft's law
                p = law(DRAFT, prev, temperature)
            elif broken == "temperature-twice":
                p = law(TARGET, prev, temperature**2)
            prev = int(rng.choice(6, p=p))
            out.append(LETTERS[prev])
        return "".join(out)

    return draw


def fake_server(
    broken: str | None = None, *, busy: int = 0, reply: dict | None = None, echo: bool = True, shared_seed: bool = False
) -> httpx.Client:
    state = {"busy": busy, "requests": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        state["requests"] += 1
        if request.url.path != "/v1/completions":
            return httpx.Response(404, json={"error": {"message": "no such route"}})
        if state["busy"] > 0:
            state["busy"] -= 1
            return httpx.Response(429, json={"error": {"message": "slow down"}})
        if reply is not None:
            return httpx.Response(200, json=reply)
        body = json.loads(request.content)
        if body.get("echo"):  # prompt logprobs (vLLM's echo): the text "p" is the one token 0
            if not echo:
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "a"}]})
            ids = [0] if isinstance(body["prompt"], str) else body["prompt"]
            values = [None] + [math.log(law(TARGET, a, 1.0)[b]) for a, b in itertools.pairwise(ids)]
            tokens = [f"token_id:{i}" for i in [*ids, 0]]
            logprobs = {"tokens": tokens, "token_logprobs": [*values, -0.5]}
            usage = {"prompt_tokens": len(ids), "completion_tokens": 1}
            return httpx.Response(200, json={"choices": [{"text": "", "logprobs": logprobs}], "usage": usage})
        rng = np.random.default_rng(body["seed"])
        draw = sampler(broken)
        texts = [draw(rng, body["temperature"], body["max_tokens"]) for _ in range(body["n"])]
        if shared_seed:  # the n continuations of a request drawn from one seed, as llama-server does
            texts = texts[:1] * body["n"]
        choices = [{"index": i, "text": t} for i, t in enumerate(texts)]
        if body.get("return_tokens_as_token_ids"):
            for choice in choices:
                choice["logprobs"] = {"tokens": [f"token_id:{LETTERS.index(c)}" for c in choice["text"]]}
        return httpx.Response(200, json={"choices": choices})

    client = httpx.Client(transport=httpx.MockTransport(handle))
    client.state = state  # type: ignore[attr-defined]
    return client


def decode(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


def arm(client: httpx.Client, **kw):  # type: ignore[no-untyped-def]
    return endpoint_arm("http://fake:8000/v1", "m", decode, client=client, backoff=0.0, **kw)


PROMPTS = [("p", [0])]
N = 3000


def test_a_faithful_speculative_server_passes() -> None:
    report = certify_arms(arm(fake_server()), arm(fake_server()), PROMPTS, SamplingParams(temperature=0.8),
                          samples=N, tokens=2, lookahead=0)  # fmt: skip
    assert report.passed and report.detectable_tv < 0.1


@pytest.mark.parametrize("broken", ["biased-residual", "bonus-from-draft", "temperature-twice"])
def test_broken_speculative_servers_are_caught(broken: str) -> None:
    report = certify_arms(arm(fake_server()), arm(fake_server(broken)), PROMPTS, SamplingParams(temperature=0.8),
                          samples=N, tokens=2, lookahead=0)  # fmt: skip
    assert not report.passed, (broken, report.to_dict())


def test_busy_servers_are_retried_and_requests_are_bounded() -> None:
    client = fake_server(busy=2)
    out = arm(client, per_request=10)("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 20, 0)
    assert len(out) == 20 and client.state["requests"] == 4  # type: ignore[attr-defined]  (2 refusals + 2 answers)
    with pytest.raises(EndpointError, match="more than 3 requests"):
        arm(fake_server(), per_request=1, max_requests=3)("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 5, 0)
    with pytest.raises(EndpointError, match="429"):
        arm(fake_server(busy=10), retries=2)("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 2, 0)


@pytest.mark.parametrize(
    ("reply", "message"),
    [({"choices": []}, "got 0"), ({"choices": [{"text": 3}]}, "without text"), ({"nope": 1}, "got no")],
)
def test_malformed_answers_are_errors_not_samples(reply: dict, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        arm(fake_server(reply=reply), per_request=1)("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 1, 0)


@pytest.mark.parametrize("broken", [None, "biased-residual", "bonus-from-draft"])
def test_goodness_of_fit_against_the_baselines_prompt_logprobs(broken: str | None) -> None:
    scorer = endpoint_scorer("http://fake:8000/v1", "m", client=fake_server(), backoff=0.0)
    sampler = arm(fake_server(broken), per_request=4, token_ids=True)
    report = certify_fit(scorer, sampler, PROMPTS, SamplingParams(temperature=1.0), samples=1500, tokens=2,
                         lookahead=0)  # fmt: skip
    assert report.passed is (broken is None), (broken, report.to_dict())
    assert report.to_dict()["prompts"][0]["method"] == "goodness-of-fit"


def test_what_cannot_be_scored_is_refused() -> None:
    sampler = arm(fake_server(), per_request=4, token_ids=True)
    params = SamplingParams(temperature=1.0)
    no_echo = endpoint_scorer("http://fake:8000/v1", "m", client=fake_server(echo=False), backoff=0.0)
    sampling = fake_server()
    with pytest.raises(EndpointError, match="did not return prompt logprobs"):
        certify_fit(no_echo, arm(sampling, per_request=4, token_ids=True), PROMPTS, params, samples=20, tokens=2)
    assert sampling.state["requests"] == 0  # type: ignore[attr-defined]  (refused before any sampling)
    scorer = endpoint_scorer("http://fake:8000/v1", "m", client=fake_server(), backoff=0.0)
    with pytest.raises(EndpointError, match="temperature 1"):
        certify_fit(scorer, sampler, PROMPTS, SamplingParams(temperature=0.8), samples=20, tokens=2, lookahead=0)
    text_only = arm(fake_server(reply={"choices": [{"text": "ab"}]}), per_request=1, token_ids=True)
    with pytest.raises(EndpointError, match="no token ids"):
        text_only("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 1, 0)


def test_concurrent_requests_draw_what_sequential_ones_draw() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=3)
    alone = arm(fake_server(), per_request=1)("p", [0], params, 40, 7)
    together = arm(fake_server(), per_request=1, concurrency=8)("p", [0], params, 40, 7)
    assert together == alone and len(set(alone)) > 5


def test_continuations_drawn_from_one_seed_make_the_run_not_valid() -> None:
    shared = [arm(fake_server(shared_seed=True), per_request=4) for _ in range(2)]
    report = certify_arms(*shared, PROMPTS, SamplingParams(temperature=0.8), samples=400, tokens=2, lookahead=0)
    assert not report.valid and report.correlated == ["'p' (baseline)", "'p' (speculative)"]
    fine = certify_arms(arm(fake_server(), per_request=4), arm(fake_server(), per_request=4), PROMPTS,
                        SamplingParams(temperature=0.8), samples=400, tokens=2, lookahead=0)  # fmt: skip
    assert fine.valid and fine.to_dict()["prompts"][0]["independence_p"]["speculative"] > 1e-4


def test_p_values_of_repeated_runs_between_faithful_servers_are_uniform() -> None:
    ps = []
    for run in range(60):
        arms = (arm(fake_server(), per_request=8), arm(fake_server(), per_request=8))
        params = SamplingParams(temperature=0.8)
        report = certify_arms(*arms, PROMPTS, params, samples=240, tokens=2, lookahead=0, seed=run)
        ps.append(report.p_value)
    assert stats.kstest(ps, "uniform").pvalue > 1e-3
    assert np.mean(np.array(ps) < 0.05) <= 0.12


def test_every_sampling_setting_is_sent() -> None:
    bodies = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})

    client = httpx.Client(transport=httpx.MockTransport(handle))
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.3,
                            frequency_penalty=0.2, repetition_penalty=1.1, max_tokens=4)  # fmt: skip
    arm(client, per_request=1)("p", [0], params, 1, 11)
    (body,) = bodies
    assert body["seed"] == 11 and body["n"] == 1 and body["max_tokens"] == 4 and body["top_k"] == 5
    assert body["presence_penalty"] == 0.3 and body["frequency_penalty"] == 0.2 and body["repetition_penalty"] == 1.1


def test_an_endless_answer_is_refused_not_read() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=(b"x" * (1 << 20) for _ in range(64)))  # 64 MiB, streamed

    client = httpx.Client(transport=httpx.MockTransport(handle))
    with pytest.raises(EndpointError, match="more than 8 MiB"):
        arm(client, per_request=1)("p", [0], SamplingParams(temperature=1.0, max_tokens=2), 1, 0)
