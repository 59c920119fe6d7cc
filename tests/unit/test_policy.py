"""The draft-length policy decides from measurements: flat verification + good acceptance -> speculate;
compute-bound verification or an expensive drafter -> K = 0 (with occasional probes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from verispec.analysis import TreePlan
from verispec.certify.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.engine import calibrate as calib
from verispec.engine.calibrate import CostTable, load_or_calibrate
from verispec.engine.policy import FixedPolicy, MeasuredPolicy, TreePolicy
from verispec.engine.request import Request


def requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2], SamplingParams(), None, None, (), 100) for i in range(n)]


def feed(policy: MeasuredPolicy, batch: list[Request], accept_prob: float, steps: int = 50) -> None:
    """Teach the policy an acceptance rate: every position accepted with accept_prob (deterministic)."""
    k = 4
    for step in range(steps):
        accepted = [min(k, int(accept_prob * k + (step % 2) * 0.5)) for _ in batch]
        policy.observe(batch, [k] * len(batch), accepted, draft_seconds=k * 0.09, verify_seconds=0.1)


def costs(verify: dict[int, float], batch: int = 1) -> CostTable:
    return CostTable({(batch, w): s for w, s in verify.items()}, context=128, key="test")


def test_flat_verification_and_good_acceptance_speculates() -> None:
    policy = MeasuredPolicy(8, costs=costs({1: 0.10, 2: 0.10, 3: 0.10, 5: 0.105, 9: 0.11}))
    batch = requests(1)
    feed(policy, batch, 0.9)
    policy.draft_pass.clear()
    policy.draft_pass[1].update(0.01)  # c = 0.1
    assert policy.draft_lengths(batch, [100])[0] >= 3


def test_high_acceptance_at_k_1_makes_longer_drafts_worth_trying() -> None:
    """Positions never reached start from the acceptance pooled over positions: after many
    one-token drafts all accepted, the policy tries longer drafts (a fixed 0.6 prior for position
    2 kept it at K = 1)."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.035, 2: 0.036, 3: 0.038, 4: 0.041, 5: 0.044, 9: 0.06}))
    batch = requests(1)
    for _ in range(60):
        policy.observe(batch, [1], [1], draft_seconds=0.013, verify_seconds=0.036)
    assert policy.acceptance("r0")[1] > 0.95 and policy.reached[1] == 0
    assert policy.draft_lengths(batch, [100])[0] >= 3
    for _ in range(40):  # and what position 2 then does is what counts: here, always rejected
        policy.observe(batch, [3], [1], draft_seconds=0.039, verify_seconds=0.041)
    assert policy.acceptance("r0")[1] < 0.3 and policy.draft_lengths(batch, [100])[0] <= 1


def test_the_price_of_a_pass_is_calibrated_or_measured_at_that_width() -> None:
    """With a calibration, any width is priced from it; without one, only a width real steps ran
    (a width-3 step's time is no price of a one-token step)."""
    batch = requests(1)
    calibrated = MeasuredPolicy(4, costs=costs({1: 0.03, 3: 0.04}))
    assert calibrated.pass_seconds(1, 1) == pytest.approx(0.03)
    measured = MeasuredPolicy(4)
    assert measured.pass_seconds(1, 1) is None
    measured.observe(batch, [2], [2], draft_seconds=0.02, verify_seconds=0.05)  # a pass over 3 tokens
    assert measured.pass_seconds(1, 1) is None and measured.pass_seconds(1, 3) == pytest.approx(0.05)


