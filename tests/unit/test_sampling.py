"""Unit tests of verispec.sampling (to_probs, sample, TokenHistory) and of the config objects.

Expected laws are computed by hand (or with NumPy in float64 from the hand-written rule), never by
calling the function under test. Every random draw uses a fixed seed.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.errors import ConfigError, InputError, VerispecError
from verispec.sampling import (
    TokenHistory,
    build_laws,
    generator_blocks,
    inverse_cdf,
    make_generator,
    mode,
    pick,
    sample,
    to_probs,
    uniform_draws,
)

INF = float("inf")
ALPHA = 1e-6  # significance level of every statistical test (house rule)


# ----------------------------------------------------------------------------------------- helpers


def softmax_np(logits: list[float]) -> np.ndarray:
    """float64 softmax that maps -inf to exactly 0 (the expected-law oracle)."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def law(values: list[float]) -> np.ndarray:
    """Normalise a hand-written list of non-negative weights."""
    x = np.asarray(values, dtype=np.float64)
    return x / x.sum()


def probs_of(logits: list[float], params: SamplingParams, history: TokenHistory | None = None) -> np.ndarray:
    out = to_probs(torch.tensor([logits], dtype=torch.float32), [params], history)
    assert out.dtype == torch.float32 and out.shape == (1, len(logits))
    return out[0].double().numpy()


def assert_law(actual: np.ndarray, expected: np.ndarray, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(actual, expected, rtol=0, atol=atol)
    # removed tokens get probability exactly 0
    assert np.all((expected == 0) == (actual == 0)), (actual, expected)


def log_list(probs: list[float]) -> list[float]:
    return [math.log(p) if p > 0 else -INF for p in probs]


def clone(gen: torch.Generator) -> torch.Generator:
    out = torch.Generator(device=gen.device)
    out.set_state(gen.get_state())
    return out


def hist(prompt: list[int], output: list[int], vocab: int) -> TokenHistory:
    return TokenHistory.from_ids([prompt], [output], vocab)


# --------------------------------------------------------------------------------- plain / temperature


def test_default_params_are_plain_softmax():
    logits = [1.0, -2.0, 0.5, 3.0]
    assert_law(probs_of(logits, SamplingParams()), softmax_np(logits))


@pytest.mark.parametrize("temperature", [0.25, 0.5, 2.0, 7.0])
def test_temperature_divides_logits(temperature):
    logits = [1.0, 2.0, 3.0, 0.0, -1.5]
    expected = softmax_np([v / temperature for v in logits])
    assert_law(probs_of(logits, SamplingParams(temperature=temperature)), expected)


def test_temperature_zero_is_one_hot_on_argmax():
    assert_law(probs_of([0.5, -1.0, 2.5, 2.4], SamplingParams(temperature=0)), np.array([0, 0, 1, 0.0]))
    # negative logits and -inf entries
    assert_law(probs_of([-INF, -3.0, -1.0, -2.0], SamplingParams(temperature=0)), np.array([0, 0, 1, 0.0]))


def test_temperature_zero_ties_go_to_lowest_id():
    assert_law(probs_of([1.0, 3.0, 0.0, 3.0, 3.0], SamplingParams(temperature=0)), np.array([0, 1, 0, 0, 0.0]))


@pytest.mark.parametrize("shape", [(5, 151936), (2, 3, 4096), (3, 256), (4, 255), (2, 100), (1, 64), (3, 1088)])
def test_mode_is_argmax(shape):
    """The two-pass mode equals torch's argmax bit for bit: ties (the first index), NaN (ranked
    largest), +-inf, rows all -inf, whole blocks or not, strided views."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen)
    cases = [x, x.round(), (x * 0.3).round().clamp_min(0.0), torch.zeros(shape), torch.full(shape, -INF)]
    spiked = x.clone().reshape(-1, shape[-1])
    n = spiked.shape[1]
    for row in range(spiked.shape[0]):
        kind = row % 4
        if kind == 0:  # two equal maxima far apart
            spiked[row, n // 3] = spiked[row, n - 1] = 50.0
        elif kind == 1:  # NaN wins, the first one
            spiked[row, n // 2] = spiked[row, n // 5] = float("nan")
        elif kind == 2:  # +inf twice
            spiked[row, n - 1] = spiked[row, n // 4] = INF
        else:  # -inf everywhere but one
            spiked[row] = -INF
            spiked[row, n // 7] = -1e30
    cases.append(spiked.reshape(shape))
    if len(shape) == 3:
        cases.append(x[:, :-1])  # a strided view (a verification's positions before the last)
    cases += [x.to(torch.bfloat16).round(), x.reshape(-1, shape[-1]).t().contiguous().t()]  # bf16 ties; column-major
    for c in cases:
        assert torch.equal(mode(c), c.argmax(dim=-1))


def test_greedy_rows_beside_sampled_rows_equal_each_row_alone() -> None:
    """A batch of only greedy rows takes no softmax and picks without cumulative sums; mixed with
    sampled rows, every row still gets the law and the token it gets alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    logits[0, [7, 30]] = 9.0  # a tie: the lowest id
    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20)
    for params in ([greedy] * 4, [greedy, hot, greedy, hot], [hot] * 4):
        laws = build_laws(logits, params).probs
        alone = torch.cat([build_laws(logits[i : i + 1], [p]).probs for i, p in enumerate(params)])
        assert torch.equal(laws, alone)
        mask = torch.tensor([p.greedy for p in params])
        u = torch.rand(4, generator=gen, dtype=torch.float64)
        tokens = pick(laws, u, mask)
        assert all(int(tokens[i]) == int(pick(laws[i : i + 1], u[i : i + 1], mask[i : i + 1])) for i in range(4))
        if params[0].greedy:
            assert int(tokens[0]) == 7


