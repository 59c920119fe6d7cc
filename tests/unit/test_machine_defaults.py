"""The configuration ``verispec generate`` picks when no precision is given: the fastest one the
machine runs exactly, said in one line; and a user's own choice is left alone."""

from __future__ import annotations

import argparse

import pytest

from verispec import pipeline
from verispec.cli.options import resolve_precisions
from verispec.formats import loader


def args(**kw: object) -> argparse.Namespace:
    base = {"target": "t", "draft": "d", "drafter": "model", "device": "cpu", "dtype": None, "draft_dtype": None,
            "draft_vocab": None}  # fmt: skip
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(
    ("kernels", "q4k", "vocab", "device", "expect"),
    [
        (True, True, 151936, "cpu", ("int4", "int4-all", 32768)),
        (True, False, 151936, "cpu", ("bf16", "int8", 32768)),  # no Q4_K weights: bf16 target, int8 draft
        (True, True, 32000, "cpu", ("int4", "int4-all", None)),  # a small vocabulary: no head to cut
        (False, True, 151936, "cpu", ("bf16", "bf16", None)),  # torch's kernels: no int8 / int4
        (True, True, 151936, "cuda", ("bf16", "bf16", None)),
    ],
)
def test_the_machine_picks(monkeypatch: pytest.MonkeyPatch, kernels: bool, q4k: bool, vocab: int, device: str,
                           expect: tuple[object, ...]) -> None:  # fmt: skip
    monkeypatch.setattr(loader, "bf16_kernel_usable", lambda: kernels)
    monkeypatch.setattr(loader, "has_q4k_weights", lambda spec: q4k)
    monkeypatch.setattr(pipeline, "peek_config", lambda spec: type("C", (), {"vocab_size": vocab})())
    picked = pipeline.machine_defaults("t", "d", device)
    assert (picked.dtype, picked.draft_dtype, picked.draft_head) == expect
    assert picked.why and "\n" not in picked.why and picked.flags().endswith("--k auto")
    ns = args(device=device)
    line = resolve_precisions(ns)
    assert line is not None and line.startswith(f"picked {picked.flags()} for this machine: ") and "\n" not in line
    assert (ns.dtype, ns.draft_dtype, ns.draft_vocab) == expect


def test_a_users_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "machine_defaults", lambda *a: pytest.fail("nothing to pick"))
    ns = args(dtype="fp32")
    assert resolve_precisions(ns) is None and ns.dtype == "fp32" and ns.draft_dtype is None
    monkeypatch.undo()
    monkeypatch.setattr(loader, "bf16_kernel_usable", lambda: True)
    monkeypatch.setattr(loader, "has_q4k_weights", lambda spec: True)
    monkeypatch.setattr(pipeline, "peek_config", lambda spec: None)
    ns = args(draft_dtype="bf16", draft_vocab=1000)  # only the precision of the target is left to pick
    line = resolve_precisions(ns)
    assert (ns.dtype, ns.draft_dtype, ns.draft_vocab) == ("int4", "bf16", 1000)
    assert line is not None and "--draft-dtype bf16 " in line and "bf16 draft (as given)" in line  # says what runs
    ns = args()
    resolve_precisions(ns)
    assert (ns.dtype, ns.draft_dtype) == ("int4", "int4-all")
    ns = args(drafter="ngram")  # no draft model: no draft head
    resolve_precisions(ns)
    assert ns.draft_vocab is None


def test_q4k_weights_are_read_from_the_header(tmp_path: object) -> None:
    from verispec.formats.loader import DEFAULT_TARGET, has_q4k_weights
    from verispec.formats.registry import is_prepared

    assert not has_q4k_weights("no-such-model") and not has_q4k_weights(str(tmp_path))
    if is_prepared(DEFAULT_TARGET):  # the default target is Q4_K_M
        assert has_q4k_weights(DEFAULT_TARGET)
