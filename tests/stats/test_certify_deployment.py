"""Two-sample certification of a deployment, on tiny transformers built in code: plain against
speculative decoding passes; a broken speculative arm (every draft accepted) and a temperature
applied twice are caught at the same N; the report says what the run could detect. The
goodness-of-fit mode: the target's scores are its exact law, speculative samples pass against
them and a broken arm fails."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.tiny import tiny_pair
from verispec.certify.deployment import certify_arms, certify_fit, engine_arm, engine_scorer
from verispec.certify.exact import exact_prefix_law_lm
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


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.8, frequency_penalty=0.5)],
)
def test_the_engine_scorer_gives_the_exact_law(arms, params: SamplingParams) -> None:  # type: ignore[no-untyped-def]
    plain, _ = arms
    outcomes = [(a, b) for a in range(VOCAB) for b in range(VOCAB)]
    scores = engine_scorer(plain)("b", PROMPTS[1][1], outcomes, params, 2)
    law = exact_prefix_law_lm(plain.target, params, PROMPTS[1][1], 2, vocab_limit=VOCAB)  # base-V indexed
    assert np.allclose(scores, law, atol=1e-6) and sum(scores) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("broken", [None, "always-accept"])
def test_goodness_of_fit_against_the_targets_scores(arms, broken: str | None) -> None:  # type: ignore[no-untyped-def]
    plain, spec = arms
    sampler = engine_arm(spec(AlwaysAcceptRule() if broken else None), 64)
    report = certify_fit(engine_scorer(plain), sampler, PROMPTS, PARAMS, samples=1000, tokens=2, lookahead=4)
    out = report.to_dict()
    assert report.passed is (broken is None), out
    assert out["mode"] == "goodness-of-fit" and out["pilot"] == 250 and out["prompts"][0]["n_a"] == 0
    if broken is None:  # the baseline adds no noise: finer than the two-sample test's ~0.1 at 1000 per arm
        assert 0.0 < report.detectable_tv < 0.1


def test_outcomes_cut_short_by_a_stop_carry_the_stops_probability(arms) -> None:  # type: ignore[no-untyped-def]
    plain, _ = arms
    stopping = Engine(plain.target, None, None, EngineConfig(max_batch=4, max_len=64), eos_token_ids=(3, 9))
    kept = [t for t in range(VOCAB) if t not in (3, 9)]
    outcomes = [(), *[(a,) for a in kept], *[(a, b) for a in kept for b in kept]]  # every way two tokens can end
    scores = engine_scorer(stopping)("b", PROMPTS[1][1], outcomes, PARAMS, 2)
    assert sum(scores) == pytest.approx(1.0, abs=1e-6)
    law = exact_prefix_law_lm(plain.target, PARAMS, PROMPTS[1][1], 1, vocab_limit=VOCAB)
    assert scores[0] == pytest.approx(law[3] + law[9], abs=1e-7)  # (): the first token was a stop
