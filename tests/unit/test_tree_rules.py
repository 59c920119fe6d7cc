"""Unit tests of the tree rules (verispec.verify.tree) and block verification (verispec.verify.block).

- a chain through the tree walk is the chain rule's verdict bit for bit (every kind of children);
- fast == slow reference EXACTLY under identical generator states, over random trees and chains;
- one-step laws: the first emitted token follows the target (chi-square, alpha = 1e-6) for each
  rule with the children it was made for, and the negative controls fail the same test;
- block verification: its output law equals the target's exactly (by enumeration) and its
  expected accepted length is never below the token-wise rule's;
- misuse (a rule for other children, bad parents, a chain-only rule on a tree) is a typed error.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from tests.unit.test_verify import N_CASES, _random_case, assert_same, clone_gens
from verispec.config import SamplingParams
from verispec.errors import ConfigError, InputError
from verispec.sampling import make_generator, to_probs
from verispec.verify import PAD_ID, Draft, GreedyRule, RejectionRule, TypicalRule
from verispec.verify.block import BlockRule, block_terms
from verispec.verify.broken import SiblingMassLeftRule
from verispec.verify.reference import reference_block, reference_rejection, reference_tree
from verispec.verify.tree import (
    TREE_RULES,
    MultiRoundRule,
    PointMassTreeRule,
    WithoutReplacementRule,
    chain_parents,
    depths,
    path_matrix,
    walk,
)

ALPHA = 1e-6
Gens = list[torch.Generator | None]


def _random_tree(case: int):
    """A random tree problem: batch, ragged trees (random parents), one kind of children, target
    laws from to_probs (temperatures incl. 0), children drawn as their kind says (or arbitrary),
    generators None / own / shared."""
    cg = torch.Generator().manual_seed(50_000 + case)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=cg))]

    batch = int(torch.randint(1, 6, (1,), generator=cg))
    k = int(torch.randint(0, 9, (1,), generator=cg))
    vocab = pick([3, 5, 8, 17])
    kind = pick(["sampled", "distinct", "fixed"])
    num = torch.randint(0, k + 1, (batch,), generator=cg)
    temps = [pick([0.0, 0.5, 1.0, 1.0, 2.0]) for _ in range(batch)]
    params = [SamplingParams(temperature=temps[b], top_k=pick([0, 0, 2])) for b in range(batch)]
    scale = pick([0.5, 2.0, 4.0])
    logits = torch.randn((batch * (k + 1), vocab), generator=cg) * scale
    target = to_probs(logits, [params[b] for b in range(batch) for _ in range(k + 1)]).view(batch, k + 1, vocab)
    # the draft's law after each node (row 1 + i) and at the root (row 0)
    node_laws = torch.softmax(torch.randn((batch, k + 1, vocab), generator=cg) * scale, -1)
    node_laws = 0.5 * node_laws + 0.5 * target if pick([True, False]) else node_laws

    parents = torch.full((batch, k), PAD_ID, dtype=torch.long)
    ids = torch.full((batch, k), PAD_ID, dtype=torch.long)
    probs = torch.zeros((batch, k, vocab)) if kind != "fixed" else None
    arbitrary = pick([False, False, True])
    for b in range(batch):
        taken: dict[int, list[int]] = {}
        for i in range(int(num[b])):
            par = int(torch.randint(-1, i, (1,), generator=cg)) if i > 0 else -1
            parents[b, i] = par
            law = node_laws[b, par + 1].clone()
            siblings = taken.setdefault(par, [])
            if kind != "fixed":
                probs[b, i] = law  # type: ignore[index]
            if arbitrary:
                x = int(torch.randint(0, vocab, (1,), generator=cg))
            elif kind == "sampled":
                x = int(torch.multinomial(law, 1, generator=cg))
            else:  # without replacement: from the law less the earlier siblings (fixed: the next best)
                law[siblings] = 0.0
                if float(law.sum()) <= 0:
                    x = int(torch.randint(0, vocab, (1,), generator=cg))
                elif kind == "distinct":
                    x = int(torch.multinomial(law, 1, generator=cg))
                else:
                    x = int(law.argmax())
            siblings.append(x)
            ids[b, i] = x
    gens: Gens = []
    for b in range(batch):
        how = pick(["own", "own", "none", "prev"])
        if how == "none":
            gens.append(None)
        elif how == "prev" and b > 0 and gens[-1] is not None:
            gens.append(gens[-1])
        else:
            gens.append(make_generator(700 * case + b))
    return Draft(ids, num, probs, parents, kind), target, gens


def _same_states(a: Gens, b: Gens) -> bool:
    return all(
        (x is None) == (y is None) and (x is None or torch.equal(x.get_state(), y.get_state()))
        for x, y in zip(a, b, strict=True)
    )


# ------------------------------------------------------------------------------------ structure


def test_chain_parents_paths_and_depths():
    num = torch.tensor([3, 1, 0])
    par = chain_parents(num, 3)
    assert par.tolist() == [[-1, 0, 1], [-1, PAD_ID, PAD_ID], [PAD_ID] * 3]
    tree = torch.tensor([[-1, -1, 0, 2, 1]])
    on = path_matrix(tree, torch.tensor([5]))
    assert on[0, 0].tolist() == [False] * 5  # the root's path is empty
    assert on[0, 4].nonzero().squeeze(1).tolist() == [0, 2, 3]  # node 3: 0 -> 2 -> 3
    assert depths(tree, torch.tensor([5])).tolist() == [[1, 1, 2, 3, 2]]


def test_hand_built_tree_walk():
    """Root law p = (0.5, 0.3, 0.2); fixed candidates [1, 0] at the root, node 2 a child of node 1.
    u = 0.9 rejects token 1 (p = 0.3), then token 0 is judged against the residual (0.5, 0, 0.2)
    / 0.7: u = 0.5 < 0.714 accepts it and the walk moves to node 1 (token 0) and on to its child."""
    vocab = 3
    target = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.7, 0.1], [0.6, 0.2, 0.2]]])
    draft = Draft(torch.tensor([[1, 0, 1]]), torch.tensor([3]), None, torch.tensor([[-1, -1, 1]]))
    assert draft.children == "fixed"
    gen = make_generator(0)
    u = torch.rand(4, dtype=torch.float64, generator=make_generator(0)).tolist()
    v = PointMassTreeRule().verify(draft, target, [gen])
    # the decisions follow from the draws: replay them
    r = [0.5, 0.3, 0.2]
    first_ok = u[0] < r[1]
    if first_ok:
        assert v.path[0, 0].item() == 0
    else:
        second_ok = u[1] < r[0] / (r[0] + r[2])
        assert (v.path[0, 0].item() == 1) == second_ok
    assert v.output_ids.shape == (1, 4) and int(v.num_accepted) <= 2
    assert vocab == target.shape[2]


# ------------------------------------------------------------------------------ exact equalities


@pytest.mark.parametrize("kind", ["sampled", "distinct", "fixed"])
def test_a_chain_through_the_walk_is_the_chain_rule(kind):
    """Every chain case of the chain rule's random tests, relabelled as `kind` children where
    that fits, gives the chain rule's verdict and draws the same randomness."""
    for case in range(N_CASES):
        draft, target, gens = _random_case(case)
        if (draft.probs is None) != (kind == "fixed"):
            continue
        chain = Draft(draft.token_ids, draft.num_tokens, draft.probs, None, kind)
        g1, g2 = clone_gens(gens), clone_gens(gens)
        assert_same(walk(chain, target, g1, kind), RejectionRule().verify(draft, target, g2), f"case {case}")
        assert _same_states(g1, g2)
        as_tree = Draft(
            draft.token_ids, draft.num_tokens, draft.probs, chain_parents(draft.num_tokens, draft.max_tokens), kind
        )
        assert_same(walk(as_tree, target, clone_gens(gens), kind), reference_rejection(draft, target, clone_gens(gens)))


