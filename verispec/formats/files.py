"""Writing files so that nothing half-written is ever seen: temporary file, flush, rename.

Also the progress callback type that long model work (joining, converting, loading) reports to.
This module imports nothing heavy, so the CLI's cheap commands stay quick.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from verispec.errors import ModelLoadError

#: ``progress(stage, done, total)``: called as long work advances; ``stage`` names the work
#: ("join", "convert", "tokenizer", "load"), ``done`` / ``total`` count bytes or steps.
ProgressFn = Callable[[str, int, int], None]

#: Suffix of the temporary files :func:`atomic_path` writes (hidden: they start with ".").
TEMP_SUFFIX = ".tmp"


def _fsync_dir(folder: Path) -> None:
    if os.name != "posix":  # pragma: no cover - directories cannot be opened for fsync elsewhere
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final`` to write; flushed to disk and renamed onto ``final`` when
    the block ends normally, deleted when it raises (or is interrupted)."""
    while True:  # like tempfile.mkstemp, but with the umask's permissions (mkstemp makes 0600 files)
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def locked(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if needed) for the block; the operating
    system releases it if the process dies. Waits for other holders."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    if os.name != "posix":  # pragma: no cover - no flock; concurrent writers are the user's risk
        yield
        return
    import fcntl

    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """``data`` as indented UTF-8 JSON at ``path``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; :class:`ModelLoadError` if it is missing, unreadable or not an
    object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value