def test_greedy_ignores_top_k_top_p_min_p():
    params = SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    assert_law(probs_of([0.0, 1.0, 2.0], params), np.array([0, 0, 1.0]))


# ----------------------------------------------------------------------------------------------- top-k


def test_top_k_keeps_the_k_largest():
    logits = [0.0, 4.0, 1.0, 3.0, 2.0]
    assert_law(probs_of(logits, SamplingParams(top_k=2)), softmax_np([-INF, 4.0, -INF, 3.0, -INF]))


def test_top_k_keeps_ties_at_the_boundary():
    logits = [1.0, 4.0, 3.0, 3.0, 0.0]
    # the 2nd largest logit is 3, shared by tokens 2 and 3: both stay
    assert_law(probs_of(logits, SamplingParams(top_k=2)), softmax_np([-INF, 4.0, 3.0, 3.0, -INF]))


def test_top_k_one_is_argmax_and_large_k_is_off():
    logits = [1.0, 4.0, 3.0, 0.0]
    assert_law(probs_of(logits, SamplingParams(top_k=1)), np.array([0, 1, 0, 0.0]))
    assert_law(probs_of(logits, SamplingParams(top_k=4)), softmax_np(logits))
    assert_law(probs_of(logits, SamplingParams(top_k=1000)), softmax_np(logits))


def test_top_k_is_applied_after_temperature_but_does_not_depend_on_it():
    logits = [0.0, 4.0, 1.0, 3.0]
    expected = softmax_np([-INF, 4.0 / 3, -INF, 3.0 / 3])
    assert_law(probs_of(logits, SamplingParams(top_k=2, temperature=3.0)), expected)


# ----------------------------------------------------------------------------------------------- top-p

P4 = [0.1, 0.4, 0.3, 0.2]  # sorted: token 1 (0.4), 2 (0.3), 3 (0.2), 0 (0.1); mass before: 0, .4, .7, .9


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.35, [0, 1, 0, 0]),  # the most probable token alone already reaches 0.35
        (0.65, [0, 0.4, 0.3, 0]),  # 0.4 < 0.65 <= 0.7: tokens 1 and 2
        (0.75, [0, 0.4, 0.3, 0.2]),  # 0.7 < 0.75 <= 0.9
        (0.95, [0.1, 0.4, 0.3, 0.2]),  # needs everything
        (1.0, [0.1, 0.4, 0.3, 0.2]),  # off
    ],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, expected):
    assert_law(probs_of(log_list(P4), SamplingParams(top_p=top_p)), law(expected))


def test_top_p_always_keeps_the_most_probable_token():
    # top_p far below the largest probability still leaves one token
    assert_law(probs_of(log_list(P4), SamplingParams(top_p=1e-9)), np.array([0, 1, 0, 0.0]))


def test_top_p_ties_broken_by_lowest_id():
    # tokens 0 and 1 are tied at 0.3; token 2 has 0.4. top_p=0.5 needs 0.4 + one of the 0.3s: token 0.
    assert_law(probs_of(log_list([0.3, 0.3, 0.4]), SamplingParams(top_p=0.5)), law([0.3, 0, 0.4]))


def test_top_p_is_computed_on_the_temperature_scaled_law():
    # T=1: probs ~ [0.665, 0.245, 0.090]: top_p=0.6 keeps token 0 only.
    # T=3: probs ~ [0.452, 0.324, 0.224]: top_p=0.6 keeps tokens 0 and 1.
    logits = [2.0, 1.0, 0.0]
    assert_law(probs_of(logits, SamplingParams(top_p=0.6)), np.array([1, 0, 0.0]))
    assert_law(probs_of(logits, SamplingParams(top_p=0.6, temperature=3.0)), softmax_np([2 / 3, 1 / 3, -INF]))


def test_top_p_one_never_drops_the_tail():
    """Many tiny probabilities: a cumulative sum in fp32 reaches 1.0 by rounding long before the
    end, so a `mass_before >= top_p` test with top_p = 1 would cut the tail. It must not, even when
    another row of the batch forces the sorted top-p path."""
    vocab = 200_000
    logits = torch.zeros((2, vocab))
    logits[:, 7] = 12.0  # p(7) ~ 0.45, each other token ~ 2.8e-6
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    out = to_probs(logits, params)
    expected_tail = 1.0 / (math.exp(12.0) + vocab - 1)
    assert bool((out[0] > 0).all()), "top_p=1 dropped tokens"
    np.testing.assert_allclose(out[0, 0].item(), expected_tail, rtol=1e-3)  # fp32 sum of 200k terms
    assert torch.equal(out[0], to_probs(logits[:1], [SamplingParams()])[0])
    # row 1: p(7) < 0.5 so part of the tail is needed: token 7, then the tied tail in id order
    kept = (out[1] > 0).nonzero().flatten().tolist()
    m = len(kept) - 1
    assert kept == sorted([7, *[i for i in range(m + 1) if i != 7][:m]])
    p7 = math.exp(12.0) * expected_tail
    m_exact = math.ceil((0.5 - p7) / expected_tail)  # tail tokens needed to reach 0.5
    # the fp32 cumulative sum over ~18k terms drifts by ~1e-4 of mass, which moves the cut a little
    assert abs(m - m_exact) * expected_tail < 5e-4, (m, m_exact)


