"""The suffix drafter: trees of the continuations that followed the current suffix before, in
this request and in earlier ones; deterministic candidates (point-mass rule); bounded memory."""

from __future__ import annotations

import pytest

from verispec.config import SamplingParams
from verispec.drafters.base import BatchView
from verispec.drafters.suffix import SuffixDrafter
from verispec.errors import ConfigError, InputError
from verispec.sampling import make_generator
from verispec.verify.tree import depths


def view(ids: list[str], room: int = 16) -> BatchView:
    return BatchView(ids, [SamplingParams()] * len(ids), [None] * len(ids), None, [room] * len(ids))


def test_a_repeated_phrase_drafts_its_continuation():
    d = SuffixDrafter(min_n=2, max_n=4, depth=4, min_share=0.1)
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    d.begin("a", tokens)
    draft = d.propose(view(["a"]), [4])
    assert draft.is_tree and draft.children == "fixed" and draft.probs is None
    n = int(draft.num_tokens[0])
    assert draft.token_ids[0, :n].tolist() == [4, 5, 9, 1]  # what followed 1 2 3
    assert draft.parents[0, :n].tolist() == [-1, 0, 1, 2]  # one match: a chain


def test_two_continuations_make_two_branches_best_first():
    d = SuffixDrafter(min_n=1, max_n=3, depth=2, min_share=0.2)
    tokens = [7, 8, 1, 7, 8, 1, 7, 8, 2, 7, 8]
    d.begin("a", tokens)
    draft = d.propose(view(["a"]), [4])
    n = int(draft.num_tokens[0])
    toks, pars = draft.token_ids[0, :n].tolist(), draft.parents[0, :n].tolist()
    roots = [t for t, p in zip(toks, pars, strict=True) if p == -1]
    assert roots[0] == 1 and 2 in roots  # 1 followed "7 8" twice, 2 once: the likelier first
    assert all(p < i for i, p in enumerate(pars))
    assert int(depths(draft.parents, draft.num_tokens).max()) == 2


def test_the_budget_and_the_room_cap_the_tree():
    d = SuffixDrafter(min_n=1, max_n=2, depth=8, max_nodes=16, min_share=0.01, spec_factor=16)
    tokens = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 3]
    d.begin("a", tokens)
    assert int(d.propose(view(["a"], room=3), [4]).num_tokens[0]) == 3
    assert int(d.propose(view(["a"]), [0]).num_tokens[0]) == 0  # K = 0: no draft


def test_finished_outputs_feed_later_requests_and_the_corpus_is_bounded():
    d = SuffixDrafter(min_n=2, max_n=3, depth=3, corpus_tokens=12)
    d.begin("first", [5, 6, 7, 8, 9])
    d.end("first")
    d.begin("second", [1, 5, 6])  # "5 6" occurred only in the first request
    draft = d.propose(view(["second"]), [3])
    assert draft.token_ids[0, : int(draft.num_tokens[0])].tolist() == [7, 8, 9]
    d.end("second")
    for i in range(4):  # push the first request out of a 12-token corpus
        d.begin(f"x{i}", [20 + i, 30 + i, 40 + i, 50 + i])
        d.end(f"x{i}")
    assert d._corpus_size <= 12
    d.begin("third", [1, 5, 6])
    assert int(d.propose(view(["third"]), [3]).num_tokens[0]) == 0


