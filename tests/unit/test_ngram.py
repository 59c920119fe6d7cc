from __future__ import annotations

import random

import pytest

from verispec.config import SamplingParams
from verispec.drafters.base import BatchView, Drafter
from verispec.drafters.ngram import NgramDrafter
from verispec.errors import ConfigError, InputError


def naive_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The obvious definition: longest suffix (max_n..min_n) with an earlier occurrence; the most
    recent earlier occurrence proposes what followed it."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_what_followed_the_suffix() -> None:
    d = NgramDrafter(min_n=2, max_n=3)
    d.begin("r", [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.lookup("r", 3) == [4, 5, 9]
    assert d.lookup("r", 1) == [4]


def test_prefers_longest_then_most_recent_match() -> None:
    d = NgramDrafter(min_n=1, max_n=3)
    d.begin("r", [7, 8, 1, 5, 8, 2, 6, 7, 8])
    # suffix (6,7,8) never seen before, (7,8) seen at 0 -> continuation 1
    assert d.lookup("r", 2) == [1, 5]
    d2 = NgramDrafter(min_n=1, max_n=1)
    d2.begin("r", [8, 1, 8, 2, 8])
    assert d2.lookup("r", 1) == [2]  # most recent earlier occurrence of (8,)


def test_no_match_gives_empty_draft_and_incremental_updates() -> None:
    d = NgramDrafter(min_n=2, max_n=2)
    tokens = [1, 2, 3]  # the request's list: the caller commits into it, the drafter reads it
    d.begin("r", tokens)
    assert d.lookup("r", 4) == []
    tokens += [1, 2]
    d.observe("r", [1, 2])
    assert d.lookup("r", 4) == [3, 1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_equals_naive_definition_on_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n = rng.randint(1, 2), rng.randint(2, 5)
    d = NgramDrafter(min_n=min_n, max_n=max_n)
    tokens = [rng.randrange(5) for _ in range(rng.randint(0, 10))]
    d.begin("r", tokens)
    for _ in range(60):
        k = rng.randint(1, 6)
        assert d.lookup("r", k) == naive_lookup(tokens, k, min_n, max_n)
        new = [rng.randrange(5) for _ in range(rng.randint(1, 3))]
        tokens += new
        d.observe("r", new)


def test_propose_batch_is_ragged_point_mass() -> None:
    d = NgramDrafter()
    assert isinstance(d, Drafter)
    d.begin("a", [1, 2, 3, 1, 2])
    d.begin("b", [5, 6, 7])
    view = BatchView(["a", "b"], [SamplingParams()] * 2, [None, None])
    draft = d.propose(view, [4, 4])
    assert draft.probs is None
    assert draft.num_tokens.tolist() == [3, 0]
    assert draft.token_ids.tolist() == [[3, 1, 2], [-1, -1, -1]]
    d.end("a")
    with pytest.raises(InputError, match="begin"):
        d.lookup("a", 2)


def test_long_context_lookup_stays_cheap() -> None:
    d = NgramDrafter(min_n=2, max_n=4)
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(200_000)]
    d.begin("r", tokens)
    d.lookup("r", 4)  # indexes the prompt once
    index = d._index["r"]
    before = index.indexed_end
    tokens += [1, 2]
    d.observe("r", [1, 2])
    d.lookup("r", 4)
    assert index.indexed_end - before == 2  # only the new positions were indexed


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ConfigError):
        NgramDrafter(min_n=0)
    d = NgramDrafter()
    d.begin("r", [1])
    with pytest.raises(InputError, match="unique"):
        d.begin("r", [1])


def test_composite_lookup_runs_to_the_budget_and_the_model_keeps_the_scheduled_length() -> None:
    """In a composite draft, a prompt-lookup row may draft past the scheduled length, up to its
    budget (free tokens); a model row keeps the scheduled length; a row scheduled for 0 gets its
    lookup's draft within its budget (the model's drafts were not worth their passes, a lookup
    costs none), and nothing without one; without budgets (a fixed K) the scheduled length holds
    for both."""
    from verispec.certify.tiny import tiny_pair
    from verispec.drafters.composite import CompositeDrafter
    from verispec.drafters.model import ModelDrafter

    _, draft = tiny_pair(8)
    d = CompositeDrafter(NgramDrafter(), ModelDrafter(draft, vocab_size=8, max_batch=4, max_len=64))
    contexts = {"copy": [1, 2, 3, 4, 5, 6, 7, 1, 2], "fresh": [3, 5, 7], "off": [1, 2, 3, 1, 2]}
    for rid, ctx in contexts.items():
        d.begin(rid, ctx)
    params = [SamplingParams(temperature=0)] * 3
    view = BatchView(list(contexts), params, [None] * 3, budgets=[6, 6, 6])
    draft_ = d.propose(view, [2, 2, 0])
    assert draft_.num_tokens.tolist() == [6, 2, 3]
    assert draft_.token_ids[2, :3].tolist() == [3, 1, 2]  # what followed "1 2", for the row scheduled 0
    assert d.last_free_rows == (True, False, True)
    assert draft_.token_ids[0].tolist() == [3, 4, 5, 6, 7, 1]  # what followed "1 2", past K = 2
    assert draft_.probs is None  # greedy rows: every draft a point mass, no laws built
    again = CompositeDrafter(NgramDrafter(), ModelDrafter(draft, vocab_size=8, max_batch=4, max_len=64))
    again.begin("copy", contexts["copy"])
    again.begin("off", contexts["off"])
    no_room = BatchView(["off"], params[:1], [None], budgets=[0])
    assert again.propose(no_room, [0]).num_tokens.tolist() == [0]
    fixed = BatchView(["copy"], params[:1], [None])  # no budgets: K holds
    assert again.propose(fixed, [2]).token_ids.tolist() == [[3, 4]]


def test_the_registry_composite_looks_up_agreed_continuations_and_else_lets_the_model_draft() -> None:
    """``--drafter composite``: the suffix lookup drafts (point masses) where the earlier
    occurrences of the current suffix agree; where they disagree or nothing matches, the model
    drafts its scheduled length with its own law."""
    import torch

    from verispec.certify.tiny import tiny_pair
    from verispec.drafters.registry import make_drafter
    from verispec.drafters.suffix import SuffixDrafter
    from verispec.sampling import make_generator

    _, draft = tiny_pair(8)
    d = make_drafter("composite", draft_model=draft, vocab_size=8, max_batch=4, max_len=64)
    assert isinstance(d.lookup, SuffixDrafter)  # type: ignore[attr-defined]
    contexts = {"agreed": [1, 2, 3, 4, 5, 6, 7, 1, 2], "split": [1, 2, 3, 1, 2, 4, 1, 2], "fresh": [3, 5, 7]}
    for rid, ctx in contexts.items():
        d.begin(rid, ctx)
    sampled = [SamplingParams(temperature=1.0)] * 3  # (greedy rows would all be point masses, no laws)
    view = BatchView(list(contexts), sampled, [make_generator(i) for i in range(3)], budgets=[6, 6, 6])
    out = d.propose(view, [2, 2, 2])
    assert out.num_tokens.tolist() == [4, 2, 2]  # a 2-token match drafts 2 x 2 at most; the model K = 2
    assert out.token_ids[0, :4].tolist() == [3, 4, 5, 6]
    assert out.probs is not None
    assert torch.equal(out.probs[0, :4].amax(-1), torch.ones(4))  # point masses
    assert torch.allclose(out.probs[1:, :2].sum(-1), torch.ones(2, 2))  # the model's laws


def test_the_composite_says_how_many_model_passes_it_ran_and_which_rows_were_free() -> None:
    from verispec.certify.tiny import tiny_pair
    from verispec.drafters.registry import make_drafter

    _, draft = tiny_pair(8)
    d = make_drafter("composite", draft_model=draft, vocab_size=8, max_batch=4, max_len=64)
    d.begin("agreed", [1, 2, 3, 4, 5, 6, 7, 1, 2])
    d.begin("fresh", [3, 5, 7])
    params = [SamplingParams(temperature=0)] * 2
    d.propose(BatchView(["agreed"], params[:1], [None], budgets=[6]), [2])
    assert d.last_draft_passes == 0  # type: ignore[attr-defined]  # the lookup drafted the only row
    assert d.last_free_rows == (True,)  # type: ignore[attr-defined]
    d.propose(BatchView(["agreed", "fresh"], params, [None] * 2, budgets=[6, 6]), [2, 3])
    assert d.last_draft_passes == 3  # type: ignore[attr-defined]  # the model drafted 3 for the fresh row
    assert d.last_free_rows == (True, False)  # type: ignore[attr-defined]


def test_the_commands_draft_with_the_composite_unless_told_otherwise() -> None:
    from verispec.cli import build_parser

    parser = build_parser()
    for command in ("generate", "serve", "bench", "gate"):
        args = parser.parse_args([command] + (["hello"] if command == "generate" else []))
        assert args.drafter == "composite", command
    assert parser.parse_args(["generate", "hi", "--drafter", "model"]).drafter == "model"