def test_top_p_with_top_k_uses_the_top_k_law():
    # probs [0.4, 0.3, 0.2, 0.1]; top_k=2 leaves [4/7, 3/7]; top_p=0.5 then keeps token 0 alone
    # (mass before token 1 is 4/7 >= 0.5). On the full law, token 1 would survive (0.4 < 0.5).
    logits = log_list([0.4, 0.3, 0.2, 0.1])
    assert_law(probs_of(logits, SamplingParams(top_k=2, top_p=0.5)), np.array([1, 0, 0, 0.0]))
    assert_law(probs_of(logits, SamplingParams(top_k=2, top_p=0.6)), law([0.4, 0.3, 0, 0]))


# ----------------------------------------------------------------------------------------------- min-p


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, [0.5, 0.25, 0.15, 0.1]),
        (0.25, [0.5, 0.25, 0.15, 0]),  # floor 0.125
        (0.4, [0.5, 0.25, 0, 0]),  # floor 0.2
        (1.0, [1, 0, 0, 0]),  # only the largest
    ],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p, expected):
    assert_law(probs_of(log_list([0.5, 0.25, 0.15, 0.1]), SamplingParams(min_p=min_p)), law(expected))


def test_min_p_one_keeps_all_tied_maxima():
    assert_law(probs_of([2.0, 0.0, 2.0], SamplingParams(min_p=1.0)), np.array([0.5, 0, 0.5]))


# ------------------------------------------------------------------------------------------- penalties

PEN_LOGITS = [2.0, -1.0, 1.0, 0.5, 3.0, 0.0]
# token 0: prompt only; token 1: output twice; token 2: output once; token 5 (logit 0): prompt


def pen_history() -> TokenHistory:
    return hist([0, 5], [1, 1, 2], 6)


def test_repetition_penalty_divides_positive_multiplies_negative_for_prompt_and_output():
    p = SamplingParams(repetition_penalty=2.0)
    expected = softmax_np([2.0 / 2, -1.0 * 2, 1.0 / 2, 0.5, 3.0, 0.0])
    assert_law(probs_of(PEN_LOGITS, p, pen_history()), expected)


def test_repetition_penalty_below_one_rewards_seen_tokens():
    p = SamplingParams(repetition_penalty=0.5)
    expected = softmax_np([2.0 / 0.5, -1.0 * 0.5, 1.0 / 0.5, 0.5, 3.0, 0.0])
    assert_law(probs_of(PEN_LOGITS, p, pen_history()), expected)


def test_frequency_and_presence_penalties_count_output_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    # token 0 and 5 are prompt-only: untouched. token 1: -1 - 2*0.5 - 1. token 2: 1 - 0.5 - 1.
    expected = softmax_np([2.0, -3.0, -0.5, 0.5, 3.0, 0.0])
    assert_law(probs_of(PEN_LOGITS, p, pen_history()), expected)


def test_negative_presence_penalty_encourages_output_tokens():
    p = SamplingParams(presence_penalty=-1.5)
    expected = softmax_np([2.0, 0.5, 2.5, 0.5, 3.0, 0.0])
    assert_law(probs_of(PEN_LOGITS, p, pen_history()), expected)


def test_repetition_penalty_comes_before_frequency_and_presence():
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    # documented order: [1, -2, 0.5, .5, 3, 0] then subtract -> token 1: -2 - 1 - 1, token 2: 0.5 - .5 - 1
    expected = softmax_np([1.0, -4.0, -1.0, 0.5, 3.0, 0.0])
    # the other order would give token 1: (-1 - 2) * 2 = -6, token 2: (1 - 1.5) * 2 = -1
    wrong = softmax_np([1.0, -6.0, -1.0, 0.5, 3.0, 0.0])
    got = probs_of(PEN_LOGITS, p, pen_history())
    assert_law(got, expected)
    assert not np.allclose(got, wrong, atol=1e-4)


def test_penalties_only_on_rows_that_ask_for_them():
    logits = torch.tensor([PEN_LOGITS, PEN_LOGITS])
    history = TokenHistory.from_ids([[0, 5], [0, 5]], [[1, 1, 2], [1, 1, 2]], 6)
    out = to_probs(logits, [SamplingParams(), SamplingParams(repetition_penalty=2.0)], history)
    assert_law(out[0].double().numpy(), softmax_np(PEN_LOGITS))
    assert_law(out[1].double().numpy(), softmax_np([1.0, -2.0, 0.5, 0.5, 3.0, 0.0]))


def test_penalties_change_the_greedy_choice():
    # token 0 wins without penalty; seen and divided by 2 it loses to token 1
    assert_law(probs_of([3.0, 2.0], SamplingParams(temperature=0)), np.array([1, 0.0]))
    got = probs_of([3.0, 2.0], SamplingParams(temperature=0, repetition_penalty=2.0), hist([0], [], 2))
    assert_law(got, np.array([0, 1.0]))


# ------------------------------------------------------------------------------------------ logit bias


def test_logit_bias_adds_to_logits():
    p = SamplingParams(logit_bias={0: 1.5, 2: -0.5})
    assert_law(probs_of([0.0, 1.0, 2.0], p), softmax_np([1.5, 1.0, 1.5]))


