"""The gate's statistics and verdicts on hand-made measurements (exact expected outcomes)."""

from __future__ import annotations

import math

import pytest

from verispec.analysis import alpha_min
from verispec.bench.scrape import MetricsSnapshot, parse_prometheus, spec_from_metrics
from verispec.bench.stats import (
    Interval,
    acceptance_from_counts,
    acceptance_from_spec_objects,
    acceptance_from_steps,
    describe,
    mean_ci,
    paired_proportion_diff,
    paired_ratio_ci,
    per_unit_ratios,
)
from verispec.bench.verdict import GO, INCONCLUSIVE, NO_GO, LevelMeasurement, QualityMeasurement, decide


def iv(value: float, low: float, high: float) -> Interval:
    return Interval(value, low, high, 0.95, "hand-made")


GOOD_QUALITY = QualityMeasurement(pass_at_1_diff=iv(0.0, -0.3, 0.3), pass_at_1_problems=5,
                                  delta_nll=iv(1e-6, -1e-5, 1e-5))  # fmt: skip


def level(**kw: object) -> LevelMeasurement:
    base: dict[str, object] = {"label": "concurrency 1", "alpha": 0.7, "k": 4, "c": 0.1, "c_source": "measured",
                               "throughput_ratio": iv(1.5, 1.3, 1.7)}  # fmt: skip
    return LevelMeasurement(**(base | kw))  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------- verdicts
def test_go_when_everything_holds() -> None:
    v = decide(level(), GOOD_QUALITY)
    assert v.verdict == GO
    assert [c.status for c in v.criteria] == ["pass", "pass", "pass"]
    assert "alpha = 0.700 > a_min" in v.criteria[0].reason and "S(alpha, K, c) = 1.98" in v.criteria[0].reason


def test_acceptance_below_a_min_is_no_go_with_that_reason() -> None:
    a_min = alpha_min(4, 0.3)
    assert a_min is not None
    v = decide(level(alpha=a_min - 0.01, c=0.3), GOOD_QUALITY)
    assert v.verdict == NO_GO
    assert v.reasons == [v.criteria[0].reason]
    assert v.reasons[0].startswith("acceptance below a_min")
    assert f"a_min = {a_min:.3f}" in v.reasons[0]


def test_draft_slower_than_target_is_no_go() -> None:
    v = decide(level(alpha=0.99, c=1.2), GOOD_QUALITY)
    assert v.verdict == NO_GO and v.reasons[0].startswith("draft too slow")


def test_throughput_regression_only_beyond_noise() -> None:
    worse = decide(level(throughput_ratio=iv(0.8, 0.7, 0.95)), GOOD_QUALITY)
    assert worse.verdict == NO_GO
    assert worse.reasons == ["throughput regression beyond noise: 0.80x baseline (95% CI 0.70-0.95)"]
    noisy = decide(level(throughput_ratio=iv(0.9, 0.75, 1.05)), GOOD_QUALITY)
    assert noisy.verdict == INCONCLUSIVE and "no measured gain" in noisy.criteria[1].reason


def test_quality_regressions() -> None:
    dropped = QualityMeasurement(pass_at_1_diff=iv(-0.6, -0.9, -0.1), pass_at_1_problems=10)
    v = decide(level(), dropped)
    assert v.verdict == NO_GO and v.reasons[0].startswith("quality regression: HumanEval pass@1 delta -0.60")
    # Significant but tiny (numerics): within the margin, so it passes; beyond it, it fails.
    tiny = QualityMeasurement(delta_nll=iv(1e-4, 5e-5, 2e-4), ppl_margin=0.01)
    assert decide(level(), tiny).verdict == GO
    big = QualityMeasurement(delta_nll=iv(0.05, 0.03, 0.07), ppl_margin=0.01)
    v = decide(level(), big)
    assert v.verdict == NO_GO and "beyond the 1% margin" in v.reasons[0]
    # Significantly *better* is not a regression.
    assert decide(level(), QualityMeasurement(delta_nll=iv(-0.05, -0.07, -0.03))).verdict == GO


def test_the_output_law_criterion() -> None:
    law = {"p_value": 0.4, "alpha": 0.01, "prompts": [{}] * 6, "samples_per_arm": 200, "tokens": 2,
           "detectable_tv": 0.12}  # fmt: skip
    v = decide(level(), QualityMeasurement(law=law))
    assert v.verdict == GO and "unchanged at that resolution" in v.criteria[2].reason
    assert "detectable TV 0.120" in v.criteria[2].reason
    v = decide(level(), QualityMeasurement(delta_nll=iv(0.0, -1e-6, 1e-6), law=law | {"p_value": 1e-5}))
    assert v.verdict == NO_GO and "the laws differ" in v.reasons[0]


