"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_starts_with_the_two_setup_commands() -> None:
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)[:2]
    assert "pip install" in commands[0] and "verispec" in commands[0]
    assert "pip install" in commands[1] and "pytest" in commands[1]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0 -e '.[dev]'" in ci and "\npytest\n" in ci