def test_logit_bias_plus_inf_forces_a_token():
    assert_law(probs_of([5.0, 0.0, 1.0, -3.0], SamplingParams(logit_bias={3: INF})), np.array([0, 0, 0, 1.0]))


def test_logit_bias_plus_inf_on_several_tokens_is_uniform_over_them():
    p = SamplingParams(logit_bias={1: INF, 3: INF})
    assert_law(probs_of([5.0, 0.0, 1.0, -3.0], p), np.array([0, 0.5, 0, 0.5]))
    # greedy picks the lowest forced id
    g = SamplingParams(temperature=0, logit_bias={3: INF, 1: INF})
    assert_law(probs_of([5.0, 0.0, 1.0, -3.0], g), np.array([0, 1, 0, 0.0]))


def test_logit_bias_plus_inf_forces_even_a_minus_inf_logit():
    """Regression: -inf + inf is NaN; the forced set must come from the bias, not from x == inf."""
    logits = [0.0, -INF, 1.0]
    assert_law(probs_of(logits, SamplingParams(logit_bias={1: INF})), np.array([0, 1, 0.0]))
    assert_law(probs_of(logits, SamplingParams(logit_bias={0: INF, 1: INF})), np.array([0.5, 0.5, 0]))
    assert_law(probs_of(logits, SamplingParams(temperature=0, logit_bias={1: INF})), np.array([0, 1, 0.0]))


def test_logit_bias_minus_inf_bans_a_token():
    assert_law(probs_of([1.0, 3.0, 2.0], SamplingParams(logit_bias={1: -INF})), softmax_np([1.0, -INF, 2.0]))
    # greedy falls back to the next best token
    g = SamplingParams(temperature=0, logit_bias={1: -INF})
    assert_law(probs_of([1.0, 3.0, 2.0], g), np.array([0, 0, 1.0]))


def test_minus_inf_logits_are_allowed_and_impossible():
    assert_law(probs_of([-INF, 0.0, 1.0], SamplingParams()), softmax_np([-INF, 0.0, 1.0]))


# --------------------------------------------------------------------------------- order of operations


def test_order_penalty_before_logit_bias():
    # 2 / 2 + 2 = 3 (documented); (2 + 2) / 2 = 2 would be the other order
    p = SamplingParams(repetition_penalty=2.0, logit_bias={0: 2.0})
    assert_law(probs_of([2.0, 0.0], p, hist([0], [], 2)), softmax_np([3.0, 0.0]))


def test_order_logit_bias_before_temperature():
    # (0 + 1) / 2 = 0.5 (documented); 0 / 2 + 1 = 1 would be the other order
    p = SamplingParams(temperature=2.0, logit_bias={0: 1.0})
    assert_law(probs_of([0.0, 0.0], p), softmax_np([0.5, 0.0]))


def test_order_logit_bias_before_greedy():
    assert_law(probs_of([1.0, 2.0], SamplingParams(temperature=0, logit_bias={0: 2.0})), np.array([1, 0.0]))


def test_order_logit_bias_before_top_k():
    # the bias lifts token 0 into the top-2
    p = SamplingParams(top_k=2, logit_bias={0: 5.0})
    assert_law(probs_of([0.0, 3.0, 2.0, 1.0], p), softmax_np([5.0, 3.0, -INF, -INF]))


def test_order_top_p_before_min_p():
    # probs [0.4, 0.3, 0.2, 0.1]; top_p 0.75 keeps {0,1,2}; min_p 0.3 of the max keeps all three.
    # Min-p first would drop token 3 and renormalise to [4/9, 3/9, 2/9], where top_p 0.75 keeps {0, 1}.
    p = SamplingParams(top_p=0.75, min_p=0.3)
    assert_law(probs_of(log_list([0.4, 0.3, 0.2, 0.1]), p), law([0.4, 0.3, 0.2, 0]))


def test_order_temperature_before_min_p():
    # T=1 law [.665, .245, .090]: min_p .3 drops token 2. T=3 law [.452, .324, .224]: keeps all.
    logits = [2.0, 1.0, 0.0]
    assert_law(probs_of(logits, SamplingParams(min_p=0.3)), softmax_np([2.0, 1.0, -INF]))
    assert_law(probs_of(logits, SamplingParams(min_p=0.3, temperature=3.0)), softmax_np([2 / 3, 1 / 3, 0.0]))


def test_order_all_steps_together():
    # history: token 3 in output once. logits -> penalties -> bias -> T -> top-k -> top-p -> min-p
    logits = [4.0, 3.0, 2.0, 5.0, 1.0, 0.0]
    p = SamplingParams(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={5: 3.5, 1: -INF},
        temperature=0.5,
        top_k=3,
        top_p=0.9,
        min_p=0.05,
    )
    x = np.array(logits)
    x[3] = 5.0 / 2 - 0.5 - 0.5  # = 1.5
    x[5] += 3.5
    x[1] = -INF
    x = x / 0.5  # [8, -inf, 4, 3, 2, 7]
    # top-3 keeps 8, 7, 4 (tokens 0, 5, 2)
    x[[1, 3, 4]] = -INF
    q = softmax_np(list(x))  # ~[0.7275, 0, 0.0133, 0, 0, 0.2676]
    order = np.argsort(-q, kind="stable")
    before = np.cumsum(q[order]) - q[order]
    drop = [i for i in order[before >= 0.9] if q[i] > 0]
    assert drop == [2]  # 0.7275 + 0.2676 > 0.9
    x[drop] = -INF
    q = softmax_np(list(x))
    x[q < 0.05 * q.max()] = -INF
    assert_law(probs_of(logits, p, hist([], [3], 6)), softmax_np(list(x)))


