"""The trained drafters this machine made, for ``verispec models list``.

``verispec train medusa`` / ``train eagle`` / ``train distill`` record each file (or folder) they write in
``$VERISPEC_HOME/trained.json`` (a list of absolute paths, written atomically); the listing reads
each file's own manifest (safetensors metadata only: no weights are loaded), so what it shows is
what the file says, and files since moved or deleted show as missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verispec.formats.files import atomic_path, locked
from verispec.formats.registry import verispec_home

INDEX = "trained.json"
#: Entries kept at most (the oldest go first).
MAX_ENTRIES = 256
KINDS = {"verispec-medusa/1": "medusa heads", "verispec-eagle/1": "eagle head"}


@dataclass(frozen=True)
class TrainedDrafter:
    """One recorded file and what its manifest says (``kind`` "missing" when it is gone or unreadable)."""

    path: str
    kind: str
    base: str  # the model it belongs beside: the target of heads, the base draft of a distilled draft
    size: int
    summary: str  # held-out figures and training time, one line

    def to_dict(self) -> dict[str, Any]:
        """The shape of ``models list --json``'s entries (``name`` is the file's path)."""
        state = "missing" if self.kind == "missing" else "trained"
        return {"name": self.path, "role": self.kind, "base": self.base, "state": state,
                "disk_bytes": self.size, "summary": self.summary}  # fmt: skip


def _index(home: Path | None) -> Path:
    return (home or verispec_home()) / INDEX


def _paths(home: Path | None) -> list[str]:
    try:
        data = json.loads(_index(home).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return [p for p in data if isinstance(p, str)] if isinstance(data, list) else []


def record(path: str | os.PathLike[str], home: Path | None = None) -> None:
    """Add ``path`` to the index (once; most recent last)."""
    where = _index(home)
    where.parent.mkdir(parents=True, exist_ok=True)
    full = str(Path(path).resolve())
    with locked(where.with_name(INDEX + ".lock")):
        paths = [p for p in _paths(home) if p != full] + [full]
        with atomic_path(where) as tmp:
            tmp.write_text(json.dumps(paths[-MAX_ENTRIES:], indent=1), encoding="utf-8")


def describe(path: str) -> TrainedDrafter:
    """What the file (or distilled folder) at ``path`` says of itself."""
    from safetensors import safe_open

    if os.path.isdir(path):
        return _distilled(path)
    try:
        size = os.path.getsize(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        manifest = json.loads(meta["manifest"])
        kind = KINDS[meta["format"]]
    except Exception:  # anything unreadable is listed as missing, never fatal
        return TrainedDrafter(path, "missing", "-", 0, "the file is gone or unreadable")
    info = manifest.get("info", {})
    held = info.get("heldout", {})
    parts = []
    if "chain_al" in held:
        parts.append(f"held-out chain AL {float(held['chain_al']):.2f}")
    if "seconds" in info:
        parts.append(f"{float(info['seconds']) / 60:.1f} min, {info.get('epochs', '?')} epochs")
    return TrainedDrafter(path, kind, str(manifest.get("target", "?")), size, ", ".join(parts) or "-")


def _distilled(path: str) -> TrainedDrafter:
    from verispec.train.distill import read_manifest

    manifest = read_manifest(Path(path))
    if manifest is None:
        return TrainedDrafter(path, "missing", "-", 0, "the folder is gone or not a distilled draft")
    size = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    before, after = manifest.get("heldout_before", {}), manifest.get("heldout", {})
    summary = f"toward {manifest.get('target')} ({manifest.get('objective')})"
    if "acceptance" in after:
        summary += f", held-out acceptance {before.get('acceptance', float('nan')):.3f} -> {after['acceptance']:.3f}"
    if "seconds" in manifest:
        summary += f", {float(manifest['seconds']) / 60:.1f} min"
    return TrainedDrafter(path, "distilled draft", str(manifest.get("base", "?")), size, summary)


def trained_drafters(home: Path | None = None) -> list[TrainedDrafter]:
    """Every recorded file, described."""
    return [describe(p) for p in _paths(home)]
