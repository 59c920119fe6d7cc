"""The draft stop by confidence (verispec.engine.confidence): what the table learns, when the stop
ends a draft, how the policy hands it out, and that greedy output is plain decoding's with it."""

from __future__ import annotations

import pytest

from tests.tiny import ThresholdStopPolicy
from verispec.certify.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.engine.calibrate import CostTable
from verispec.engine.confidence import ConfidenceTable, CostStop
from verispec.engine.policy import FixedPolicy, MeasuredPolicy
from verispec.engine.request import Request


def requests(n: int, temperature: float = 0.0) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams(temperature=temperature), None, None, (), 100) for i in range(n)]


def flat(batch: int = 1) -> CostTable:
    return CostTable({(batch, w): 0.030 + 0.001 * w for w in (1, 2, 3, 5, 9, 17)}, context=128, key="test")


def test_the_table_learns_acceptance_per_confidence_and_kind_of_request() -> None:
    table = ConfidenceTable()
    assert table.acceptance(True, 0.97) == pytest.approx(0.965)  # a bin starts at its midpoint
    for _ in range(200):
        table.record(True, [0.99, 0.5, 0.97], accepted=1)  # confident tokens pass, the doubtful one fails
    assert table.acceptance(True, 0.99) > 0.98 and table.acceptance(True, 0.5) < 0.05
    assert table.reached[True][table.bin(0.97)] == 0  # never reached: the token before it was rejected
    assert table.acceptance(False, 0.5) == pytest.approx(0.5)  # sampled requests keep their own record
    assert 0.45 < table.pooled(True) < 0.55


def test_a_confident_draft_runs_on_and_a_doubtful_token_ends_it() -> None:
    table = ConfidenceTable()
    verify = [0.0] + [0.030 + 0.001 * w for w in range(1, 11)]
    stop = CostStop(table, [8], [True], draft_seconds=0.008, verify_seconds=verify, rate=40.0)
    assert all(stop.keep_drafting(0, i, 0.999) for i in range(1, 4))
    assert not stop.keep_drafting(0, 4, 0.3)  # the token is kept; the next one is not worth its pass
    assert stop.stopped == [True] and stop.confidences == [[0.999] * 3 + [0.3]]


def test_the_ceiling_ends_a_draft_and_the_rate_prices_its_tokens() -> None:
    table = ConfidenceTable()
    verify = [0.0] + [0.030 + 0.001 * w for w in range(1, 11)]
    stop = CostStop(table, [2, 0], [True, False], draft_seconds=0.008, verify_seconds=verify, rate=40.0)
    assert stop.keep_drafting(0, 1, 0.999) and not stop.keep_drafting(0, 2, 0.999)
    assert stop.stopped == [False, False]  # the ceiling, not the stop
    dear = CostStop(table, [8], [True], draft_seconds=0.008, verify_seconds=verify, rate=200.0)
    assert not dear.keep_drafting(0, 1, 0.999)  # at 200 tokens/s no token is worth 9 ms
    stop.settle([2, 0], [1, 0], [False, True])
    assert sum(table.reached[True]) == 2 and sum(table.reached[False]) == 0  # skipped rows teach nothing
    dropped = CostStop(table, [8], [True], draft_seconds=0.008, verify_seconds=verify, rate=40.0)
    dropped.keep_drafting(0, 1, 0.999)
    dropped.settle([0], [0], [False])  # the engine verified no draft (the drafter failed): nothing learnt
    assert sum(table.reached[True]) == 2


def test_the_policy_hands_out_a_stop_to_its_ceiling_only_where_it_drafts() -> None:
    batch = requests(3)
    policy = MeasuredPolicy(8, costs=flat(3))
    policy.draft_lengths(batch, [100, 100, 100])
    stop = policy.draft_stop(batch, [3, 0, 2], [100, 100, 5])
    assert stop is not None and stop.lengths == [8, 0, 5]
    assert policy.draft_stop(batch, [0, 0, 0], [100] * 3) is None
    assert MeasuredPolicy(8, costs=flat(3), confidence_stop=False).draft_stop(batch, [3, 3, 3], [9] * 3) is None
    assert FixedPolicy(3).draft_stop(batch, [3, 3, 3], [9] * 3) is None  # a fixed K is what was asked for


def test_a_probe_of_a_policy_that_stopped_speculating_drafts_one_token() -> None:
    batch = requests(1)
    steep = CostTable({(1, w): 0.030 * w for w in (1, 2, 3, 5, 9)}, context=128, key="test")
    policy = MeasuredPolicy(8, costs=steep, probe_every=2)
    lengths = [policy.draft_lengths(batch, [100])[0] for _ in range(4)]
    assert 0 in lengths and 1 in lengths  # off, with one-token probes
    assert policy.draft_stop(batch, [1], [100]) is None


def test_the_rate_to_beat_is_what_speculative_steps_reached() -> None:
    batch = requests(1)
    policy = MeasuredPolicy(8, costs=flat())
    policy.draft_lengths(batch, [100])
    planned = policy.draft_stop(batch, [3], [100])
    assert planned is not None and planned.rate == pytest.approx(policy._planned_rate[1])
    for _ in range(30):
        policy.observe(batch, [4], [3], draft_seconds=0.032, verify_seconds=0.048)  # 4 tokens in 80 ms
    measured = policy.draft_stop(batch, [3], [100])
    assert measured is not None and measured.rate == pytest.approx(50.0)


@pytest.mark.parametrize("drafter", ["model", "composite"])
def test_greedy_output_with_drafts_ended_by_confidence_is_plain_decodings(drafter: str) -> None:
    target, draft = tiny_pair(8)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [7]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = Engine(target, None, None, EngineConfig(max_len=256, num_draft_tokens=0)).generate(prompts, params)
    d = make_drafter(drafter, draft_model=draft, vocab_size=8, max_len=300, ngram_min=1)
    policy = ThresholdStopPolicy(5, threshold=0.6)
    outs = Engine(target, None, d, EngineConfig(max_len=256), policy=policy).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert policy.ended > 0 and policy.continued > 0  # drafts ended early, and ran on


def test_the_default_policy_stops_drafts_and_keeps_greedy_output() -> None:
    """The engine's own policy (K auto): drafts run past the length it would have chosen, or end
    early, and the output is plain decoding's."""
    target, draft = tiny_pair(8)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3]]
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = Engine(target, None, None, EngineConfig(max_len=256, num_draft_tokens=0)).generate(prompts, params)
    d = make_drafter("model", draft_model=draft, vocab_size=8, max_len=300)
    engine = Engine(target, None, d, EngineConfig(max_len=256), policy=MeasuredPolicy(8, costs=flat()))
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    policy = engine.policy
    assert isinstance(policy, MeasuredPolicy)
    assert sum(policy.confidence.reached[True]) > 0  # the table learnt from the verified drafts