# ----------------------------------------------------------------------- batches, dtypes, normalisation

BATCH_PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(min_p=0.1, top_k=20),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.3),
    SamplingParams(temperature=0, repetition_penalty=1.5, logit_bias={3: 2.0}),
    SamplingParams(logit_bias={7: INF, 9: -INF}, top_p=0.5),
]


def _batch_inputs() -> tuple[torch.Tensor, TokenHistory]:
    gen = torch.Generator().manual_seed(1234)
    n, vocab = len(BATCH_PARAMS), 64
    logits = torch.randn((n, vocab), generator=gen) * 3
    prompts = [torch.randint(0, vocab, (5,), generator=gen).tolist() for _ in range(n)]
    outputs = [torch.randint(0, vocab, (i,), generator=gen).tolist() for i in range(n)]
    return logits, TokenHistory.from_ids(prompts, outputs, vocab)


def test_per_row_params_in_a_batch_equal_each_row_alone():
    logits, history = _batch_inputs()
    batch = to_probs(logits, BATCH_PARAMS, history)
    for i, params in enumerate(BATCH_PARAMS):
        alone = to_probs(
            logits[i : i + 1],
            [params],
            TokenHistory(history.output_counts[i : i + 1], history.prompt_mask[i : i + 1]),
        )
        assert torch.equal(batch[i], alone[0]), f"row {i} ({params}) differs batched vs alone"


def test_output_is_fp32_nonnegative_and_sums_to_one():
    logits, history = _batch_inputs()
    out = to_probs(logits.double(), BATCH_PARAMS, history)
    assert out.dtype == torch.float32
    assert bool((out >= 0).all())
    np.testing.assert_allclose(out.sum(dim=1).double().numpy(), 1.0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype):
    logits, history = _batch_inputs()
    low = logits.to(dtype)
    low[0, 3] = -INF
    out = to_probs(low, BATCH_PARAMS, history)
    assert out.dtype == torch.float32
    assert torch.equal(out, to_probs(low.float(), BATCH_PARAMS, history))
    assert out[0, 3] == 0
    np.testing.assert_allclose(out.sum(dim=1).double().numpy(), 1.0, atol=1e-6)


# ------------------------------------------------------------------------------------------ TokenHistory


def test_token_history_from_ids():
    h = TokenHistory.from_ids([[1, 1, 4], []], [[2, 2, 2, 0], [3]], 5)
    assert h.output_counts.dtype == torch.int32 and h.prompt_mask.dtype == torch.bool
    assert h.output_counts.tolist() == [[1, 0, 3, 0, 0], [0, 0, 0, 1, 0]]
    assert h.prompt_mask.tolist() == [[False, True, False, False, True], [False] * 5]


def test_token_history_extended_ignores_padding():
    h = TokenHistory.from_ids([[0], [1]], [[2], []], 4)
    e = h.extended(torch.tensor([[3, 3, -1], [-1, 0, -1]]))
    assert e.output_counts.tolist() == [[0, 0, 1, 2], [1, 0, 0, 0]]
    assert torch.equal(e.prompt_mask, h.prompt_mask)
    assert h.output_counts.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]  # the original is untouched


def test_token_history_for_verification():
    vocab = 6
    prompts, outputs = [[5], [0, 1]], [[4], []]
    draft = torch.tensor([[4, 1, 4], [2, -1, -1]])
    h = TokenHistory.from_ids(prompts, outputs, vocab).for_verification(draft)
    k = draft.shape[1]
    assert h.output_counts.shape == (2 * (k + 1), vocab)
    for b in range(2):
        tokens = [t for t in draft[b].tolist() if t >= 0]
        for i in range(k + 1):
            want = TokenHistory.from_ids([prompts[b]], [outputs[b] + tokens[:i]], vocab)
            row = b * (k + 1) + i
            assert h.output_counts[row].tolist() == want.output_counts[0].tolist(), (b, i)
            assert h.prompt_mask[row].tolist() == want.prompt_mask[0].tolist(), (b, i)


def test_token_history_for_verification_with_no_draft():
    h = TokenHistory.from_ids([[1], [2]], [[3, 3], []], 4)
    v = h.for_verification(torch.empty((2, 0), dtype=torch.long))
    assert torch.equal(v.output_counts, h.output_counts)
    assert torch.equal(v.prompt_mask, h.prompt_mask)


def test_verification_history_gives_the_plain_decoding_laws():
    """to_probs over for_verification rows == to_probs on each prefix's own history."""
    vocab, params = 8, SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.2)
    logits = torch.randn((4, vocab), generator=torch.Generator().manual_seed(3))
    draft = torch.tensor([[2, 2, 5]])
    got = to_probs(logits, [params] * 4, TokenHistory.from_ids([[1]], [[5]], vocab).for_verification(draft))
    for i in range(4):
        want = to_probs(logits[i : i + 1], [params], hist([1], [5, *draft[0, :i].tolist()], vocab))
        assert torch.equal(got[i], want[0])


def test_token_history_errors():
    with pytest.raises(InputError, match="outside the vocabulary"):
        TokenHistory.from_ids([[0, 9]], [[]], 5)
    with pytest.raises(InputError, match="outside the vocabulary"):
        TokenHistory.from_ids([[0]], [[-1]], 5)
    with pytest.raises(InputError, match="one of each per row"):
        TokenHistory.from_ids([[0], [1]], [[]], 5)