def test_tree_rules_equal_the_reference():
    seen = set()
    for case in range(N_CASES):
        draft, target, gens = _random_tree(case)
        rule = {"sampled": MultiRoundRule, "distinct": WithoutReplacementRule, "fixed": PointMassTreeRule}[
            draft.children
        ]()
        g1, g2 = clone_gens(gens), clone_gens(gens)
        fast = rule.verify(draft, target, g1)
        ref = reference_tree(draft, target, g2, draft.children)
        assert_same(fast, ref, f"case {case}")
        assert torch.equal(fast.path, ref.path), f"case {case}"
        assert _same_states(g1, g2)
        assert_same(RejectionRule().verify(draft, target, clone_gens(gens)), fast)  # the rejection rule delegates
        seen.add(draft.children)
        if draft.max_tokens and (fast.num_accepted >= 2).any():
            seen.add("deep")
        if (depths(draft.parents, draft.num_tokens) == 1).sum(dim=1).gt(1).any():  # type: ignore[arg-type]
            seen.add("siblings")
    assert seen >= {"sampled", "distinct", "fixed", "deep", "siblings"}


def test_greedy_rule_on_trees_takes_the_longest_argmax_path():
    for case in range(100):
        draft, target, gens = _random_tree(case)
        v = GreedyRule().verify(draft, target, gens)
        ref = reference_tree(draft, target, [None] * draft.batch_size, draft.children)
        assert_same(v, ref, f"case {case}")
        for b in range(draft.batch_size):  # every accepted node is the argmax after its parent
            node = -1
            for j in v.path[b, : int(v.num_accepted[b])].tolist():
                assert int(draft.parents[b, j]) == node  # type: ignore[index]
                assert int(draft.token_ids[b, j]) == int(target[b, node + 1].argmax())
                node = j
            assert int(v.output_ids[b, int(v.num_accepted[b])]) == int(target[b, node + 1].argmax())