@pytest.mark.parametrize("key_seconds", [1e-6, 0.0])
def test_a_long_context_is_priced_as_attention_not_as_a_slow_machine(key_seconds: float) -> None:
    """Real steps over 9 tokens at 2000 cached tokens cost the calibration (64 cached) plus
    attention over the 1936 extra keys; the policy that knows what a key costs prices a one-token
    step there at its own 1 x 1936 keys, and at the calibration's context at the calibration's
    price. Without that term (the control) the long steps read as a machine 33% slower, and a
    one-token step is priced that much dearer at every context."""
    table = CostTable({(1, 1): 0.040, (1, 9): 0.052}, context=64, key="test", key_seconds=key_seconds)
    policy = MeasuredPolicy(8, costs=table)
    batch = [Request("r0", list(range(2000)), SamplingParams(), None, None, (), 100)]
    real = 0.052 + 1e-6 * 9 * (2000 - 64)
    for _ in range(30):
        policy.observe(batch, [8], [8], draft_seconds=0.08, verify_seconds=real)
    long_step, short_step = policy.pass_seconds(1, 1, 2000), policy.pass_seconds(1, 1, 64)
    assert long_step is not None and short_step is not None
    assert policy.pass_seconds(1, 9, 2000) == pytest.approx(real, rel=1e-3)
    if key_seconds:
        assert long_step == pytest.approx(0.040 + 1e-6 * 1936, rel=1e-3)
        assert short_step == pytest.approx(0.040, rel=1e-3)
    else:
        assert short_step == long_step == pytest.approx(0.040 * real / 0.052, rel=1e-3)


def test_the_calibration_measures_what_a_cached_key_costs_on_the_kernels(tmp_path: Path) -> None:
    """A model on the kernels gets its attention cost per (row, key) from the calibration (a
    figure, not a judgement of its size: timings are no test), kept in the cached table; a model
    off the kernels gets none."""
    from tests.integration.test_batch_invariance import config
    from tests.kernels import require_kernels
    from verispec.models.transformer import Transformer, random_state_dict

    require_kernels()
    model = Transformer(config(), random_state_dict(config(), seed=0), dtype=torch.bfloat16, cpu_kernels=True)
    table = load_or_calibrate(model, "tiny-kernels", tmp_path, widths=(1, 3), context=16)
    assert table.key_seconds >= 0.0 and math.isfinite(table.key_seconds)
    assert load_or_calibrate(model, "tiny-kernels", tmp_path, widths=(1, 3), context=16) == table
    assert CostTable.from_dict(table.as_dict()) == table
    assert calib.attention_key_seconds(tiny_pair()[0], 3, 16) == 0.0


def test_compute_bound_verification_turns_speculation_off() -> None:
    linear = {1: 0.10, 2: 0.20, 3: 0.30, 5: 0.50, 9: 0.90}  # cost grows with every verified token
    policy = MeasuredPolicy(8, costs=costs(linear))
    batch = requests(1)
    policy.draft_pass[1].update(0.01)
    assert policy.draft_lengths(batch, [100]) == [0]


def test_expensive_drafter_turns_speculation_off_and_probes() -> None:
    policy = MeasuredPolicy(8, costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}), probe_every=4)
    batch = requests(2)
    feed(policy, batch, 0.1)  # rarely accepted, and drafting costs 0.09 s a token against 0.1 s a pass
    ks = [policy.draft_lengths(batch, [100, 100])[0] for _ in range(8)]
    assert ks == [0, 0, 0, 1, 1, 0, 0, 1]  # off, with a probe every 4th step, on two steps after the first