# ----------------------------------------------------------------------------------------------- sample


def test_sample_never_touches_global_rngs():
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)  # noqa: NPY002 - the legacy global NumPy RNG must stay untouched too
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    np_state = np.random.get_state()  # noqa: NPY002
    probs = to_probs(torch.randn((4, 50), generator=torch.Generator().manual_seed(0)), [SamplingParams()] * 4)
    g = make_generator(1)
    sample(probs, [g, g, None, make_generator(2)])
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    after = np.random.get_state()  # noqa: NPY002
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1]) and after[2:] == np_state[2:]


def test_sample_same_seed_same_tokens():
    probs = to_probs(torch.randn((8, 100), generator=torch.Generator().manual_seed(0)), [SamplingParams()] * 8)
    a = sample(probs, [make_generator(i) for i in range(8)])
    b = sample(probs, [make_generator(i) for i in range(8)])
    c = sample(probs, [make_generator(100 + i) for i in range(8)])
    assert a.dtype == torch.int64 and a.shape == (8,)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_make_generator_with_seed_is_reproducible():
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert isinstance(make_generator(None), torch.Generator)


def test_sample_none_takes_the_mode_and_consumes_nothing():
    probs = torch.tensor([[0.1, 0.5, 0.4], [0.4, 0.2, 0.4], [0.0, 0.0, 1.0]])
    assert sample(probs, [None, None, None]).tolist() == [1, 0, 2]  # ties -> lowest id
    g = make_generator(5)
    state = g.get_state()
    mixed = sample(probs, [None, g, None])
    alone = sample(probs[1:2], [make_generator(5)])
    assert mixed[0] == 1 and mixed[2] == 2 and mixed[1] == alone[0]
    g2 = make_generator(5)
    sample(probs[1:2], [g2])
    assert torch.equal(g.get_state(), g2.get_state())  # the None rows drew nothing
    assert not torch.equal(g.get_state(), state)


def test_sample_rows_sharing_a_generator_draw_as_one_block():
    vocab = 1000
    probs = torch.full((5, vocab), 1.0 / vocab)
    g, h = make_generator(11), make_generator(12)
    g_copy, h_copy = clone(g), clone(h)
    got = sample(probs, [g, g, g, h, g])
    # blocks: rows 0-2 (g), row 3 (h), row 4 (g): one call per block, one uniform per row, in order
    assert generator_blocks([g, g, g, h, g]) == [(0, 3), (3, 4), (4, 5)]
    first = torch.rand(3, dtype=torch.float64, generator=g_copy)
    middle = torch.rand(1, dtype=torch.float64, generator=h_copy)
    last = torch.rand(1, dtype=torch.float64, generator=g_copy)
    u = torch.cat([first, middle, last]).numpy()
    cdf = np.cumsum(probs[0].numpy().astype(np.float64))
    expected = [int(np.searchsorted(cdf, x * cdf[-1], side="right")) for x in u]
    assert got.tolist() == expected
    # the three rows of the first block got different uniforms, not three copies of one draw
    assert len(set(got[:3].tolist())) == 3
    assert torch.equal(g.get_state(), g_copy.get_state())


def test_uniform_draws_protocol():
    g, h = make_generator(0), make_generator(1)
    g_copy, h_copy = clone(g), clone(h)
    accept, final = uniform_draws([g, g, None, h], [2, 0, 3, 1], 3, torch.device("cpu"))
    assert accept.dtype == torch.float64 and accept.shape == (4, 3) and final.shape == (4,)
    run_g = torch.rand(2 + 2, dtype=torch.float64, generator=g_copy)  # 2 acceptance + 2 final
    run_h = torch.rand(1 + 1, dtype=torch.float64, generator=h_copy)
    assert accept[0, :2].tolist() == run_g[:2].tolist() and accept[0, 2] == 1.0
    assert bool((accept[1] == 1.0).all()) and bool((accept[2] == 1.0).all())  # no draft / no generator
    assert final[:2].tolist() == run_g[2:].tolist() and final[2] == 0.0
    assert accept[3, 0] == run_h[0] and final[3] == run_h[1]
    assert torch.equal(g.get_state(), g_copy.get_state()) and torch.equal(h.get_state(), h_copy.get_state())


def test_inverse_cdf_edges():
    law = torch.tensor([[0.0, 2.0, 0.0, 2.0]])  # unnormalised; zero-mass tokens are never picked
    for u, token in ((0.0, 1), (0.4999, 1), (0.5, 3), (0.999999, 3)):
        assert inverse_cdf(law, torch.tensor([u], dtype=torch.float64)).tolist() == [token]


def test_generator_blocks():
    a, b = make_generator(0), make_generator(1)
    assert generator_blocks([]) == []
    assert generator_blocks([a]) == [(0, 1)]
    assert generator_blocks([a, a, None, None, b, a]) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_sample_follows_the_law():
    """200k draws, one batch sharing one generator: chi-square on the support, zeros never drawn."""
    target = np.array([0.3, 0.0, 0.2, 0.15, 0.0, 0.25, 0.05, 0.05])
    n = 200_000
    probs = torch.tensor(target, dtype=torch.float32).expand(n, -1)
    g = make_generator(2024)
    counts = np.bincount(sample(probs, [g] * n).numpy(), minlength=len(target))
    assert counts[target == 0].sum() == 0
    support = target > 0
    p_value = stats.chisquare(counts[support], n * target[support]).pvalue
    assert p_value > ALPHA, p_value


