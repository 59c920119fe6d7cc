"""SpecStats: vLLM's acceptance definitions, and for trees the acceptance by child rank."""

from __future__ import annotations

import pytest

from verispec.metrics import SpecStats


def test_chain_counts_follow_the_vllm_definitions() -> None:
    s = SpecStats()
    s.observe(4, 2)
    s.observe(4, 4)
    s.observe(0, 0)  # a step without a draft is no draft
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 8, 6)
    assert s.accepted_per_pos == [2, 2, 1, 1]
    assert s.acceptance_rate == 0.75 and s.mean_acceptance_length == 4.0
    with pytest.raises(ValueError):
        s.observe(2, 3)


def test_free_drafts_are_counted_in_the_totals_and_apart() -> None:
    """A composite's lookup drafts (no model pass) count like any draft, and apart as well, so the
    model's own acceptance is what is left."""
    s = SpecStats()
    s.observe(6, 6, free=True)
    s.observe(3, 1)
    s.observe(4, 2, free=True)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 13, 9)
    assert (s.num_free_drafts, s.num_free_draft_tokens, s.num_free_accepted_tokens) == (2, 10, 8)
    both = s.merge(s)
    assert (both.num_free_drafts, both.num_free_draft_tokens, both.num_free_accepted_tokens) == (4, 20, 16)
    assert s.as_dict()["num_free_accepted_tokens"] == 8


def test_draft_lengths_chosen_per_step_are_counted_where_drafted() -> None:
    import torch

    one, batched = SpecStats(), SpecStats()
    steps = [(2, 2), (5, 3), (3, 3), (1, 0), (4, 4)]  # (drafted, accepted): two rejections
    for k, n in steps:
        one.observe(k, n)
    drafted, accepted = (torch.tensor(list(col)) for col in zip(*steps, strict=True))
    batched.observe_tensors(drafted, accepted)
    for s in (one, batched, SpecStats().merge(one)):
        assert s.drafted_per_pos == [5, 4, 3, 2, 1] and s.accepted_per_pos == [4, 4, 3, 1, 0]
        assert s.num_rejected == 2
        assert s.acceptance_where_drafted == [4 / 5, 1.0, 1.0, 0.5, 0.0]
        assert s.alpha == pytest.approx(12 / 14)  # 12 acceptances, 2 rejections
    # the share of all steps falls where short drafts stopped, though nothing was rejected there
    assert one.acceptance_per_position == [0.8, 0.8, 0.6, 0.2, 0.0]
    assert SpecStats().alpha is None


def test_acceptance_by_child_rank_counts_every_visited_node() -> None:
    # root -> a (rank 0), b (rank 1); b -> c (rank 0), d (rank 1); d has no children
    parents = [-1, -1, 1, 1]
    s = SpecStats()
    s.observe_tree(parents, [1, 3])  # b, then d: at the root rank 1 won, at b rank 1 won
    assert s.rank_reached == [2, 2] and s.rank_accepted == [0, 2]
    s.observe_tree(parents, [0])  # a accepted: a has no children, nothing more verified
    s.observe_tree(parents, [])  # nothing accepted
    assert s.rank_reached == [4, 4] and s.rank_accepted == [1, 2]
    assert s.positional_acceptance == [0.25, 0.5]
    merged = s.merge(s)
    assert merged.rank_reached == [8, 8] and merged.positional_acceptance == [0.25, 0.5]
    assert s.as_dict()["positional_acceptance"] == [0.25, 0.5]
    with pytest.raises(ValueError, match="not a child"):
        s.observe_tree(parents, [2])  # c is not a child of the root


def test_a_chain_through_observe_tree_is_the_per_token_acceptance() -> None:
    s = SpecStats()
    s.observe_tree([-1, 0, 1], [0, 1])  # two of three accepted
    assert s.rank_reached == [3] and s.rank_accepted == [2]