def test_block_rule_equals_the_reference():
    for case in range(N_CASES):
        draft, target, gens = _random_case(case)
        g1, g2 = clone_gens(gens), clone_gens(gens)
        assert_same(BlockRule().verify(draft, target, g1), reference_block(draft, target, g2), f"case {case}")
        assert _same_states(g1, g2)


# --------------------------------------------------------------------------- block verification


def _laws(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    table: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def law(which: str, prefix: tuple[int, ...]) -> np.ndarray:
        if (which, prefix) not in table:
            x = rng.random(vocab) ** 3
            table[which, prefix] = x / x.sum()
        return table[which, prefix]

    return law


@pytest.mark.parametrize(("vocab", "gamma", "seed"), [(2, 2, 0), (3, 3, 1), (3, 2, 2), (4, 3, 3)])
def test_block_verification_is_exactly_lossless_and_never_accepts_less(vocab, gamma, seed):
    """By enumeration over every draft block, with the rule's own stopping probabilities
    (block_terms): the law of the first gamma + 1 tokens (the block step, then plain target
    sampling) is the target's, and E[accepted] is at least the token-wise rule's."""
    law = _laws(vocab, seed)
    n = gamma + 1
    blocks = list(itertools.product(range(vocab), repeat=gamma))
    target = torch.tensor(np.array([[law("b", x[:i]) for i in range(gamma + 1)] for x in blocks]))
    probs = torch.tensor(np.array([[law("s", x[:i]) for i in range(gamma)] for x in blocks]))
    draft = Draft(torch.tensor(blocks, dtype=torch.long), torch.full((len(blocks),), gamma), probs)
    s, w, h = block_terms(draft, target)  # [N, K, V], [N, K + 1], [N, K] float64
    out = dict.fromkeys(itertools.product(range(vocab), repeat=n), 0.0)
    e_block = e_token = 0.0
    for row, x in enumerate(blocks):
        p_x = float(np.prod([law("s", x[:i])[x[i]] for i in range(gamma)]))
        hs = h[row].tolist()
        # tau = the largest i with u_i < h_i: P(tau = i) = h_i * prod_{j > i} (1 - h_j)
        p_tau = [float(np.prod([1 - hj for hj in hs]))]
        p_tau += [hs[i - 1] * float(np.prod([1 - hj for hj in hs[i:]])) for i in range(1, gamma + 1)]
        e_block += p_x * sum(i * pt for i, pt in enumerate(p_tau))
        ratios = [min(1.0, law("b", x[:j])[x[j]] / law("s", x[:j])[x[j]]) for j in range(gamma)]
        e_token += p_x * sum(float(np.prod(ratios[:i])) for i in range(1, gamma + 1))
        for tau, pt in enumerate(p_tau):
            if pt == 0:
                continue
            pre = x[:tau]
            if tau == gamma:
                final = target[row, tau].numpy()
            else:
                final = np.clip(float(w[row, tau]) * target[row, tau].numpy() - s[row, tau].numpy(), 0, None)
            final = final / final.sum()
            for y in range(vocab):
                for tail in itertools.product(range(vocab), repeat=n - tau - 1):
                    z = (*pre, y, *tail)
                    prob = p_x * pt * final[y]
                    for t_ in range(tau + 1, n):
                        prob *= law("b", z[:t_])[z[t_]]
                    out[z] += prob
    exact = {z: float(np.prod([law("b", z[:t_])[z[t_]] for t_ in range(n)])) for z in out}
    assert 0.5 * sum(abs(out[z] - exact[z]) for z in out) < 1e-12
    assert e_block >= e_token - 1e-12
    assert e_block > e_token + 1e-4  # and here strictly more


def test_block_rule_matches_the_formula_on_hand_built_laws():
    """Two tokens, p = (0.4, 0.6) everywhere, draft q = (0.8, 0.2) everywhere, draft [0, 0]:
    w_1 = 0.5, w_2 = 0.25; R_1 = sum max(0, 0.5 p - q) = 0.1, h_1 = 0.1 / 0.6; h_2 = w_2."""
    target = torch.tensor([[[0.4, 0.6]] * 3])
    probs = torch.tensor([[[0.8, 0.2]] * 2])
    draft = Draft(torch.tensor([[0, 0]]), torch.tensor([2]), probs)
    for seed in range(200):
        gen = make_generator(seed)
        u = torch.rand(3, dtype=torch.float64, generator=make_generator(seed)).tolist()
        v = BlockRule().verify(draft, target, [gen])
        expect = 2 if u[1] < 0.25 else (1 if u[0] < 0.1 / 0.6 else 0)
        assert int(v.num_accepted) == expect, (seed, u)
        if expect < 2:  # the residual max(0, w p - q): only token 1 has mass
            assert int(v.output_ids[0, expect]) == 1


# ------------------------------------------------------------------------------- one-step laws

N_ROWS = 60_000


def _one_step(rule, kind: str, m: int, seed: int, *, mislabel: bool = False):
    """Counts of the first emitted token over N_ROWS rows: a root with m children of `kind` (for
    'fixed', the draft's top-m; for 'sampled', i.i.d.; for 'distinct', without replacement),
    against the target law p. `mislabel` hands fixed top-m children to the rule as 'sampled'."""
    vocab = 5
    gen = torch.Generator().manual_seed(seed)
    p = torch.tensor([0.35, 0.25, 0.2, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    rows = N_ROWS
    if kind == "sampled" and not mislabel:
        ids = torch.multinomial(q.expand(rows, vocab), m, replacement=True, generator=gen)
    elif kind == "distinct":
        ids = torch.multinomial(q.expand(rows, vocab), m, replacement=False, generator=gen)
    else:
        ids = q.argsort(descending=True)[:m].expand(rows, m).contiguous()
    parents = torch.full((rows, m), -1, dtype=torch.long)
    target = p.expand(rows, m + 1, vocab).contiguous()
    probs = None if kind == "fixed" and not mislabel else q.expand(rows, m, vocab).contiguous()
    draft = Draft(ids, torch.full((rows,), m), probs, parents, "sampled" if mislabel else kind)
    v = rule.verify(draft, target, [make_generator(seed + 1)] * rows)
    first = v.output_ids[:, 0]
    return np.bincount(first.numpy(), minlength=vocab), p.numpy()


@pytest.mark.parametrize("kind", ["sampled", "distinct", "fixed"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_the_first_token_follows_the_target_law(kind, m):
    rule = {"sampled": MultiRoundRule, "distinct": WithoutReplacementRule, "fixed": PointMassTreeRule}[kind]()
    counts, p = _one_step(rule, kind, m, seed=10 * m)
    assert stats.chisquare(counts, counts.sum() * p).pvalue >= ALPHA


def test_negative_controls_fail_the_one_step_test():
    # a rejected sibling's mass left in the residual
    counts, p = _one_step(SiblingMassLeftRule(), "sampled", 3, seed=5)
    assert stats.chisquare(counts, counts.sum() * p).pvalue < ALPHA
    # the i.i.d. rule on deterministic (top-k) children labelled as sampled
    counts, p = _one_step(MultiRoundRule(), "fixed", 3, seed=6, mislabel=True)
    assert stats.chisquare(counts, counts.sum() * p).pvalue < ALPHA


# ------------------------------------------------------------------------------------- misuse


def test_a_rule_for_other_children_is_a_config_error():
    draft, target, gens = next(
        (d, t, g) for d, t, g in (_random_tree(c) for c in range(200)) if d.children == "fixed" and d.max_tokens > 0
    )
    for name, cls in TREE_RULES.items():
        if cls.kind == "fixed":
            continue
        with pytest.raises(ConfigError, match=f"the {name} rule verifies"):
            cls().verify(draft, target, gens)


def test_chain_rules_reject_trees_with_a_remedy():
    draft, target, gens = next((d, t, g) for d, t, g in (_random_tree(c) for c in range(200)) if d.max_tokens > 1)
    for rule in (BlockRule(), TypicalRule()):
        with pytest.raises(InputError, match="chains only"):
            rule.verify(draft, target, gens)


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([[0, -1]], "earlier node"),
        ([[-1, 1]], "earlier node"),
        ([[-1, -2]], "earlier node"),
        ([[-1, 5]], "earlier node"),
    ],
)
def test_bad_parents_raise(parents, message):
    target = torch.full((1, 3, 4), 0.25)
    draft = Draft(torch.tensor([[1, 2]]), torch.tensor([2]), None, torch.tensor(parents))
    with pytest.raises(InputError, match=message):
        PointMassTreeRule().verify(draft, target, [make_generator(0)])


def test_draft_children_must_fit_its_probs():
    ids, num = torch.tensor([[1]]), torch.tensor([1])
    with pytest.raises(InputError, match="probs=None"):
        Draft(ids, num, torch.full((1, 1, 3), 1 / 3), None, "fixed")
    with pytest.raises(InputError, match=r"draft\.probs"):
        Draft(ids, num, None, None, "distinct")
    with pytest.raises(InputError, match="one of"):
        Draft(ids, num, None, None, "beam")


def test_greedy_rows_of_a_distinct_tree_try_every_sibling():
    """A greedy request's children in a "distinct" draft carry one-hot laws (the drafter took its
    top-k): the walk must not mistake a later sibling for an exhausted draw and skip it."""
    vocab = 4
    target = torch.tensor([[[0.1, 0.2, 0.6, 0.1], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]]])
    probs = torch.zeros((1, 2, vocab))
    probs[0, 0, 1] = probs[0, 1, 2] = 1.0  # top-2 children 1 and 2, each with a point-mass law
    draft = Draft(torch.tensor([[1, 2]]), torch.tensor([2]), probs, torch.tensor([[-1, -1]]), "distinct")
    for verdict in (walk(draft, target, [None], "distinct"), reference_tree(draft, target, [None], "distinct")):
        assert verdict.path[0, 0].item() == 1  # token 2 is the target's argmax
        assert verdict.output_ids[0].tolist() == [2, 0, PAD_ID]  # then the argmax after node 1