def test_sample_follows_the_law_per_row_generators():
    target = np.array([0.5, 0.125, 0.125, 0.25])
    n = 40_000
    probs = torch.tensor(target, dtype=torch.float32).expand(n, -1)
    counts = np.bincount(sample(probs, [make_generator(i) for i in range(n)]).numpy(), minlength=4)
    assert stats.chisquare(counts, n * target).pvalue > ALPHA


def test_sample_never_draws_zero_probability_tokens():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn((2000, 30), generator=gen)
    probs = to_probs(logits, [SamplingParams(top_k=3)] * 2000)
    tokens = sample(probs, [make_generator(1)] * 2000)
    assert bool((probs.gather(1, tokens.unsqueeze(1)) > 0).all())


def test_sample_bad_input():
    with pytest.raises(InputError, match=r"\[N, V\]"):
        sample(torch.ones(4) / 4, [None])
    with pytest.raises(InputError, match="one per row"):
        sample(torch.ones((2, 4)) / 4, [None])


# --------------------------------------------------------------------------------- to_probs bad input


@pytest.mark.parametrize("bad", [float("nan"), INF])
def test_to_probs_rejects_nan_and_plus_inf(bad):
    logits = torch.zeros((3, 4))
    logits[1, 2] = bad
    with pytest.raises(InputError, match=r"row 1 contains NaN or \+inf.*fp32 or bf16"):
        to_probs(logits, [SamplingParams()] * 3)


def test_to_probs_rejects_bad_shapes_and_dtypes():
    with pytest.raises(InputError, match=r"\[N, V\]"):
        to_probs(torch.zeros(4), [SamplingParams()])
    with pytest.raises(InputError, match=r"\[N, V\]"):
        to_probs(torch.zeros((1, 2, 4)), [SamplingParams()])
    with pytest.raises(InputError, match="pass one per row"):
        to_probs(torch.zeros((2, 4)), [SamplingParams()])
    with pytest.raises(InputError, match="floating point"):
        to_probs(torch.zeros((1, 4), dtype=torch.long), [SamplingParams()])


def test_to_probs_all_tokens_banned():
    with pytest.raises(InputError, match=r"every token of row 1 has probability 0.*remove"):
        to_probs(
            torch.zeros((2, 3)),
            [SamplingParams(), SamplingParams(logit_bias={0: -INF, 1: -INF, 2: -INF})],
        )
    with pytest.raises(InputError, match="every token of row 0"):
        to_probs(torch.full((1, 3), -INF), [SamplingParams(temperature=0)])


def test_to_probs_overflow_is_an_error_not_nan():
    """Logits far beyond any model's (1e37) over a small temperature overflow fp32: an InputError
    that names the cause, never a NaN law."""
    with pytest.raises(InputError, match=r"overflow.*temperature=0"):
        to_probs(torch.tensor([[1e37, 2.0, 0.0]]), [SamplingParams(temperature=1e-3)])
    # a small but sane temperature is fine and gives (nearly) the argmax
    assert_law(probs_of([1.0, 2.0, 0.0], SamplingParams(temperature=1e-3)), np.array([0, 1, 0.0]))


@pytest.mark.parametrize(
    "kwargs",
    [
        # finite in Python's float64, but infinite or zero in fp32: each poisoned a decode step
        {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 1e39}, {"temperature": 1e300},
        {"presence_penalty": 1e39}, {"frequency_penalty": -1e39}, {"presence_penalty": 2.5},
        {"repetition_penalty": 1e-46}, {"repetition_penalty": 1e39}, {"logit_bias": {1: 1e39}},
        {"logit_bias": {1: -101.0}}, {"top_k": 2**63}, {"seed": 2**64}, {"max_tokens": 2**40},
    ],
)  # fmt: skip
def test_sampling_params_refuse_values_fp32_cannot_hold(kwargs):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


@settings(max_examples=300, deadline=None)
@given(
    temperature=st.floats(allow_nan=True, allow_infinity=True),
    penalty=st.floats(allow_nan=True, allow_infinity=True),
    repetition=st.floats(allow_nan=True, allow_infinity=True),
    bias=st.floats(allow_nan=True, allow_infinity=True),
)
def test_every_accepted_sampling_params_gives_a_law(temperature, penalty, repetition, bias):
    """The property behind the ranges: whatever SamplingParams accepts, to_probs turns real-model
    logits (and a long history) into a law; nothing it accepts overflows fp32."""
    try:
        params = SamplingParams(
            temperature=temperature, presence_penalty=penalty, frequency_penalty=penalty,
            repetition_penalty=repetition, logit_bias={0: bias, 2: -bias},
        )  # fmt: skip
    except ConfigError:
        return
    logits = torch.tensor([[40.0, -40.0, 0.0, 1e-30, -1e4]])
    history = TokenHistory.from_ids([[0, 1]], [[0] * 4000 + [3]], 5)
    laws = build_laws(logits, [params], history)
    if laws.failed:  # only a deliberate ban of every token (+-inf biases) may leave no law
        assert math.isinf(bias)
        return
    assert torch.isfinite(laws.probs).all() and abs(float(laws.probs.sum()) - 1.0) < 1e-5


