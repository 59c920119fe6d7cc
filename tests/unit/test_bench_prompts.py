from __future__ import annotations

import io

import pytest

from verispec.bench.prompts import SET_NAMES, iter_json_array, prompt_set, summarize_prompts
from verispec.bench.runner import alpha_from_positions
from verispec.errors import ConfigError


def test_iter_json_array_stops_at_a_truncated_record() -> None:
    text = '[\n {"a": 1},\n {"b": [1, 2, {"c": "x"}]}, {"d": "cut off he'
    assert list(iter_json_array(io.StringIO(text), chunk=7)) == [{"a": 1}, {"b": [1, 2, {"c": "x"}]}]
    assert list(iter_json_array(io.StringIO('[{"a": 1}, {"b": 2}]'), chunk=3)) == [{"a": 1}, {"b": 2}]
    assert list(iter_json_array(io.StringIO("[]"))) == []
    with pytest.raises(ConfigError):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_prompt_sets() -> None:
    assert set(SET_NAMES) == {"humaneval", "chat", "summarize"}
    assert len(prompt_set("chat")) >= 20
    # summarisation-style prompts contain the text their answer repeats
    assert all(len(p) > 150 for p in summarize_prompts())
    with pytest.raises(ConfigError, match="unknown prompt set"):
        prompt_set("nope")


def test_alpha_from_positions() -> None:
    assert alpha_from_positions([]) is None
    assert alpha_from_positions([0.5, 0.25, 0.125]) == pytest.approx(0.5)
    assert alpha_from_positions([0.8, 0.4]) == pytest.approx((0.8 + 0.5) / 2)