def test_a_draft_cost_inflated_by_one_slow_step_is_measured_again() -> None:
    """One slow draft step (a warm-up, a busy neighbour) priced the draft at 5x its cost and turned
    speculation off. Probes then draft one token; the first step of each catches the drafter up on
    what was committed meanwhile (the engine passes no draft time for it), the second drafts in
    steady state and measures the draft again: speculation comes back."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.04, 2: 0.042, 3: 0.046, 5: 0.06, 9: 0.1}), probe_every=4)
    batch = requests(1)
    policy.observe(batch, [2], [2], draft_seconds=2 * 0.06, verify_seconds=0.046)  # 60 ms a draft pass
    ks = []
    for _ in range(60):
        k = policy.draft_lengths(batch, [100])[0]
        ks.append(k)
        steady = k > 0 and ks[-2:-1] == [k]  # (a probe's first step is a catch-up: no draft time)
        policy.observe(batch, [k], [k], draft_seconds=k * 0.012 if steady else None, verify_seconds=0.04 + 0.002 * k)
    assert ks[0] == 0 and ks[-10:].count(0) == 0  # off after the slow step, then back on for good


def test_budget_caps_the_draft() -> None:
    assert FixedPolicy(5).draft_lengths(requests(3), [10, 2, -1]) == [5, 2, 0]


def test_calibration_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = tiny_pair(8)
    seen: list[tuple[str, int, int]] = []
    table = load_or_calibrate(
        target, "tiny", tmp_path, batch_sizes=(1, 2), widths=(1, 3), repeats=1, context=8,
        progress=lambda *event: seen.append(event),
    )  # fmt: skip
    assert set(table.seconds) == {(1, 1), (1, 3), (2, 1), (2, 3)}
    # progress after the prefill and after every pass (a warm-up and one timed pass per point)
    assert seen == [("calibrate", i, 9) for i in range(1, 10)]
    assert all(s > 0 for s in table.seconds.values())
    assert table.relative(1)[1] == 1.0

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("should come from the cache")

    monkeypatch.setattr(calib, "calibrate", boom)
    again = load_or_calibrate(target, "tiny", tmp_path)
    assert again.seconds == table.seconds


def test_calibration_times_every_width_in_each_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow spell of a shared machine must slow all widths alike, not the one timed then."""
    target, _ = tiny_pair(8)
    shapes: list[tuple[int, ...]] = []
    forward = target.forward

    def logged(tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        shapes.append(tuple(tokens.shape))
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(target, "forward", logged)
    calib.calibrate(target, batch_sizes=(1, 2), widths=(1, 3), repeats=2, context=8)
    assert shapes[1:] == [(1, 1), (1, 3), (2, 1), (2, 3)] * 3  # after the prefill: round by round


def test_calibration_keeps_each_widths_fastest_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A neighbour on a shared machine only slows a pass: two slow rounds out of three must not
    set a width's price (their median would)."""
    target, _ = tiny_pair(8)
    clock = [0.0]
    durations = iter([0.5, 9.0, 9.0, 0.05, 0.02, 0.01, 0.03, 0.06, 0.04])  # prefill, warm-up, 3 rounds of widths 1, 3
    forward = target.forward

    def timed(tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        clock[0] += next(durations)
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(target, "forward", timed)
    monkeypatch.setattr(calib.time, "perf_counter", lambda: clock[0])
    table = calib.calibrate(target, widths=(1, 3), repeats=3, context=8)
    assert table.seconds == pytest.approx({(1, 1): 0.01, (1, 3): 0.02})


def test_a_catch_up_pass_is_no_sample_of_the_draft_cost() -> None:
    """Draft time spent feeding a prompt, or tokens committed while speculation was off, must not
    teach the policy that drafting is expensive (it would switch itself off for good)."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.10, 2: 0.10, 5: 0.105}))
    batch = requests(1)
    policy.observe(batch, [1], [1], draft_seconds=None, verify_seconds=0.1)
    assert policy.draft_pass[1].value is None
    policy.observe(batch, [2], [2], draft_seconds=0.02, verify_seconds=0.1)
    assert policy.draft_pass[1].value == pytest.approx(0.01)


def test_engine_reports_catch_up_only_for_prompts_and_lagging_drafts() -> None:
    from verispec.config import EngineConfig
    from verispec.drafters.registry import make_drafter
    from verispec.engine import Engine

    target, draft = tiny_pair(8)
    drafter = make_drafter("model", draft_model=draft, vocab_size=8, max_len=300)
    engine = Engine(target, None, drafter, EngineConfig(max_len=256, num_draft_tokens=3))
    engine.add_request(list(range(8)) * 3, SamplingParams(temperature=0, max_tokens=12))
    seen = []
    while engine.has_unfinished():
        engine.step()
        if engine.steps and engine.steps[-1].num_passes > 0:
            seen.append(drafter.last_catchup_tokens)  # type: ignore[union-attr]
    assert seen[0] == 25  # the prompt and the token the prefill produced
    assert all(n <= 2 for n in seen[1:])  # steady state: the last token, plus one after a full acceptance


def test_calibration_of_a_model_on_the_kernels_is_keyed_by_their_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cost table measured on torch's path must not steer a model on verispec's kernels (and a
    change of the kernels' sources measures anew)."""
    from verispec.kernels import build

    target, _ = tiny_pair(8)
    plain = calib.fingerprint(target, "tiny")
    target.cpu_kernels = True
    monkeypatch.setattr(build, "build_key", lambda: "sources-a")
    on_kernels = calib.fingerprint(target, "tiny")
    monkeypatch.setattr(build, "build_key", lambda: "sources-b")
    assert len({plain, on_kernels, calib.fingerprint(target, "tiny")}) == 3


# ------------------------------------------------------------------------------- trees (TreePolicy)
def tree_steps(policy: TreePolicy, batch: list[Request], ranks: list[int | None], steps: int = 40) -> None:
    """Teach the tree policy which child is accepted: three children of the root, the accepted
    one by the ranks in turn (None: none accepted)."""
    parents = [-1, -1, -1]
    for step in range(steps):
        rank = ranks[step % len(ranks)]
        path = [] if rank is None else [rank]  # the rank-th root child, none of its children
        trees = [(parents, path)] * len(batch)
        policy.observe(batch, [3] * len(batch), [len(path)] * len(batch), 0.02, 0.1, trees)


def test_positional_acceptance_moves_from_the_prior_to_what_was_accepted() -> None:
    policy = TreePolicy(16, 4, prior=(0.6, 0.1), costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}))
    batch = requests(1)
    assert policy.positional()[:3] == pytest.approx([0.6, 0.1, 0.0])
    tree_steps(policy, batch, [1, 1, 1, None], steps=400)  # the second child, three steps in four
    p = policy.positional()
    assert p[1] == pytest.approx(0.75, abs=0.02) and p[0] < 0.02  # (the first child is never the accepted one)
    assert policy.positional("r0")[1] == pytest.approx(p[1], abs=0.05)


