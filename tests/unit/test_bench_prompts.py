from __future__ import annotations

import io

import pytest

from verispec.bench.prompts import SET_NAMES, edit_prompts, iter_json_array, prompt_set, summarize_prompts
from verispec.errors import ConfigError


def test_iter_json_array_stops_at_a_truncated_record() -> None:
    text = '[\n {"a": 1},\n {"b": [1, 2, {"c": "x"}]}, {"d": "cut off he'
    assert list(iter_json_array(io.StringIO(text), chunk=7)) == [{"a": 1}, {"b": [1, 2, {"c": "x"}]}]
    assert list(iter_json_array(io.StringIO('[{"a": 1}, {"b": 2}]'), chunk=3)) == [{"a": 1}, {"b": 2}]
    assert list(iter_json_array(io.StringIO("[]"))) == []
    with pytest.raises(ConfigError):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_prompt_sets() -> None:
    assert set(SET_NAMES) == {"humaneval", "chat", "summarize", "edit"}
    assert len(prompt_set("chat")) >= 20
    # summarisation-style prompts contain the text their answer repeats
    assert all(len(p) > 150 for p in summarize_prompts())
    with pytest.raises(ConfigError, match="unknown prompt set"):
        prompt_set("nope")


def test_edit_prompts_are_verispec_functions(tmp_path) -> None:  # type: ignore[no-untyped-def]
    edits = prompt_set("edit")
    assert len(edits) >= 20 and len(edits) % 2 == 0 and edits == prompt_set("edit")  # deterministic
    rewrite, complete = edits[0], edits[1]
    assert "```python\ndef " in rewrite and rewrite.endswith("```")
    assert "beginning of a function" in complete and "```python\ndef " in complete
    (tmp_path / "m.py").write_text("def f(x):\n" + "    x += 1\n" * 9 + "    return x\n\ndef g():\n    pass\n")
    mine = edit_prompts(tmp_path, every=1)
    assert len(mine) == 2 and "verispec/m.py" in mine[0] and "def g" not in mine[0]  # g is too short