def test_build_laws_reports_rows_without_a_law_and_keeps_the_others():
    logits = torch.tensor([[1.0, 2.0, 0.0], [float("nan"), 0.0, 0.0], [0.5, 0.5, 0.0]])
    params = [SamplingParams(), SamplingParams(), SamplingParams(logit_bias={0: -INF, 1: -INF, 2: -INF})]
    laws = build_laws(logits, params)
    assert sorted(laws.failed) == [1, 2]
    assert "NaN" in str(laws.failed[1]) and "every token of row 2" in str(laws.failed[2])
    assert torch.equal(laws.probs[0], to_probs(logits[:1], params[:1])[0])
    assert (laws.probs[1:] == 0).all()


def test_to_probs_penalties_need_history():
    with pytest.raises(ConfigError, match=r"history=TokenHistory"):
        to_probs(torch.zeros((1, 3)), [SamplingParams(presence_penalty=0.5)])
    with pytest.raises(InputError, match="one history row per logits row"):
        to_probs(torch.zeros((2, 3)), [SamplingParams(repetition_penalty=1.2)] * 2, hist([0], [], 3))


def test_to_probs_logit_bias_outside_vocab():
    with pytest.raises(ConfigError, match=r"token 5, outside the vocabulary \[0, 5\)"):
        to_probs(torch.zeros((1, 5)), [SamplingParams(logit_bias={5: 1.0})])


def test_error_classes_are_value_errors():
    for cls in (ConfigError, InputError):
        assert issubclass(cls, ValueError) and issubclass(cls, VerispecError)


# ------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature=0 for greedy"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": INF}, "finite"),
        ({"temperature": True}, "number"),
        ({"temperature": "1"}, "number"),
        ({"top_p": 0.0}, r"\(0, 1\]"),
        ({"top_p": 1.5}, r"\(0, 1\]"),
        ({"top_p": -0.2}, r"\(0, 1\]"),
        ({"top_p": float("nan")}, "finite"),
        ({"top_k": -1}, r"\[0, 2147483647\]"),
        ({"top_k": 2.0}, "integer"),
        ({"top_k": True}, "integer"),
        ({"min_p": -0.01}, r"\[0, 1\]"),
        ({"min_p": 1.01}, r"\[0, 1\]"),
        ({"min_p": float("nan")}, "finite"),
        ({"repetition_penalty": 0.0}, r"\[0.001, 1000\]"),
        ({"repetition_penalty": -1.0}, r"\[0.001, 1000\]"),
        ({"repetition_penalty": float("nan")}, "finite"),
        ({"presence_penalty": float("nan")}, "finite"),
        ({"frequency_penalty": INF}, "finite"),
        ({"max_tokens": 0}, r"\[1, "),
        ({"max_tokens": True}, "integer"),
        ({"max_tokens": 3.0}, "integer"),
        ({"seed": -1}, r"\[0, 2\*\*64 - 1\]"),
        ({"seed": True}, "integer"),
        ({"logit_bias": {-1: 1.0}}, "token ids >= 0"),
        ({"logit_bias": {True: 1.0}}, "token ids >= 0"),
        ({"logit_bias": {"a": 1.0}}, "token ids >= 0"),
        ({"logit_bias": {1: float("nan")}}, "must be a number"),
        ({"logit_bias": {1: "x"}}, "must be a number"),
        ({"logit_bias": [(1, 2.0)]}, "map token ids"),
        ({"stop": ("",)}, "non-empty strings"),
        ({"stop": (1,)}, "non-empty strings"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_boundaries_and_normalises():
    SamplingParams(temperature=0, top_p=1.0, min_p=0.0, top_k=0)
    SamplingParams(min_p=1.0, top_p=1e-9, repetition_penalty=1e-3, presence_penalty=-2, frequency_penalty=2)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-3).greedy
    assert not SamplingParams().uses_history
    assert SamplingParams(frequency_penalty=0.1).uses_history
    assert SamplingParams(temperature=0).plain_greedy and not SamplingParams(temperature=0.5).plain_greedy
    assert not SamplingParams(temperature=0, logit_bias={1: 2.0}).plain_greedy
    assert not SamplingParams(temperature=0, repetition_penalty=1.2).plain_greedy
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = 99.0
    assert p.logit_bias == {1: 2.0}  # copied, not aliased
    SamplingParams(logit_bias={0: INF, 1: -INF})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rule": "medusa"}, "rejection, block, specinfer, sequoia, point-mass, greedy, typical"),
        ({"rule": "typical"}, "allow_lossy=True"),
        ({"rule": "typical", "allow_lossy": True, "typical_epsilon": 0.0}, r"\(0, 1\]"),
        ({"rule": "typical", "allow_lossy": True, "typical_delta": 0.0}, "> 0"),
        ({"typical_delta": float("nan")}, "finite"),
    ],
)
def test_spec_config_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SpecConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_draft_tokens": -2}, ">= 0"), ({"num_draft_tokens": True}, "integer"), ({"spec": "typical"}, "SpecConfig")],
)
def test_engine_config_holds_the_draft_length_and_one_spec_config(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)
    assert EngineConfig(num_draft_tokens=0).num_draft_tokens == 0  # no speculation
    assert EngineConfig(num_draft_tokens=12).max_draft_tokens == 12


def test_spec_config_valid():
    assert SpecConfig().lossless
    assert SpecConfig(rule="greedy").lossless
    assert not SpecConfig(rule="typical", allow_lossy=True).lossless