def test_unknowns_are_inconclusive_never_go() -> None:
    assert decide(level(c=None, c_source="unknown"), GOOD_QUALITY).verdict == INCONCLUSIVE
    assert decide(level(k=None, alpha=None), GOOD_QUALITY).verdict == INCONCLUSIVE
    assert decide(level(throughput_ratio=None), GOOD_QUALITY).verdict == INCONCLUSIVE
    v = decide(level(), QualityMeasurement(skipped=["HumanEval: skipped"]))
    assert v.verdict == INCONCLUSIVE and "quality not measured (HumanEval: skipped)" in v.reasons[0]
    # A failure still decides when something else is unknown.
    assert decide(level(c=None, throughput_ratio=iv(0.5, 0.4, 0.6)), GOOD_QUALITY).verdict == NO_GO


def test_lossy_rule_is_noted() -> None:
    quality = QualityMeasurement(delta_nll=iv(0.0, -1e-6, 1e-6), lossless=False)
    assert any("LOSSY" in n for n in decide(level(), quality).notes)


# ------------------------------------------------------------------------------------ acceptance
def test_acceptance_from_steps_counts_reach_exactly() -> None:
    # (drafted, accepted): full acceptance at K=3, rejection at position 1, K=1 step, nothing drafted.
    acc = acceptance_from_steps([(3, 3), (3, 1), (1, 0), (0, 0), (2, 2)])
    assert (acc.num_drafts, acc.num_draft_tokens, acc.num_accepted_tokens) == (4, 9, 6)
    assert acc.reached == [4, 3, 1] and acc.passed == [3, 2, 1]
    assert acc.alpha == pytest.approx(6 / 8)  # accepted / (accepted + 2 rejections)
    assert acc.mean_acceptance_length == pytest.approx(2.5) and acc.acceptance_rate == pytest.approx(6 / 9)
    assert acc.per_position == pytest.approx([0.75, 0.5, 0.25])
    assert acc.conditional == pytest.approx([0.75, 2 / 3, 1.0])


def test_counts_agree_with_steps_for_a_fixed_k() -> None:
    entries = [(4, 4), (4, 0), (4, 2), (4, 3), (4, 1), (4, 4)]
    steps = acceptance_from_steps(entries)
    counts = acceptance_from_counts(steps.num_drafts, steps.num_draft_tokens, steps.num_accepted_tokens, steps.passed)
    assert counts.reached == steps.reached and counts.alpha == pytest.approx(steps.alpha)
    # Positions nobody drafted (a server exporting 8 positions for K = 4) are dropped.
    padded = acceptance_from_counts(6, 24, 14, [*steps.passed, 0, 0, 0, 0])
    assert padded.passed == steps.passed and padded.alpha == pytest.approx(steps.alpha)


def test_spec_objects_token_weighted_and_per_request() -> None:
    specs = [{"drafts": 2, "drafted": 4, "accepted": 4, "accepted_per_pos": [2, 2]},
             {"drafts": 6, "drafted": 12, "accepted": 0, "accepted_per_pos": [0, 0]}]  # fmt: skip
    pooled, per_request = acceptance_from_spec_objects(specs)
    assert pooled.acceptance_rate == pytest.approx(4 / 16) and pooled.mean_acceptance_length == pytest.approx(1.5)
    assert per_request["acceptance_rate"] == pytest.approx(0.5)  # each request counts once
    assert per_request["acceptance_per_position"] == pytest.approx([0.5, 0.5])
    assert per_request["free_draft_share"] == 0.0  # (another server's spec objects carry no free drafts)
    assert pooled.free_draft_share is None  # (and the pooled view says it was not told)
    pooled, composite = acceptance_from_spec_objects([{**specs[0], "free_drafts": 1}, {**specs[1], "free_drafts": 3}])
    assert composite["free_draft_share"] == pytest.approx(4 / 8)
    assert pooled.num_free_drafts == 4 and pooled.as_dict()["free_draft_share"] == pytest.approx(4 / 8)


def test_free_drafts_from_step_records_and_counters() -> None:
    """The share of drafts no model pass paid for (a composite's lookup) where the source says it:
    step records with free flags, verispec's counters; pairs and vLLM's counters leave it None."""
    acc = acceptance_from_steps([(3, 3, True), (3, 1, False), (0, 0, True), (2, 2, True)])
    assert (acc.num_drafts, acc.num_free_drafts, acc.free_draft_share) == (3, 2, pytest.approx(2 / 3))
    assert acceptance_from_steps([(3, 3), (2, 0)]).free_draft_share is None
    assert acceptance_from_counts(4, 8, 6, [3, 3], num_free_drafts=1).free_draft_share == pytest.approx(0.25)
    text = (
        "verispec:spec_decode_num_drafts_total 4\nverispec:spec_decode_num_draft_tokens_total 8\n"
        "verispec:spec_decode_num_accepted_tokens_total 6\nverispec:spec_decode_num_free_drafts_total 3\n"
    )
    spec = spec_from_metrics(None, MetricsSnapshot.from_text(text))
    assert spec is not None and (spec["num_free_drafts"], spec["free_draft_share"]) == (3, pytest.approx(0.75))
    vllm = spec_from_metrics(None, MetricsSnapshot.from_text(VLLM.format(d=3, t=6, a=4, p0=2, p1=2)))
    assert vllm is not None and vllm["free_draft_share"] is None