def test_seeded_samples_do_not_read_the_corpus():
    """A seeded sampled request's text must not depend on what other requests wrote (README,
    Seeds): its drafts and lookups come from its own tokens; greedy and unseeded sampled rows in
    the same batch still draft from the corpus (the composite: tests/integration/test_engine.py)."""
    d = SuffixDrafter(min_n=2, max_n=3, depth=3)
    d.begin("first", [5, 6, 7, 8, 9])
    d.end("first")
    kinds = {
        "greedy": (SamplingParams(seed=1), None),  # (a seed without sampling decides nothing)
        "unseeded": (SamplingParams(temperature=0.8), make_generator(None)),
        "seeded": (SamplingParams(temperature=0.8, seed=1), make_generator(1)),
    }
    for rid in kinds:
        d.begin(rid, [1, 5, 6])  # "5 6" occurred only in the finished request
    rows = list(kinds)
    batch = BatchView(rows, [kinds[r][0] for r in rows], [kinds[r][1] for r in rows], None, [16] * 3)
    draft = d.propose(batch, [3] * 3)
    assert draft.num_tokens.tolist() == [3, 3, 0]
    assert [d.lookup(r, 3, seeded=r == "seeded") for r in rows] == [[7, 8, 9], [7, 8, 9], []]


def test_bad_options_and_unknown_requests():
    with pytest.raises(ConfigError):
        SuffixDrafter(min_n=3, max_n=2)
    with pytest.raises(ConfigError):
        SuffixDrafter(min_share=0.0)
    d = SuffixDrafter()
    with pytest.raises(InputError, match="begin"):
        d.propose(view(["nobody"]), [2])
    d.begin("a", [1])
    with pytest.raises(InputError, match="already running"):
        d.begin("a", [1])


def test_a_short_match_drafts_a_short_guess():
    """At most spec_factor x the match's length nodes (SuffixDecoding's adaptive draft size)."""
    tokens = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 3]
    for factor, n in ((1.0, 1), (2.0, 2), (8.0, 8)):
        d = SuffixDrafter(min_n=1, max_n=4, depth=8, max_nodes=16, min_share=0.01, spec_factor=factor)
        d.begin("a", tokens)  # only "3" matches (one token)
        assert int(d.propose(view(["a"]), [8]).num_tokens[0]) == n
    with pytest.raises(ConfigError):
        SuffixDrafter(spec_factor=0.0)


def test_lookup_is_the_continuation_most_matches_agree_on():
    """The composite drafter's chain: from the longest matching suffix, the most frequent next
    token while enough of the continuations go through it; nothing when they disagree at once."""
    d = SuffixDrafter(min_n=2, max_n=3, depth=4, spec_factor=4)
    # "7 8" continued with 1 2 three times and with 1 5 once
    d.begin("a", [7, 8, 1, 2, 9, 7, 8, 1, 2, 6, 7, 8, 1, 2, 4, 7, 8, 1, 5, 3, 7, 8])
    assert d.lookup("a", 8) == [1, 2]  # 1: 4 of 4; 2: 3 of 4 (>= 0.7); then 9, 6, 4: 1 of 4 each
    assert d.lookup("a", 8, min_share=0.9) == [1]  # 2 is 3 of 4 only
    assert d.lookup("a", 1) == [1]  # at most k
    d.begin("b", [4, 5, 6, 4, 5, 7, 4, 5])  # "4 5" continues 6 .. and 7 ..: no majority
    assert d.lookup("b", 4) == []
    d.begin("c", [1, 2, 3])  # no earlier occurrence
    assert d.lookup("c", 4) == []


def test_lookup_reads_earlier_outputs_and_is_capped_by_the_match_length():
    d = SuffixDrafter(min_n=2, max_n=2, depth=8, spec_factor=1.5)
    d.begin("first", [5, 6, 7, 8, 9, 10, 11])
    d.end("first")
    d.begin("second", [1, 5, 6])  # "5 6": only in the first request's tokens
    assert d.lookup("second", 8) == [7, 8, 9]  # a 2-token match drafts round(1.5 x 2) = 3 at most


def test_majority_path_breaks_ties_by_the_lowest_id():
    from verispec.drafters.trie import majority_path

    assert majority_path([[4, 1], [3, 2]], 4, 0.5) == [3, 2]
    assert majority_path([], 4, 0.5) == []
    assert majority_path([[1, 2, 3]], 2, 1.0) == [1, 2]
