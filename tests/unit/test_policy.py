"""The draft-length policy decides from measurements: flat verification + good acceptance -> speculate;
compute-bound verification or an expensive drafter -> K = 0 (with occasional probes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verispec.certify.tiny import tiny_pair
from verispec.config import SamplingParams
from verispec.engine import calibrate as calib
from verispec.engine.calibrate import CostTable, load_or_calibrate
from verispec.engine.policy import FixedPolicy, MeasuredPolicy
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
    assert ks.count(0) == 6 and ks.count(1) == 2  # off, with a probe every 4th step


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