# -------------------------------------------------------------------------------------- intervals
def test_paired_ratio_and_mean_intervals() -> None:
    same = paired_ratio_ci([10, 20], [1, 2], [10, 20], [1, 2], resamples=200)
    assert same is not None and (same.value, same.low, same.high) == pytest.approx((1.0, 1.0, 1.0))
    faster = paired_ratio_ci([10] * 8, [1.0, 1.1, 0.9, 1.0, 1.2, 0.8, 1.0, 1.0], [20] * 8, [1.0] * 8, resamples=500)
    assert faster is not None and faster.value == pytest.approx(2.0) and faster.low < 2.0 < faster.high
    assert paired_ratio_ci([], [], [], [], resamples=10) is None
    m = mean_ci([1.0, 2.0, 3.0, 4.0], resamples=500)
    assert m is not None and m.value == 2.5 and 1.0 <= m.low < 2.5 < m.high <= 4.0


def test_agresti_min_paired_difference() -> None:
    d = paired_proportion_diff([True, False, True, False, True], [True, False, True, False, True])
    assert d is not None and d.value == 0.0 and d.low < 0 < d.high  # no discordant pair, still a real interval
    worse = paired_proportion_diff([True] * 20, [False] * 20)
    assert worse is not None and worse.value == -1.0 and worse.high < 0
    assert paired_proportion_diff([], []) is None


def test_describe() -> None:
    d = describe([1.0, 2.0, 3.0, 4.0, 5.0])
    assert d["p50"] == 3.0 and d["mean"] == 3.0 and d["p95"] == pytest.approx(4.8)
    assert describe([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


# ---------------------------------------------------------------------------------------- scrape
VLLM = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {d}
vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} 1.7e9
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {t}
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {a}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
"""


def test_vllm_counters_over_a_window() -> None:
    before = MetricsSnapshot.from_text(VLLM.format(d=10, t=20, a=10, p0=6, p1=4))
    after = MetricsSnapshot.from_text(VLLM.format(d=30, t=60, a=40, p0=24, p1=16))
    spec = spec_from_metrics(before, after)
    assert spec is not None and spec["source"] == "vllm"
    assert spec["acceptance_rate"] == pytest.approx(30 / 40)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)
    assert spec["acceptance_per_position"] == pytest.approx([0.9, 0.6])


def test_verispec_names_two_label_sets_summed() -> None:
    text = ('verispec:spec_decode_num_drafts_total{model_name="a"} 2\nverispec:spec_decode_num_drafts_total'
            '{model_name="b"} 2\nverispec:spec_decode_num_draft_tokens_total 8\n'
            'verispec:spec_decode_num_accepted_tokens_total 6\n')  # fmt: skip
    spec = spec_from_metrics(None, MetricsSnapshot.from_text(text))
    assert spec is not None and spec["source"] == "verispec" and spec["num_drafts"] == 4
    assert spec["mean_acceptance_length"] == pytest.approx(2.5)


def test_sglang_gauges_and_garbage() -> None:
    text = 'garbage {\nsglang:spec_accept_length{model_name="m"} 3.25\nsglang:spec_accept_rate 0.5\nx{a="b"} NaNa\n'
    spec = spec_from_metrics(None, MetricsSnapshot.from_text(text))
    assert spec is not None and spec["source"] == "sglang" and spec["accept_length_gauge"] == 3.25
    assert spec_from_metrics(None, MetricsSnapshot.from_text("other_metric 1\n")) is None
    samples = parse_prometheus('m{a="x\\"y",b="2"} 1.5 1700000000\n')
    assert samples[0].labels == {"a": 'x\\"y', "b": "2"} and samples[0].value == 1.5
    assert math.isnan(parse_prometheus("m NaN\n")[0].value)


def test_per_unit_ratios_pair_each_unit_with_itself() -> None:
    """2x on one prompt and 0.5x on another cancel on the ratio's own scale."""
    out = per_unit_ratios([2.0, 1.0, 3.0], [1.0, 2.0, 3.0])
    assert out["median_ratio"] == 1.0 and out["geomean_ratio"] == pytest.approx(1.0)
    assert per_unit_ratios([4.0], [1.0]) == {"median_ratio": 4.0, "geomean_ratio": pytest.approx(4.0)}
