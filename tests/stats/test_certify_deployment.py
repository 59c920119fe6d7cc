"""Two-sample certification of a deployment, on tiny transformers built in code: plain against
speculative decoding passes; a broken speculative arm (every draft accepted) and a temperature
applied twice are caught at the same N; the report says what the run could detect."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.tiny import tiny_pair
from verispec.certify.deployment import certify_arms, engine_arm
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.verify.broken import AlwaysAcceptRule

VOCAB = 16
PROMPTS = [("a", [1, 2, 3]), ("b", [5, 5, 7, 1])]
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def arms():  # type: ignore[no-untyped-def]
    target, draft = tiny_pair(VOCAB)
    plain = Engine(target, None, None, EngineConfig(max_batch=64, max_len=64, num_draft_tokens=0))

    def spec(rule=None):  # type: ignore[no-untyped-def]
        d = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=64, max_len=80)
        e = Engine(target, None, d, EngineConfig(max_batch=64, max_len=64, num_draft_tokens=3))
        if rule is not None:
            e.rule = rule
        return e

    return plain, spec


def test_speculative_decoding_passes_and_says_what_it_could_detect(arms) -> None:  # type: ignore[no-untyped-def]
    plain, spec = arms
    arms_ = (engine_arm(plain, 64), engine_arm(spec(), 64))
    report = certify_arms(*arms_, PROMPTS, PARAMS, samples=1000, tokens=2, lookahead=4)
    assert report.passed, report.to_dict()
    assert 0.0 < report.detectable_tv < 0.3
    out = report.to_dict()
    assert out["samples_per_arm"] == 1000 and len(out["prompts"]) == 2 and out["prompts"][0]["distinct"] > 1


@pytest.mark.parametrize("broken", ["always-accept", "temperature-twice"])
def test_broken_deployments_are_caught(arms, broken: str) -> None:  # type: ignore[no-untyped-def]
    plain, spec = arms
    if broken == "always-accept":
        arm = engine_arm(spec(AlwaysAcceptRule()), 64)
    else:  # the speculative server applies the temperature twice: T = 0.7 becomes 0.49
        inner = engine_arm(spec(), 64)

        def arm(text, prompt, params, n, seed):  # type: ignore[no-untyped-def]
            return inner(text, prompt, replace(params, temperature=params.temperature**2), n, seed)

    params = replace(PARAMS, temperature=0.7)
    report = certify_arms(engine_arm(plain, 64), arm, PROMPTS, params, samples=1000, tokens=2, lookahead=4)
    assert not report.passed, report.to_dict()


def test_bad_settings_are_refused(arms) -> None:  # type: ignore[no-untyped-def]
    plain, _ = arms
    with pytest.raises(ConfigError, match="temperature"):
        certify_arms(engine_arm(plain), engine_arm(plain), PROMPTS, SamplingParams(temperature=0), samples=10, tokens=2)
    with pytest.raises(ConfigError):
        certify_arms(engine_arm(plain), engine_arm(plain), PROMPTS, PARAMS, samples=1, tokens=2)