def test_a_flat_pass_buys_a_wide_tree_a_steep_one_a_chain_or_nothing() -> None:
    batch = requests(1)
    flat = TreePolicy(
        16, 6, prior=(0.5, 0.25, 0.1), costs=costs({1: 0.10, 2: 0.10, 3: 0.10, 5: 0.10, 9: 0.10, 17: 0.10})
    )
    flat.draft_pass[1].update(0.002)
    depth = flat.draft_lengths(batch, [100])[0]
    (shape,) = flat.tree_shapes(batch, [depth])
    assert shape is not None and len(shape) == 16 and depth == TreePlan(shape, 0.0).depth
    assert shape.count(-1) >= 2  # several children at the root
    steep = TreePolicy(16, 6, prior=(0.5, 0.25, 0.1), costs=costs({1: 0.1, 2: 0.11, 3: 0.13, 5: 0.2, 9: 0.4, 17: 0.8}))
    steep.draft_pass[1].update(0.002)
    depth = steep.draft_lengths(batch, [100])[0]
    (small,) = steep.tree_shapes(batch, [depth])
    assert small is not None and len(small) < 4  # (one node: 1.5 tokens for 0.112 s beats every tree here)
    costly = TreePolicy(16, 6, prior=(0.3,), costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}), probe_every=4)
    costly.draft_pass[1].update(0.09)  # a draft level costs nearly a target pass: never pays at p_1 = 0.3
    depths = [costly.draft_lengths(batch, [100])[0] for _ in range(8)]
    assert depths == [0, 0, 0, 1, 1, 0, 0, 1]  # off, with a one-node probe every 4th step, on two steps
    assert costly.tree_shapes(batch, [1]) == [(-1,)]


def test_a_tree_plan_fits_the_budget() -> None:
    policy = TreePolicy(16, 6, prior=(0.7, 0.2), costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1, 17: 0.1}))
    policy.draft_pass[1].update(0.001)
    batch = requests(2)
    depths = policy.draft_lengths(batch, [3, 0])
    shapes = policy.tree_shapes(batch, depths)
    assert depths[1] == 0 and shapes[1] is None
    assert shapes[0] is not None and len(shapes[0]) <= 3 and depths[0] <= 3


