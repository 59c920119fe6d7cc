"""The index of trained drafters behind ``verispec models list``: recorded once each, newest last,
bounded; a damaged index or a file gone or unreadable never breaks the listing."""

from __future__ import annotations

from pathlib import Path

from verispec.train import index


def test_record_once_newest_last_and_bounded(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(index, "MAX_ENTRIES", 3)
    for name in ("a", "b", "a", "c", "d"):
        index.record(tmp_path / name, home=tmp_path)
    assert [Path(p).name for p in index._paths(tmp_path)] == ["a", "c", "d"]


def test_damaged_index_and_missing_or_foreign_files_are_listed_not_fatal(tmp_path: Path) -> None:
    (tmp_path / index.INDEX).write_text("{not json")
    assert index.trained_drafters(tmp_path) == []
    (tmp_path / index.INDEX).write_text('["/no/such/file", 7, {"x": 1}]')
    listed = index.trained_drafters(tmp_path)
    assert [t.kind for t in listed] == ["missing"]  # (entries that are not paths are ignored)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    folder = tmp_path / "folder"
    folder.mkdir()
    index.record(junk, home=tmp_path)
    index.record(folder, home=tmp_path)
    kinds = {Path(t.path).name: t.kind for t in index.trained_drafters(tmp_path)}
    assert kinds["junk.safetensors"] == "missing" and kinds["folder"] == "missing"
    assert all(t.to_dict()["state"] == "missing" for t in index.trained_drafters(tmp_path))
