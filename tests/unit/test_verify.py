"""Unit tests of the acceptance rules (verispec.verify).

- hand-built drafts with exact expected verdicts (as in vLLM's and HF's rejection-sampler tests);
- fast rules == slow references EXACTLY under identical generator states, over many random cases;
- batch == per-request; one-step distribution tests (chi-square, alpha = 1e-6) whose negative
  controls (the broken rules) must fail the same test;
- bad input raises InputError with a remedy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy import stats

from verispec.config import SamplingParams, SpecConfig
from verispec.errors import ConfigError, InputError
from verispec.sampling import make_generator, sample, to_probs
from verispec.verify import (
    PAD_ID,
    AcceptanceRule,
    Draft,
    GreedyRule,
    RejectionRule,
    TypicalRule,
    Verdict,
    make_rule,
)
from verispec.verify.broken import (
    BROKEN_RULES,
    AlwaysAcceptRule,
    BonusFromDraftRule,
    OffByOneRule,
    ResidualIsTargetRule,
)
from verispec.verify.reference import reference_greedy, reference_rejection, reference_typical
from verispec.verify.typical import typical_threshold

Gens = list[torch.Generator | None]
ALPHA = 1e-6

# ----------------------------------------------------------------------------------------- helpers


def clone_gens(gens: Sequence[torch.Generator | None]) -> Gens:
    """Independent copies with the same states, keeping which rows share one generator object."""
    memo: dict[int, torch.Generator] = {}
    out: Gens = []
    for g in gens:
        if g is None:
            out.append(None)
            continue
        if id(g) not in memo:
            c = torch.Generator(device=g.device)
            c.set_state(g.get_state())
            memo[id(g)] = c
        out.append(memo[id(g)])
    return out


def one_hot(token: int, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).to(torch.float32)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def assert_same(a: Verdict, b: Verdict, msg: str = "") -> None:
    assert torch.equal(a.output_ids, b.output_ids), f"{msg}\n{a.output_ids}\n{b.output_ids}"
    assert torch.equal(a.num_accepted, b.num_accepted), f"{msg}\n{a.num_accepted}\n{b.num_accepted}"


def row_draws(gen: torch.Generator, count: int) -> tuple[list[float], float]:
    """The protocol for a request alone: one call, ``count`` acceptance uniforms then one final."""
    draw = torch.rand(count + 1, dtype=torch.float64, generator=gen).tolist()
    return draw[:count], draw[count]


def icdf(law: torch.Tensor, u: float) -> int:
    """Inverse-CDF sampling by hand: the first token whose cumulative mass exceeds u * total."""
    cdf = np.cumsum(law.numpy().astype(np.float64))
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


# ------------------------------------------------------------------------------------ interface basics


def test_rules_satisfy_the_protocol_and_label_lossiness():
    for rule in (RejectionRule(), GreedyRule(), TypicalRule()):
        assert isinstance(rule, AcceptanceRule)
    assert RejectionRule.lossless and GreedyRule.lossless
    assert not TypicalRule.lossless
    for cls in BROKEN_RULES:
        assert not cls.lossless and cls.name.startswith("broken-")


def test_make_rule():
    assert isinstance(make_rule(SpecConfig()), RejectionRule)
    assert isinstance(make_rule(SpecConfig(rule="greedy")), GreedyRule)
    rule = make_rule(SpecConfig(rule="typical", allow_lossy=True, typical_epsilon=0.2, typical_delta=0.5))
    assert isinstance(rule, TypicalRule) and (rule.epsilon, rule.delta) == (0.2, 0.5)
    assert make_rule(SpecConfig(), check_values=False).check_values is False


def test_draft_from_lists_and_verdict_tokens():
    d = Draft.from_lists([[3, 1], [], [2]])
    assert d.token_ids.tolist() == [[3, 1], [PAD_ID, PAD_ID], [2, PAD_ID]]
    assert d.num_tokens.tolist() == [2, 0, 1]
    assert (d.batch_size, d.max_tokens) == (3, 2)
    v = Verdict(torch.tensor([[3, 1, 0], [4, -1, -1], [2, 5, -1]]), torch.tensor([2, 0, 1]))
    assert v.num_output.tolist() == [3, 1, 2]
    assert v.tokens() == [[3, 1, 0], [4], [2, 5]]


# ------------------------------------------------------------------------- RejectionRule: exact cases


def test_draft_equal_to_target_accepts_everything_plus_bonus():
    """u * q < p with q == p holds for every u in [0, 1): always full acceptance."""
    vocab = 5
    target = t([[0.1, 0.4, 0.2, 0.2, 0.1], [0.3, 0.3, 0.1, 0.1, 0.2], [0, 0, 0, 1, 0]]).unsqueeze(0)
    draft = Draft(torch.tensor([[4, 0]]), torch.tensor([2]), target[:, :2].clone())
    for seed in range(50):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        assert v.output_ids.tolist() == [[4, 0, 3]]  # bonus from the point-mass law at position 2
        assert v.num_accepted.tolist() == [2]
    assert vocab == target.shape[2]


def test_draft_prob_zero_is_rejected():
    """The drafter reports q(x) = 0 for the token it proposed: reject, even though p(x) = 1; the
    residual max(0, p - q) is then p itself, so the recovered token is x (but not accepted)."""
    target = t([[0, 1, 0, 0], [0.25, 0.25, 0.25, 0.25]]).unsqueeze(0)
    draft = Draft(torch.tensor([[1]]), torch.tensor([1]), t([[[0.5, 0, 0.5, 0]]]))
    for seed in range(20):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        assert v.num_accepted.tolist() == [0]
        assert v.output_ids.tolist() == [[1, PAD_ID]]


def test_target_prob_zero_is_rejected_and_recovered_never_the_draft_token():
    # p(0) = 0; residual = max(0, p - q) = [0, 0.6, 0, 0]: the recovered token is always 1
    target = t([[0, 0.6, 0.4, 0], [0.25, 0.25, 0.25, 0.25]]).unsqueeze(0)
    draft = Draft(torch.tensor([[0]]), torch.tensor([1]), t([[[0.5, 0, 0.4, 0.1]]]))
    for seed in range(30):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        assert v.num_accepted.tolist() == [0]
        assert v.output_ids.tolist() == [[1, PAD_ID]]


def test_target_prob_zero_point_mass_draft():
    target = t([[0, 0.5, 0.25, 0.25], [1, 0, 0, 0]]).unsqueeze(0)
    draft = Draft(torch.tensor([[0]]), torch.tensor([1]), None)
    seen = set()
    for seed in range(60):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        assert v.num_accepted.tolist() == [0]
        seen.add(int(v.output_ids[0, 0]))
    assert seen == {1, 2, 3}


def test_point_mass_drafts_accept_iff_u_below_target_prob():
    """probs=None: accept iff u < p(x) (u the row's first float64 uniform); recovered law is p with
    x removed; bonus from the next target law. Draws per the protocol: one call, the acceptance
    uniform then the final-token uniform."""
    p0 = t([0.1, 0.4, 0.2, 0.3, 0.0])
    p1 = t([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([p0, p1]).unsqueeze(0)
    draft = Draft(torch.tensor([[1]]), torch.tensor([1]), None)
    accepted = 0
    for seed in range(200):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        (u,), u_final = row_draws(make_generator(seed), 1)
        if u < 0.4:
            accepted += 1
            assert v.output_ids.tolist() == [[1, icdf(p1, u_final)]]
            assert v.num_accepted.tolist() == [1]
        else:
            without_x = p0.clone()
            without_x[1] = 0
            assert v.output_ids.tolist() == [[icdf(without_x, u_final), PAD_ID]]
            assert v.output_ids[0, 0] not in (1, 4)
            assert v.num_accepted.tolist() == [0]
    assert 40 < accepted < 120  # sanity: both branches were exercised


def test_model_draft_accept_iff_u_times_q_below_p_and_residual():
    vocab = 4
    p0 = t([0.1, 0.2, 0.3, 0.4])
    q0 = t([0.4, 0.3, 0.2, 0.1])
    p1 = t([0.0, 0.0, 1.0, 0.0])
    target = torch.stack([p0, p1]).unsqueeze(0)
    draft = Draft(torch.tensor([[1]]), torch.tensor([1]), q0.view(1, 1, vocab))
    branches = set()
    for seed in range(100):
        v = RejectionRule().verify(draft, target, [make_generator(seed)])
        (u,), u_final = row_draws(make_generator(seed), 1)
        if u * 0.3 < 0.2:  # accept with probability 2/3
            branches.add("accept")
            assert v.output_ids.tolist() == [[1, 2]]
        else:
            branches.add("reject")
            residual = (p0 - q0).clamp_min(0)  # [0, 0, 0.1, 0.3]
            assert v.output_ids.tolist() == [[icdf(residual, u_final), PAD_ID]]
            assert v.output_ids[0, 0] in (2, 3)
    assert branches == {"accept", "reject"}


def test_rejection_stops_at_first_rejected_position():
    # position 0 certainly accepted (p = q = one-hot 2), position 1 certainly rejected (p(x) = 0),
    # position 2 would be accepted but is never reached.
    vocab = 4
    target = torch.stack([one_hot(2, vocab), t([0.5, 0.5, 0, 0]), one_hot(3, vocab), one_hot(0, vocab)])
    probs = torch.stack([one_hot(2, vocab), t([0, 0, 0.5, 0.5]), one_hot(3, vocab)])
    draft = Draft(torch.tensor([[2, 3, 3]]), torch.tensor([3]), probs.unsqueeze(0))
    seen = set()
    for seed in range(30):
        v = RejectionRule().verify(draft, target.unsqueeze(0), [make_generator(seed)])
        assert v.num_accepted.tolist() == [1]
        assert v.output_ids[0, 0] == 2 and v.output_ids[0, 2:].tolist() == [PAD_ID, PAD_ID]
        seen.add(int(v.output_ids[0, 1]))
    assert seen == {0, 1}  # recovered from [0.5, 0.5, 0, 0] - [0, 0, .5, .5] -> tokens 0 and 1


def test_ragged_drafts_pad_output_with_minus_one():
    vocab = 3
    target = one_hot(1, vocab).expand(3, 4, vocab).clone()  # every position: token 1 for sure
    draft = Draft.from_lists([[1, 1, 1], [1], []])
    v = RejectionRule().verify(draft, target, [make_generator(0), make_generator(1), make_generator(2)])
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.output_ids.tolist() == [[1, 1, 1, 1], [1, 1, -1, -1], [1, -1, -1, -1]]
    assert v.output_ids.dtype == torch.int64 and v.num_accepted.dtype == torch.int64


def test_row_without_draft_is_plain_sampling():
    """num_tokens = 0 inside a batch, and K = 0 for the whole batch: the output token is exactly
    sample() from target_probs[:, 0] with an identically seeded generator."""
    vocab = 50
    gen = torch.Generator().manual_seed(5)
    target = torch.softmax(torch.randn((3, 4, vocab), generator=gen), dim=-1)
    draft = Draft.from_lists([[3, 4, 5], [], [7]], probs=None)
    for seed in range(20):
        gens = [make_generator(100 + seed), make_generator(seed), make_generator(200 + seed)]
        v = RejectionRule().verify(draft, target, gens)
        want = sample(target[1:2, 0], [make_generator(seed)])
        assert v.output_ids[1].tolist() == [int(want[0]), -1, -1, -1]
        assert v.num_accepted[1] == 0

        empty = Draft(torch.empty((3, 0), dtype=torch.long), torch.zeros(3, dtype=torch.long), None)
        v0 = RejectionRule().verify(empty, target[:, :1], [make_generator(seed + i) for i in range(3)])
        want0 = sample(target[:, 0], [make_generator(seed + i) for i in range(3)])
        assert v0.output_ids.shape == (3, 1)
        assert v0.output_ids[:, 0].tolist() == want0.tolist()
        assert v0.num_accepted.tolist() == [0, 0, 0]


def test_rows_without_generator_are_verified_greedily():
    # (an all-greedy batch takes the rule's modes-only path, a mixed one the general path: the
    # greedy rows of both must give GreedyRule's verdict, ties included: every other case rounds
    # the logits, so that modes tie and the lowest id must win)
    case_gen = torch.Generator().manual_seed(77)
    for case in range(30):
        batch, k, vocab = 5, 4, 7
        logits = torch.randn((batch, k + 1, vocab), generator=case_gen) * 2
        target = torch.softmax(logits.round() if case % 2 else logits, dim=-1)
        ids = torch.where(
            torch.rand((batch, k), generator=case_gen) < 0.6,
            target[:, :k].argmax(dim=-1),
            torch.randint(0, vocab, (batch, k), generator=case_gen),
        )
        num = torch.randint(0, k + 1, (batch,), generator=case_gen)
        ids = torch.where(torch.arange(k) < num.unsqueeze(1), ids, PAD_ID)
        probs = torch.softmax(torch.randn((batch, k, vocab), generator=case_gen), dim=-1)
        for draft_probs in (None, probs):
            draft = Draft(ids, num, draft_probs)
            greedy = GreedyRule().verify(draft, target, [None] * batch)
            assert_same(RejectionRule().verify(draft, target, [None] * batch), greedy)
            mixed = [None, make_generator(1), None, make_generator(2), None]
            v = RejectionRule().verify(draft, target, mixed)
            for b in (0, 2, 4):
                assert torch.equal(v.output_ids[b], greedy.output_ids[b])
                assert v.num_accepted[b] == greedy.num_accepted[b]


def test_the_greedy_verdict_from_modes_is_the_rules_on_their_one_hot_laws():
    """greedy_verdict (the engine's greedy steps: modes read off the logits, no laws built) gives
    what RejectionRule.verify gives on the one-hot laws of the same modes: ties (rounded logits,
    the lowest id), drafts of every length 0..K, draft tokens that are and are not the mode."""
    from verispec.sampling import mode
    from verispec.verify.rejection import greedy_verdict

    gen = torch.Generator().manual_seed(78)
    for case in range(40):
        batch, k, vocab = 5, 4, 9
        logits = torch.randn((batch, k + 1, vocab), generator=gen) * 2
        logits = logits.round() if case % 2 else logits
        modes = mode(logits)  # [B, K + 1]
        one_hot = torch.zeros_like(logits).scatter_(2, modes.unsqueeze(2), 1.0)
        ids = torch.where(
            torch.rand((batch, k), generator=gen) < 0.7,
            modes[:, :k],
            torch.randint(0, vocab, (batch, k), generator=gen),
        )
        num = torch.randint(0, k + 1, (batch,), generator=gen)
        draft = Draft(torch.where(torch.arange(k) < num.unsqueeze(1), ids, PAD_ID), num, None)
        assert_same(greedy_verdict(draft, modes), RejectionRule().verify(draft, one_hot, [None] * batch))


def test_rejection_rule_does_not_touch_global_rng():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    target = torch.full((2, 3, 4), 0.25)
    RejectionRule().verify(Draft.from_lists([[1, 2], [3]]), target, [make_generator(0), None])
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------------------ GreedyRule exact cases


def test_greedy_rule_exact():
    vocab = 4
    target = torch.stack(
        [
            torch.stack([one_hot(2, vocab), t([0.1, 0.6, 0.2, 0.1]), t([0.3, 0.3, 0.3, 0.1]), one_hot(3, vocab)]),
            torch.stack([t([0.4, 0.4, 0.2, 0.0]), one_hot(0, vocab), one_hot(0, vocab), one_hot(0, vocab)]),
            torch.stack([one_hot(1, vocab), one_hot(2, vocab), one_hot(3, vocab), one_hot(0, vocab)]),
            torch.stack([one_hot(3, vocab), one_hot(2, vocab), one_hot(1, vocab), one_hot(0, vocab)]),
        ]
    )
    draft = Draft.from_lists([[2, 1, 1], [1, 0, 0], [1, 2, 3], []])
    g0, g1 = make_generator(0), make_generator(1)
    v = GreedyRule().verify(draft, target, [g0, None, g1, None])
    assert v.output_ids.tolist() == [
        [2, 1, 0, -1],  # 2 ok, 1 ok, 1 != argmax [.3,.3,.3,.1] = 0 (lowest id on ties): emit 0
        [0, -1, -1, -1],  # tie 0.4/0.4 -> argmax 0, draft 1 rejected
        [1, 2, 3, 0],  # all accepted, bonus argmax 0
        [3, -1, -1, -1],  # no draft: the argmax at position 0
    ]
    assert v.num_accepted.tolist() == [2, 0, 3, 0]
    # generators are accepted for interface compatibility and never used
    assert torch.equal(g0.get_state(), make_generator(0).get_state())
    assert torch.equal(g1.get_state(), make_generator(1).get_state())


# ------------------------------------------------------------------------------------------- TypicalRule


def entropy_np(p: list[float]) -> float:
    a = np.asarray(p, dtype=np.float64)
    a = a[a > 0]
    return float(-(a * np.log(a)).sum())


def test_typical_threshold_formula():
    cases = [[0.85, 0.1, 0.05], [0.05, *[0.95 / 9] * 9], [0.25] * 4, [1.0, 0.0, 0.0]]
    for eps, delta in ((0.09, 0.3), (0.2, 0.5), (1.0, 3.0)):
        for p in cases:
            want = min(eps, delta * math.exp(-entropy_np(p)))
            got = float(typical_threshold(t(p), eps, delta))
            assert math.isclose(got, want, rel_tol=1e-6), (p, eps, delta, got, want)


def test_typical_accepts_above_min_of_eps_and_entropy_bar():
    rule = TypicalRule(epsilon=0.09, delta=0.3)
    # confident law: 0.3 exp(-H) = 0.1786 > eps, so the bar is eps = 0.09: p(x) = 0.1 passes
    # (it would fail a bar of delta * exp(-H) alone)
    confident = [0.85, 0.1, 0.05]
    assert 0.3 * math.exp(-entropy_np(confident)) > 0.1
    # flat law over 10: the bar is 0.3 exp(-H) ~ 0.0305 < eps: p(x) = 0.05 passes
    # (it would fail a bar of eps alone)
    flat = [0.05, *[0.95 / 9] * 9]
    assert 0.05 < 0.09 and 0.3 * math.exp(-entropy_np(flat)) < 0.05
    vocab = 10
    pad = [0.0] * (vocab - 3)
    target = t([[[*confident, *pad], flat, [0.1] * 10], [[*confident, *pad], flat, [0.1] * 10]])
    draft = Draft(torch.tensor([[1, 0], [2, 0]]), torch.tensor([2, 2]), None)
    v = rule.verify(draft, target, [None, None])
    assert v.num_accepted.tolist() == [2, 0]  # row 1: p(2) = 0.05 < 0.09 rejected
    assert v.output_ids.tolist() == [[1, 0, 0], [0, -1, -1]]  # greedy rows: argmax (lowest id on ties)


def test_typical_emits_from_target_without_residual():
    """After a rejection the token comes from the target's law itself (no residual correction), so
    the rejected draft token can be emitted; exactly sample() with the same generator."""
    target = t([[0.85, 0.1, 0.05], [0.2, 0.3, 0.5]]).unsqueeze(0)
    draft = Draft(torch.tensor([[2]]), torch.tensor([1]), None)  # p(2) = 0.05 < 0.09: rejected
    emitted = set()
    for seed in range(200):
        v = TypicalRule().verify(draft, target, [make_generator(seed)])
        assert v.num_accepted.tolist() == [0]
        want = int(sample(target[:, 0], [make_generator(seed)])[0])
        assert v.output_ids.tolist() == [[want, -1]]
        emitted.add(want)
    assert 2 in emitted  # the rejection rule's residual would never emit it


def test_typical_equals_greedy_at_temperature_zero():
    case_gen = torch.Generator().manual_seed(31)
    for _ in range(30):
        batch, k, vocab = 4, 3, 9
        logits = torch.randn((batch * (k + 1), vocab), generator=case_gen)
        target = to_probs(logits, [SamplingParams(temperature=0)] * (batch * (k + 1))).view(batch, k + 1, vocab)
        ids = torch.where(
            torch.rand((batch, k), generator=case_gen) < 0.7,
            target[:, :k].argmax(-1),
            torch.randint(0, vocab, (batch, k), generator=case_gen),
        )
        draft = Draft(ids, torch.full((batch,), k), None)
        gens = [make_generator(i) for i in range(batch)]
        assert_same(TypicalRule().verify(draft, target, gens), GreedyRule().verify(draft, target, gens))


def test_typical_rule_rejects_bad_parameters():
    for eps, delta in ((0.0, 0.3), (1.5, 0.3), (float("nan"), 0.3), (0.09, 0.0), (0.09, -1.0)):
        with pytest.raises(ConfigError):
            TypicalRule(eps, delta)
    # regression: NaN compares False to everything, so `delta <= 0` let it through and every
    # draft token was then silently rejected
    for delta in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="delta"):
            TypicalRule(0.09, delta)


# ----------------------------------------------------------------------- fast == reference, randomized


def _random_case(case: int, *, allow_shared_gens: bool = True):
    """A random verification problem: batch, ragged drafts, laws from to_probs (temperatures incl. 0,
    top-k/top-p zeros), draft probs None or from a model, generators None / own / shared."""
    cg = torch.Generator().manual_seed(10_000 + case)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=cg))]

    batch = int(torch.randint(1, 7, (1,), generator=cg))
    k = int(torch.randint(0, 6, (1,), generator=cg))
    vocab = pick([2, 3, 5, 8, 17, 64])
    num = torch.randint(0, k + 1, (batch,), generator=cg)
    temps = [pick([0.0, 0.3, 1.0, 1.0, 2.0]) for _ in range(batch)]
    shape = [pick([0, 0, 2]) for _ in range(batch)]
    params = [SamplingParams(temperature=temps[b], top_k=shape[b], top_p=pick([1.0, 1.0, 0.8])) for b in range(batch)]
    scale = pick([0.5, 2.0, 5.0])
    logits = torch.randn((batch * (k + 1), vocab), generator=cg) * scale
    target = to_probs(logits, [params[b] for b in range(batch) for _ in range(k + 1)]).view(batch, k + 1, vocab)

    draft_probs = None
    if k > 0 and pick(["none", "model", "model"]) == "model":
        near = target[:, :k] * 0.7 + 0.3 * torch.softmax(torch.randn((batch, k, vocab), generator=cg), -1)
        far = torch.softmax(torch.randn((batch, k, vocab), generator=cg) * scale, -1)
        draft_probs = (near if pick([True, False]) else far).contiguous()
        if pick([True, False]):  # some greedy-drafter rows: one-hot draft laws
            hard = to_probs(torch.log(draft_probs.reshape(-1, vocab)), [SamplingParams(temperature=0)] * (batch * k))
            draft_probs = hard.view(batch, k, vocab)
    # draft tokens: from the draft law, from the target, or arbitrary (possibly q(x) = 0 or p(x) = 0)
    how = pick(["draft", "target", "random"])
    source = draft_probs if (how == "draft" and draft_probs is not None) else target[:, :k]
    if how == "random" or k == 0:
        ids = torch.randint(0, vocab, (batch, k), generator=cg)
    else:
        ids = sample(source.reshape(-1, vocab), [make_generator(case)] * (batch * k)).view(batch, k)
    ids = torch.where(torch.arange(k) < num.unsqueeze(1), ids, PAD_ID)

    gens: Gens = []
    for b in range(batch):
        kind = pick(["own", "own", "none", "prev", "earlier"] if allow_shared_gens else ["own", "none"])
        if kind == "none":
            gens.append(None)
        elif kind == "prev" and b > 0 and gens[-1] is not None:
            gens.append(gens[-1])  # consecutive rows sharing one generator
        elif kind == "earlier" and any(g is not None for g in gens):
            gens.append(next(g for g in gens if g is not None))  # may head a non-adjacent run
        else:
            gens.append(make_generator(1000 * case + b))
    return Draft(ids, num, draft_probs), target, gens


N_CASES = 300


def test_random_cases_cover_the_interesting_situations():
    """Guard against a generator of cases that silently stopped producing what the tests need."""
    seen = set()
    for case in range(N_CASES):
        draft, target, gens = _random_case(case)
        v = RejectionRule().verify(draft, target, clone_gens(gens))
        k = draft.max_tokens
        seen.add("probs" if draft.probs is not None else "point")
        if k == 0:
            seen.add("K=0")
        if (draft.num_tokens == 0).any() and k > 0:
            seen.add("ragged-0")
        if any(g is None for g in gens):
            seen.add("greedy-row")
        if any(gens[i] is not None and gens[i] is gens[i + 1] for i in range(len(gens) - 1)):
            seen.add("shared-consecutive")
        runs = [g for i, g in enumerate(gens) if g is not None and (i == 0 or gens[i - 1] is not g)]
        if len(runs) != len({id(g) for g in runs}):
            seen.add("shared-non-adjacent")
        if ((v.num_accepted == draft.num_tokens) & (draft.num_tokens > 0)).any():
            seen.add("full-accept")
        if (v.num_accepted < draft.num_tokens).any():
            seen.add("rejection")
        if (target.amax(-1) == 1).any():
            seen.add("temperature-0")
    assert seen == {
        "probs", "point", "K=0", "ragged-0", "greedy-row", "shared-consecutive", "shared-non-adjacent",
        "full-accept", "rejection", "temperature-0",
    }  # fmt: skip


@pytest.mark.parametrize("check_values", [True, False])
def test_rejection_fast_equals_reference(check_values):
    rule = RejectionRule(check_values=check_values)
    for case in range(N_CASES):
        draft, target, gens = _random_case(case)
        fast_gens, ref_gens = clone_gens(gens), clone_gens(gens)
        fast = rule.verify(draft, target, fast_gens)
        ref = reference_rejection(draft, target, ref_gens)
        assert_same(fast, ref, f"case {case}")
        # the same amount of randomness was consumed from every generator
        for a, b in zip(fast_gens, ref_gens, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.get_state(), b.get_state()), f"case {case}: generator states differ"


def test_rejection_fast_equals_reference_shared_generator_in_non_adjacent_runs():
    """Regression: [g, None, g] (or [g, h, g]) must draw g's uniforms and exponentials run by run
    (randomness protocol). Drawing every run's uniforms first gave different tokens."""
    vocab, k = 6, 2
    cg = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn((3, k + 1, vocab), generator=cg), -1)
    probs = torch.softmax(torch.randn((3, k, vocab), generator=cg), -1)
    draft = Draft(torch.randint(0, vocab, (3, k), generator=cg), torch.tensor([2, 2, 2]), probs)
    for seed in range(100):
        g, h = make_generator(seed), make_generator(seed + 500)
        for gens in ([g, None, g], [g, h, g]):
            fast = RejectionRule().verify(draft, target, clone_gens(gens))
            ref = reference_rejection(draft, target, clone_gens(gens))
            assert_same(fast, ref, f"seed {seed}, {gens}")


def test_greedy_fast_equals_reference():
    for case in range(N_CASES):
        draft, target, gens = _random_case(case)
        assert_same(GreedyRule().verify(draft, target, gens), reference_greedy(draft, target), f"case {case}")


@pytest.mark.parametrize(("epsilon", "delta"), [(0.09, 0.3), (0.3, 0.9), (1.0, 0.05)])
def test_typical_fast_equals_reference(epsilon, delta):
    rule = TypicalRule(epsilon, delta)
    for case in range(N_CASES // 2):
        draft, target, gens = _random_case(case)
        fast = rule.verify(draft, target, clone_gens(gens))
        ref = reference_typical(draft, target, clone_gens(gens), epsilon, delta)
        assert_same(fast, ref, f"case {case}")


# ---------------------------------------------------------------------------- batch == per request


def _sub(draft: Draft, target: torch.Tensor, rows: list[int]) -> tuple[Draft, torch.Tensor]:
    """The sub-batch of `rows`, trimmed to its own longest draft (a different K)."""
    idx = torch.tensor(rows)
    k = int(draft.num_tokens[idx].max()) if rows else 0
    probs = draft.probs[idx, :k] if draft.probs is not None else None
    return Draft(draft.token_ids[idx, :k], draft.num_tokens[idx], probs), target[idx, : k + 1]


@pytest.mark.parametrize("rule", [RejectionRule(), GreedyRule(), TypicalRule()], ids=lambda r: r.name)
def test_batch_equals_per_request(rule):
    subsets = [[0], [3], [6], [0, 2, 5], [6, 1], [1, 3, 4, 6], [5, 4, 3, 2, 1, 0]]
    for case in range(40):
        cg = torch.Generator().manual_seed(case)
        batch, k, vocab = 7, 5, 11
        target = torch.softmax(torch.randn((batch, k + 1, vocab), generator=cg) * 1.5, -1)
        probs = torch.softmax(torch.randn((batch, k, vocab), generator=cg) * 1.5, -1)
        num = torch.randint(0, k + 1, (batch,), generator=cg)
        num[int(torch.randint(0, batch, (1,), generator=cg))] = 0
        ids = sample(target[:, :k].reshape(-1, vocab), [make_generator(case)] * (batch * k)).view(batch, k)
        ids = torch.where(torch.arange(k) < num.unsqueeze(1), ids, PAD_ID)
        gens: Gens = [None if (case + b) % 4 == 0 else make_generator(100 * case + b) for b in range(batch)]
        for draft_probs in (probs, None):
            full_draft = Draft(ids, num, draft_probs)
            full = rule.verify(full_draft, target, clone_gens(gens))
            full_tokens = full.tokens()
            for rows in subsets:
                sub_draft, sub_target = _sub(full_draft, target, rows)
                part = rule.verify(sub_draft, sub_target, clone_gens([gens[r] for r in rows]))
                assert part.tokens() == [full_tokens[r] for r in rows], (case, rows)
                assert part.num_accepted.tolist() == [int(full.num_accepted[r]) for r in rows]


# --------------------------------------------------------------------------- one-step distribution

N_DIST = 200_000
P1 = [0.05, 0.30, 0.10, 0.25, 0.30, 0.00]  # target law at position 1 (token 5 impossible)
Q1 = [0.30, 0.05, 0.25, 0.10, 0.10, 0.20]  # draft law at position 1
P2 = [0.40, 0.10, 0.10, 0.10, 0.10, 0.20]
Q2 = [0.10, 0.35, 0.10, 0.25, 0.10, 0.10]
P3 = [0.10, 0.10, 0.50, 0.10, 0.10, 0.10]  # bonus position (after K = 2 accepted)


def _position_pvalues(rule: RejectionRule, drafter: str) -> tuple[dict[str, float], dict[str, float]]:
    """Verify N_DIST copies of one step (K = 2) as one batch sharing one generator; return the
    chi-square p-values of the token at each output position against the target law there (among
    the rows that reach that position), and the acceptance rates at positions 1 and 2."""
    n, vocab = N_DIST, 6
    p = t([P1, P2, P3])
    q = t([Q1, Q2])
    draft_gen = make_generator(7)
    ids = sample(q.repeat(n, 1), [draft_gen] * (2 * n)).view(n, 2)  # draft tokens really drawn from q
    probs = q.expand(n, 2, vocab) if drafter == "model" else None
    draft = Draft(ids, torch.full((n,), 2), probs)
    v = rule.verify(draft, p.expand(n, 3, vocab), [make_generator(8)] * n)
    out, acc = v.output_ids.numpy(), v.num_accepted.numpy()
    pvalues = {}
    for pos, (law_, reach) in enumerate(((P1, acc >= 0), (P2, acc >= 1), (P3, acc >= 2))):
        tokens = out[reach, pos]
        counts = np.bincount(tokens, minlength=vocab)
        expected = np.asarray(law_) * reach.sum()
        if counts[expected == 0].sum() > 0:  # an impossible token was emitted
            pvalues[f"position {pos + 1}"] = 0.0
            continue
        support = expected > 0
        pvalues[f"position {pos + 1}"] = float(stats.chisquare(counts[support], expected[support]).pvalue)
    rates = {"position 1": float((acc >= 1).mean()), "position 2": float((acc >= 2).sum() / (acc >= 1).sum())}
    return pvalues, rates


@pytest.mark.parametrize("drafter", ["model", "point"])
def test_rejection_rule_output_follows_the_target_law(drafter):
    pvalues, rates = _position_pvalues(RejectionRule(), drafter)
    for pos, pv in pvalues.items():
        assert pv > ALPHA, f"{pos}: p-value {pv:.3g}"
    # AR = sum(min(p, q)) for a model drafter; sum(q(x) p(x)) for point masses drawn from q
    for pos, p, q in (("position 1", P1, Q1), ("position 2", P2, Q2)):
        a, b = np.asarray(p), np.asarray(q)
        expected = float(np.minimum(a, b).sum()) if drafter == "model" else float((a * b).sum())
        reached = N_DIST if pos == "position 1" else N_DIST * rates["position 1"]
        sigma = math.sqrt(expected * (1 - expected) / reached)
        assert abs(rates[pos] - expected) < 6 * sigma, (pos, rates[pos], expected)


@pytest.mark.parametrize("broken", BROKEN_RULES, ids=lambda c: c.name)
def test_broken_rules_fail_the_same_distribution_test(broken):
    """Negative controls: the same test, same sizes and alpha, must reject every broken rule."""
    pvalues, _ = _position_pvalues(broken(), "model")
    assert min(pvalues.values()) < ALPHA, pvalues


# -------------------------------------------------------------------------------- broken rules, exact


def test_always_accept_rule_accepts_impossible_tokens():
    target = t([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]).unsqueeze(0)
    draft = Draft(torch.tensor([[2]]), torch.tensor([1]), t([[[0, 0, 1.0]]]))  # p(2) = 0
    real = RejectionRule().verify(draft, target, [make_generator(0)])
    broken = AlwaysAcceptRule().verify(draft, target, [make_generator(0)])
    assert real.num_accepted.tolist() == [0] and real.output_ids[0, 0] in (0, 1)
    assert broken.num_accepted.tolist() == [1] and broken.output_ids.tolist() == [[2, 2]]


def test_residual_is_target_rule_recovers_from_the_wrong_law():
    # residual max(0, p - q) = [0.5, 0, 0]: the real rule always recovers token 0
    target = t([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]).unsqueeze(0)
    draft = Draft(torch.tensor([[2]]), torch.tensor([1]), t([[[0, 0.5, 0.5]]]))

    def recovered(rule: RejectionRule) -> set[int]:
        return {int(rule.verify(draft, target, [make_generator(s)]).output_ids[0, 0]) for s in range(40)}

    real, bad = recovered(RejectionRule()), recovered(ResidualIsTargetRule())
    assert real == {0}
    assert bad == {0, 1}


def test_bonus_from_draft_rule_takes_the_bonus_from_the_drafter():
    vocab = 4
    target = torch.stack([one_hot(0, vocab), one_hot(3, vocab)]).unsqueeze(0)
    draft = Draft(torch.tensor([[0]]), torch.tensor([1]), one_hot(0, vocab).view(1, 1, vocab))
    real = RejectionRule().verify(draft, target, [make_generator(0)])
    bad = BonusFromDraftRule().verify(draft, target, [make_generator(0)])
    assert real.output_ids.tolist() == [[0, 3]]
    assert bad.output_ids.tolist() == [[0, 0]]
    # point-mass drafts: the "draft law" is the one-hot on the token
    pm = Draft(torch.tensor([[0]]), torch.tensor([1]), None)
    assert BonusFromDraftRule().verify(pm, target, [make_generator(0)]).output_ids.tolist() == [[0, 0]]


def test_off_by_one_rule_judges_against_the_next_position():
    vocab = 3
    target = torch.stack([one_hot(1, vocab), one_hot(2, vocab)]).unsqueeze(0)  # p0(1) = 1, p1(1) = 0
    draft = Draft(torch.tensor([[1]]), torch.tensor([1]), None)
    real = RejectionRule().verify(draft, target, [make_generator(0)])
    bad = OffByOneRule().verify(draft, target, [make_generator(0)])
    assert real.output_ids.tolist() == [[1, 2]] and real.num_accepted.tolist() == [1]
    assert bad.num_accepted.tolist() == [0]


def test_broken_rules_are_all_covered():
    assert set(BROKEN_RULES) == {AlwaysAcceptRule, ResidualIsTargetRule, BonusFromDraftRule, OffByOneRule}


# ------------------------------------------------------------------------------------------ bad input

RULES = [RejectionRule(), GreedyRule(), TypicalRule()]


def _good(batch: int = 2, k: int = 3, vocab: int = 5):
    target = torch.full((batch, k + 1, vocab), 1.0 / vocab)
    probs = torch.full((batch, k, vocab), 1.0 / vocab)
    draft = Draft(torch.tensor([[1, 2, 3], [4, PAD_ID, PAD_ID]]), torch.tensor([3, 1]), probs)
    return draft, target, [make_generator(0), make_generator(1)]


def _poke(x: torch.Tensor, where: tuple[int, ...], value: float) -> torch.Tensor:
    out = x.clone()
    out[where] = value
    return out


def _replace(draft: Draft, **kw) -> Draft:
    fields = {"token_ids": draft.token_ids, "num_tokens": draft.num_tokens, "probs": draft.probs}
    fields.update(kw)
    return Draft(**fields)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_good_inputs_pass(rule):
    draft, target, gens = _good()
    rule.verify(draft, target, gens)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda d, tp, g: (_replace(d, probs=torch.full((2, 3, 6), 1 / 6)), tp, g),
            "vocabulary sizes must match",
        ),
        (lambda d, tp, g: (d, tp[:, :3], g), r"target_probs must be \[B, K \+ 1, V\]"),
        (lambda d, tp, g: (d, tp[0], g), r"target_probs must be \[B, K \+ 1, V\]"),
        (lambda d, tp, g: (d, tp[:1], g), r"target_probs must be \[B, K \+ 1, V\]"),
        (lambda d, tp, g: (_replace(d, token_ids=d.token_ids[0]), tp, g), r"token_ids must be \[B, K\]"),
        (lambda d, tp, g: (_replace(d, num_tokens=torch.tensor([3])), tp, g), r"num_tokens must be \[B\]"),
        (lambda d, tp, g: (_replace(d, num_tokens=torch.tensor([4, 1])), tp, g), r"\[0, K\] = \[0, 3\]"),
        (lambda d, tp, g: (_replace(d, num_tokens=torch.tensor([-1, 1])), tp, g), r"\[0, K\] = \[0, 3\]"),
        (
            lambda d, tp, g: (_replace(d, token_ids=torch.tensor([[1, 2, 5], [4, -1, -1]])), tp, g),
            r"ids in \[0, 5\).*PAD_ID",
        ),
        (
            lambda d, tp, g: (_replace(d, token_ids=torch.tensor([[1, -1, 3], [4, -1, -1]])), tp, g),
            r"ids in \[0, 5\).*PAD_ID",
        ),
        (
            lambda d, tp, g: (_replace(d, token_ids=torch.tensor([[1, 2, 3], [4, 0, -1]])), tp, g),
            r"PAD_ID \(-1\) after them",
        ),
        (lambda d, tp, g: (d, tp * 1.1, g), r"target_probs\[\d+, \d+\].*not a probability distribution"),
        (
            lambda d, tp, g: (d, _poke(tp, (0, 1, 2), float("nan")), g),
            r"target_probs\[\d+, \d+\].*sum nan.*to_probs",
        ),
        (lambda d, tp, g: (d, _poke(_poke(tp, (1, 0, 0), -0.1), (1, 0, 1), 0.5), g), "finite and >= 0"),
        (lambda d, tp, g: (d, tp, g[:1]), "1 generators for a batch of 2; pass one per row"),
        (lambda d, tp, g: (d, tp, [*g, None]), "3 generators for a batch of 2"),
        (
            # a "tree" whose nodes name themselves as parents (chain-only rules refuse any tree)
            lambda d, tp, g: (Draft(d.token_ids, d.num_tokens, d.probs, torch.arange(3).expand(2, 3)), tp, g),
            "earlier node|chains only",
        ),
    ],
)  # fmt: skip
def test_bad_input_raises_input_error(rule, mutate, message):
    draft, target, gens = _good()
    bad_draft, bad_target, bad_gens = mutate(draft, target, gens)
    with pytest.raises(InputError, match=message) as info:
        rule.verify(bad_draft, bad_target, bad_gens)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("rule", [RejectionRule()], ids=lambda r: r.name)
def test_bad_draft_probs_raise(rule):
    draft, target, gens = _good()
    bad = draft.probs.clone()
    bad[0, 1] = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.0])
    with pytest.raises(InputError, match=r"draft.probs\[0, 1\].*to_probs"):
        rule.verify(_replace(draft, probs=bad), target, gens)
    # a row after num_tokens is not checked: it is never used
    unused = draft.probs.clone()
    unused[1, 2] = float("nan")
    rule.verify(_replace(draft, probs=unused), target, gens)
    # ...nor is a target row after the bonus position
    target_unused = target.clone()
    target_unused[1, 3] = 7.0
    rule.verify(draft, target_unused, gens)


def test_check_values_false_skips_only_content_checks():
    draft, target, gens = _good()
    fast = RejectionRule(check_values=False)
    fast.verify(draft, target * 1.0001, gens)  # contents not checked
    with pytest.raises(InputError, match="pass one per row"):
        fast.verify(draft, target, gens[:1])  # shapes always are
