"""Fake model-part packages for registry tests: a tiny GGUF split into chunks, each chunk in its own
importable module with ``get_part_path()`` (as the real PyPI chunk packages have), and a registry
entry describing them, installed into ``verispec.formats.registry.MODELS`` for one test."""

from __future__ import annotations

import hashlib
import importlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.formats import registry
from verispec.formats.registry import ModelEntry, PartPackage

MODULE_SOURCE = """\
import os
def get_part_path():
    base_dir = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(base_dir, "data", "part.bin")
"""


@dataclass
class FakeModel:
    entry: ModelEntry
    gguf: Path  # the original file the parts were cut from
    part_files: list[Path]
    home: Path  # $VERISPEC_HOME for the test

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def folder(self) -> Path:
        return self.home / "models" / self.entry.name


def install_fake_model(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    name: str = "tiny-draft",
    role: str = "draft",
    n_parts: int = 3,
    part_hashes: bool = True,
    spec: TinySpec | None = None,
    home: Path | None = None,
) -> FakeModel:
    """Write a tiny GGUF, cut it into ``n_parts`` fake packages on ``sys.path``, register it as
    ``name`` and point ``$VERISPEC_HOME`` at ``home`` (default ``tmp_path / "home"``); all undone
    after the test."""
    uid = uuid.uuid4().hex[:10]
    tmp_path.mkdir(parents=True, exist_ok=True)
    gguf = tmp_path / f"{name}.gguf"
    write_tiny(gguf, spec or TinySpec(types={"*": "Q8_0"}))
    data = gguf.read_bytes()
    cuts = [len(data) * i // n_parts for i in range(n_parts + 1)]
    site = tmp_path / "site"
    parts, files = [], []
    for i in range(1, n_parts + 1):
        chunk = data[cuts[i - 1] : cuts[i]]
        module = f"vs_fake_{uid}_part{i}"
        folder = site / module
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text(MODULE_SOURCE)
        (folder / "data" / "part.bin").write_bytes(chunk)
        files.append(folder / "data" / "part.bin")
        sha = hashlib.sha256(chunk).hexdigest() if part_hashes else None
        parts.append(PartPackage(f"vs-fake-{uid}-part{i}", "1.0", module, len(chunk), sha))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    entry = ModelEntry(
        name=name,
        display_name=f"Tiny {name}",
        role=role,
        parts=tuple(parts),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        install_hint="pip install -e '.[models]'",
    )
    monkeypatch.setitem(registry.MODELS, name, entry)
    home = home or tmp_path / "home"
    monkeypatch.setenv(registry.HOME_ENV, str(home))
    return FakeModel(entry, gguf, files, home)