def test_tree_auto_greedy_equals_plain_greedy() -> None:
    target, draft = tiny_pair(8)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [7]]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = Engine(target, None, None, EngineConfig(max_len=256, num_draft_tokens=0)).generate(prompts, params)
    d = make_drafter("tree", draft_model=draft, vocab_size=8, max_len=300, tree=TreeShape(6, 2, 2, 16))
    policy = TreePolicy(16, 6, costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1, 17: 0.1}))
    e = Engine(target, None, d, EngineConfig(max_len=256, max_draft_tokens=16), policy=policy)
    outs = e.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
    assert sum(policy.rank_reached) > 0  # the policy saw the trees the rule walked
    assert any(len(r) > 1 and r[1] > 0 for r in [o.stats.rank_reached for o in outs])  # wider than a chain


def test_estimates_that_round_past_one_still_plan() -> None:
    policy = TreePolicy(16, 6, prior=(0.7655, 0.1455, 0.0575, 0.0295), costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1}))
    policy.draft_pass[1].update(0.001)
    assert policy.draft_lengths(requests(1), [100])[0] > 0  # (rounded to the percent these would sum past 1)


def test_one_early_rejection_does_not_hold_the_draft_at_one_token() -> None:
    """Position 2 rejected at the first step, then one-token drafts all accepted: position 2's
    estimate follows the pooled acceptance back up and longer drafts are tried again (shrunk
    towards position 1's prior-laden estimate instead, it stayed near 0.5 and K at 1)."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.030, 2: 0.032, 3: 0.033, 5: 0.035, 9: 0.05}))
    batch = requests(1)
    policy.observe(batch, [2], [1], draft_seconds=0.02, verify_seconds=0.032)  # position 2 rejected
    for _ in range(12):
        policy.observe(batch, [1], [1], draft_seconds=0.008, verify_seconds=0.032)
    assert policy.acceptance("r0")[1] > 0.75
    assert policy.draft_lengths(batch, [100])[0] >= 2


def test_positions_keep_their_own_record_once_it_is_long() -> None:
    """Pooling is a prior, not a rule: a position rejected every time it is reached ends low
    whatever the others do (negative control of the pooled estimate)."""
    policy = MeasuredPolicy(8)
    batch = requests(1)
    for _ in range(100):
        policy.observe(batch, [3], [1], draft_seconds=0.03, verify_seconds=0.04)  # 1 accepted, then rejected
    a = policy.acceptance("r0")
    assert a[0] > 0.95 and a[1] < 0.1


def test_the_calibrated_curve_is_rescaled_to_how_fast_real_steps_run() -> None:
    """A calibration cached in a slower minute: real two-token passes run 25% faster than it says.
    The curve's shape stays the calibration's, its level follows the real steps: plain decoding
    and longer drafts are rescaled too, so the measured width does not look cheap beside the
    others (it held a run at K = 1)."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.030, 2: 0.032, 3: 0.033, 5: 0.035, 9: 0.05}))
    batch = requests(1)
    for _ in range(20):
        policy.observe(batch, [1], [1], draft_seconds=0.006, verify_seconds=0.024)
    assert policy._verify_cost(1, 2) == pytest.approx(0.024, rel=0.01)
    assert policy._verify_cost(1, 1) == pytest.approx(0.030 * 0.75, rel=0.01)
    assert policy._verify_cost(1, 3) == pytest.approx(0.033 * 0.75, rel=0.01)
    assert policy.draft_lengths(batch, [100])[0] >= 3
    # between and past the calibrated batch sizes: linear, then proportional
    two = MeasuredPolicy(8, costs=CostTable({(1, 1): 0.03, (1, 2): 0.03, (4, 1): 0.06, (4, 2): 0.06}, 128, "t"))
    assert two._verify_cost(2, 1) == pytest.approx(0.04)
    assert two._verify_cost(8, 2) == pytest.approx(0.12)


