"""Chat templates rendered where a hostile one cannot hurt: a child process with time, memory and
output limits.

A chat template is Jinja code that comes with a model file, written by whoever made the file.
Jinja's sandbox (``ImmutableSandboxedEnvironment``, as transformers uses) keeps it away from
Python's objects, but not from looping 10^10 times or building a string of 10 GB, and Python
cannot stop a thread that is doing either. So templates render in a separate ``python -I``
process that holds nothing but Jinja: an address-space limit (``RLIMIT_AS``) ends a memory bomb
with a ``MemoryError``, output beyond ``max_chars`` ends the render, and a render that takes
longer than ``timeout`` seconds gets the process killed (the next render starts a fresh one).
Between renders the process stays up, so a render costs one pipe round trip (well under a
millisecond for a real template); the first one costs the process start (~0.1 s).

Rendering follows transformers (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a
``tojson`` that keeps non-ASCII, ``raise_exception``, ``strftime_now``). Errors are
:class:`ChatTemplateError`: the template raised or is malformed, or it hit a limit.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from verispec.errors import InputError

#: Defaults of every render: seconds, bytes of address space of the child, characters of output.
TIMEOUT_SECONDS = 2.0
#: Seconds a new child may take to start (import Jinja) before the render's own clock starts.
STARTUP_SECONDS = 60.0
MEMORY_BYTES = 1 << 30
MAX_CHARS = 4 << 20

# The child: reads one JSON request per line, answers one JSON line; compiled templates are kept.
_CHILD = r"""
import json, resource, sys
from datetime import datetime
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

def raise_exception(message):
    raise TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
compiled = {}
sys.stdout.write("ready\n")
sys.stdout.flush()
for line in sys.stdin:
    request = json.loads(line)
    try:
        source = request["template"]
        if source not in compiled:
            if len(compiled) > 16:
                compiled.clear()
            compiled[source] = env.from_string(source)
        pieces, size, limit = [], 0, request["max_chars"]
        for piece in compiled[source].generate(**request["variables"]):
            size += len(piece)
            if size > limit:
                raise OverflowError(f"the chat template's output exceeds {limit} characters")
            pieces.append(piece)
        answer = {"text": "".join(pieces)}
    except MemoryError:
        answer = {"error": "the chat template ran out of memory (its address space is limited)"}
    except RecursionError:
        answer = {"error": "the chat template recursed too deeply"}
    except OverflowError as exc:
        answer = {"error": str(exc)}
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
"""


class ChatTemplateError(InputError):
    """A chat template that failed to render: it raised, it is malformed, or it went past a limit
    (time, memory, output size). Another template, or other messages, may render."""


class TemplateRenderer:
    """Renders chat templates in a child process (see the module docstring); thread-safe (renders
    take turns)."""

    def __init__(
        self, *, timeout: float = TIMEOUT_SECONDS, memory_bytes: int = MEMORY_BYTES, max_chars: int = MAX_CHARS
    ) -> None:
        self.timeout = timeout
        self.memory_bytes = memory_bytes
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def render(self, template: str, variables: Mapping[str, Any]) -> str:
        """``template`` rendered with ``variables`` (plain JSON data), or :class:`ChatTemplateError`."""
        request = json.dumps({"template": template, "variables": dict(variables), "max_chars": self.max_chars})
        with self._lock:
            answer = self._ask(request.encode() + b"\n")
        if "error" in answer:
            raise ChatTemplateError(f"the chat template failed: {answer['error']}")
        text = str(answer["text"])
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ChatTemplateError("the chat template produced text that is not valid Unicode") from None
        return text

    def close(self) -> None:
        """Stop the child process (a later render starts a new one)."""
        with self._lock:
            self._kill()

    def _send(self, line: bytes) -> subprocess.Popen[bytes]:
        proc = self._child()
        assert proc.stdin is not None
        proc.stdin.write(line)
        proc.stdin.flush()
        return proc

    def _ask(self, line: bytes) -> dict[str, Any]:
        try:
            proc = self._send(line)
        except OSError:  # the child died since the last render (killed from outside): a new one
            self._kill()
            proc = self._send(line)
        assert proc.stdout is not None
        out = self._read_line(proc, self.timeout)
        if out is None:
            self._kill()
            raise ChatTemplateError(f"the chat template took longer than {self.timeout:g} s to render and was stopped")
        value = json.loads(out)
        assert isinstance(value, dict)
        return value

    def _read_line(self, proc: subprocess.Popen[bytes], timeout: float) -> bytes | None:
        """One line from the child, or None when ``timeout`` seconds pass first; raises
        :class:`ChatTemplateError` when the child dies (a limit of its process was hit)."""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        out = bytearray()
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while not out.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._kill()
                    raise ChatTemplateError("the chat template's renderer stopped (a limit of its process was hit)")
                out += chunk
        return bytes(out)

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD, str(self.memory_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"},
            )  # fmt: skip
            if self._read_line(self._proc, STARTUP_SECONDS) != b"ready\n":  # the render's clock starts after
                self._kill()
                raise ChatTemplateError("the chat template renderer did not start (is jinja2 installed?)")
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None

    def __del__(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


#: The renderer every :class:`~verispec.formats.tokenizer.Tokenizer` uses.
RENDERER = TemplateRenderer()
