"""The retrieval drafter (REST): a suffix array over a datastore's tokens, the longest matching
suffix found by binary search, the trie of what followed it proposed as fixed children; the
datastore read from files (text only, bounded) and cached."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.config import SamplingParams
from verispec.drafters.base import BatchView
from verispec.drafters.retrieval import SEPARATOR, Datastore, RetrievalDrafter, text_files
from verispec.errors import ConfigError, InputError

PROPERTY = settings(deadline=None, derandomize=True, max_examples=60)


def view(ids: list[str], room: int = 16) -> BatchView:
    return BatchView(ids, [SamplingParams()] * len(ids), [None] * len(ids), None, [room] * len(ids))


@PROPERTY
@given(
    docs=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=4),
    pattern=st.lists(st.integers(0, 4), min_size=1, max_size=4),
)
def test_occurrences_are_every_match_and_no_other(docs: list[list[int]], pattern: list[int]) -> None:
    store = Datastore.build(docs)
    lo, hi = store.occurrences(pattern)
    found = sorted(int(store.suffixes[i]) for i in range(lo, hi))
    tokens = store.tokens.tolist()
    expected = [i for i in range(len(tokens)) if tokens[i : i + len(pattern)] == pattern]
    assert found == expected
    # the suffix array is a sorted permutation of the positions
    assert sorted(store.suffixes.tolist()) == list(range(len(tokens)))


def test_continuations_stop_at_the_end_of_their_document() -> None:
    store = Datastore.build([[1, 2, 3, 4], [1, 2, 9]])
    assert store.tokens.tolist() == [1, 2, 3, 4, SEPARATOR, 1, 2, 9, SEPARATOR]
    lo, hi = store.occurrences([1, 2])
    assert hi - lo == 2
    assert sorted(store.continuations(lo, hi, 2, depth=5, limit=8)) == [[3, 4], [9]]


def test_many_occurrences_are_sampled_evenly_keeping_their_shares() -> None:
    docs = [[5, 6, 1]] * 30 + [[5, 6, 2]] * 10
    store = Datastore.build(docs)
    lo, hi = store.occurrences([5, 6])
    picked = store.continuations(lo, hi, 2, depth=1, limit=8)
    assert len(picked) == 8 and picked.count([1]) == 6 and picked.count([2]) == 2


def test_the_drafter_proposes_what_followed_the_longest_suffix() -> None:
    store = Datastore.build([[10, 11, 12, 13, 14, 15], [11, 12, 20, 21], [3, 11, 12, 20, 22]])
    d = RetrievalDrafter(store, min_n=1, max_n=4, depth=3, min_share=0.1)
    d.begin("a", [7, 10, 11, 12])  # "10 11 12" occurs once: its continuation, a chain
    draft = d.propose(view(["a"]), [4])
    assert draft.is_tree and draft.children == "fixed" and draft.probs is None
    n = int(draft.num_tokens[0])
    assert draft.token_ids[0, :n].tolist() == [13, 14, 15]
    assert draft.parents[0, :n].tolist() == [-1, 0, 1]
    d.begin("b", [9, 9, 11, 12])  # only "11 12" matches: three continuations, 20 the likeliest
    draft = d.propose(view(["b"]), [4])
    n = int(draft.num_tokens[0])
    toks, pars = draft.token_ids[0, :n].tolist(), draft.parents[0, :n].tolist()
    assert toks[0] == 20 and pars[0] == -1 and 13 in toks
    assert all(p < i for i, p in enumerate(pars))
    d.begin("c", [99])  # nothing matches: no draft
    assert int(d.propose(view(["c"]), [4]).num_tokens[0]) == 0


def test_budgets_and_rows_that_draft_nothing() -> None:
    store = Datastore.build([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    d = RetrievalDrafter(store, min_n=1, max_n=2, depth=8, max_nodes=5)
    d.begin("a", [1, 2])
    d.begin("b", [1, 2])
    draft = d.propose(view(["a", "b"], room=3), [4, 0])
    assert draft.num_tokens.tolist() == [3, 0]  # the row's room, and a row the scheduler skipped


def test_lifecycle_errors() -> None:
    d = RetrievalDrafter(Datastore.build([[1, 2]]))
    d.begin("a", [1])
    with pytest.raises(InputError):
        d.begin("a", [1])
    with pytest.raises(InputError):
        d.observe("b", [1])
    d.end("a")
    d.end("a")  # ending twice is harmless
    for bad in (dict(min_n=0), dict(min_n=3, max_n=2), dict(depth=0), dict(min_share=0.0), dict(max_matches=0)):
        with pytest.raises(ConfigError):
            RetrievalDrafter(Datastore.build([[1]]), **bad)


def _tree(root: Path) -> None:
    (root / "pkg").mkdir()
    (root / "pkg" / "a.py").write_text("def f(x):\n    return x + 1\n")
    (root / "b.txt").write_text("hello world\n")
    (root / ".hidden").write_text("secret\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (root / "big.txt").write_text("x" * 5000)


def test_text_files_read_text_only(tmp_path: Path) -> None:
    _tree(tmp_path)
    os.symlink("/etc/hostname", tmp_path / "link.txt")
    files = text_files(tmp_path, max_file_bytes=4096)
    assert [name for name, _ in files.texts] == ["b.txt", "pkg/a.py"]
    assert files.skipped == 4  # binary, not UTF-8, too large, a link (hidden names are never looked at)
    assert text_files(tmp_path / "b.txt").texts == [("b.txt", "hello world\n")]
    assert text_files(tmp_path, max_file_bytes=4096).digest == files.digest
    (tmp_path / "b.txt").write_text("hello there\n")
    assert text_files(tmp_path, max_file_bytes=4096).digest != files.digest


@pytest.mark.parametrize("case", ["missing", "empty", "too much"])
def test_unusable_datastores_are_config_errors(tmp_path: Path, case: str) -> None:
    if case == "missing":
        path, kw = tmp_path / "nope", {}
    elif case == "empty":
        (tmp_path / "blob.bin").write_bytes(b"\x00" * 10)
        path, kw = tmp_path, {}
    else:
        for i in range(3):
            (tmp_path / f"{i}.txt").write_text("y" * 1000)
        path, kw = tmp_path, {"max_total_bytes": 2500}
    with pytest.raises(ConfigError, match="--datastore"):
        text_files(path, **kw)


def test_a_datastore_is_built_once_and_cached(tmp_path: Path) -> None:
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    (src / "a.txt").write_text("abcabc")
    calls: list[int] = []

    def encode(texts):  # type: ignore[no-untyped-def]
        calls.append(len(texts))
        return [[ord(c) for c in t] for t in texts]

    files = text_files(src)
    first = Datastore.from_files(files, encode, cache, "tok-1")
    again = Datastore.from_files(files, encode, cache, "tok-1")
    assert calls == [1] and np.array_equal(first.tokens, again.tokens)
    assert np.array_equal(first.suffixes, again.suffixes)
    Datastore.from_files(files, encode, cache, "tok-2")  # another tokenizer: another datastore
    assert calls == [1, 1]
    stored = sorted(cache.iterdir())
    assert len(stored) == 2 and all(p.suffix == ".npz" for p in stored)  # nothing half-written left
    for p in stored:
        p.write_bytes(b"damaged")
    rebuilt = Datastore.from_files(files, encode, cache, "tok-1")  # a damaged file is built again, not a crash
    assert calls == [1, 1, 1] and np.array_equal(rebuilt.tokens, first.tokens)


def test_the_requests_own_text_joins_the_datastore() -> None:
    store = Datastore.build([[50, 51, 52, 53]])
    d = RetrievalDrafter(store, min_n=2, max_n=4, depth=3, min_share=0.1)
    d.begin("a", [7, 8, 9, 1, 2, 7, 8])  # "7 8" occurred in the prompt, followed by 9 1 2
    draft = d.propose(view(["a"]), [4])
    n = int(draft.num_tokens[0])
    assert draft.token_ids[0, :n].tolist() == [9, 1, 2]
    d.begin("b", [1, 50, 51, 9, 50, 51])  # both: the prompt's continuation and the datastore's
    draft = d.propose(view(["b"]), [4])
    n = int(draft.num_tokens[0])
    roots = [t for t, p in zip(draft.token_ids[0, :n].tolist(), draft.parents[0, :n].tolist(), strict=True) if p < 0]
    assert sorted(roots) == [9, 52]