def test_a_lookup_only_step_is_no_sample_of_the_draft_models_cost() -> None:
    """A composite step drafted by its lookup ran no model pass: its near-zero draft time must not
    pull the policy's estimate of a model pass down (which would make long model drafts look
    free); a mixed step's time is divided by the model passes it ran, not by its longest draft."""
    from verispec.engine.recorder import StepRecord

    lookup_only = StepRecord(1, 8, [8], [3], 0.0001, 0.1, draft_passes=0)
    assert lookup_only.passes == 0 and lookup_only.draft_sample is None
    mixed = StepRecord(2, 8, [8, 2], [3, 1], 0.02, 0.1, draft_passes=2)
    assert mixed.passes == 2 and mixed.draft_sample == 0.02
    assert StepRecord(1, 3, [3], [1], 0.03, 0.1).passes == 3  # a drafter that does not say: its longest draft
    policy = MeasuredPolicy(8, costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}))
    batch = requests(2)
    policy.observe(batch, [8, 2], [3, 1], mixed.draft_sample, 0.1, None, mixed.passes)
    assert policy.draft_pass[2].value == pytest.approx(0.01)  # 0.02 s over 2 passes, not over 8
    policy.observe(batch, [8, 0], [3, 0], lookup_only.draft_sample, 0.1, None, lookup_only.passes)
    assert policy.draft_pass[2].value == pytest.approx(0.01)  # unchanged


def test_a_lookups_drafts_are_kept_out_of_the_models_acceptance() -> None:
    """The acceptance the policy expects is that of the drafts K schedules (the model's): a
    composite's lookup rows, drafted for free and to their own length, do not move it."""
    policy = MeasuredPolicy(8, costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}))
    batch = requests(2)
    before = policy.acceptance("r0")
    for _ in range(10):  # lookups rejected at once in row 0; the model's draft in row 1 accepted whole
        policy.observe(batch, [8, 2], [0, 2], 0.01, 0.1, None, 2, [True, False])
    assert policy.reached[0] == 10 and policy.passed[0] == 10  # row 1's first positions only
    assert "r0" not in policy.per_request or sum(policy.per_request["r0"][0]) == 0
    assert policy.acceptance("r1")[0] > before[0]


def test_free_drafts_widen_the_pass_only_while_it_stays_about_as_cheap() -> None:
    """A lookup's tokens cost no draft pass but widen the target's: at one row, memory-bound (a
    flat curve), they may run to max_k whatever K is; at eight rows, compute-bound (cost
    proportional to width), not past the pass the policy planned, and not at all when it planned
    none; a curve 40% dearer at 9 tokens than at 1 lets them go as far as 25% dearer at one row,
    6.25% at four."""
    flat = MeasuredPolicy(8, costs=costs({1: 0.1, 2: 0.1, 3: 0.1, 5: 0.1, 9: 0.1}))
    assert flat.ceilings([8], [0]) == [8] and flat.ceilings([3], [2]) == [3]  # (the row's budget binds)
    bound = MeasuredPolicy(8, costs=CostTable({(8, w): 0.05 * w for w in (1, 2, 3, 5, 9)}, 128, "t"))
    assert bound.ceilings([8] * 8, [0] * 8) == [0] * 8
    assert bound.ceilings([8] * 8, [2] * 8) == [2] * 8
    steep = MeasuredPolicy(8, costs=costs({1: 0.10, 2: 0.10, 3: 0.105, 5: 0.115, 9: 0.14}))
    assert steep.ceilings([8], [0]) == [5]  # a pass of 1 + 5 tokens: 0.121 s; of 7: 0.1275 s, past 1.25 x 0.1
    # four rows share the pass: the 25% is shared among them (every row pays, a lookup gains its own)
    shared = MeasuredPolicy(8, costs=costs({1: 0.1, 2: 0.104, 3: 0.108, 5: 0.116, 9: 0.14}, batch=4))
    assert shared.ceilings([8] * 4, [0] * 4) == [1] * 4  # 0.104 s <= 1.0625 x 0.1 < 0.108 s
