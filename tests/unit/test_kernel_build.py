"""Building the kernels: a build killed midway (its lock file left in the folder) does not hang
the next process that loads them; two installs of one version do not share a build folder."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels import require_kernels


def test_a_build_killed_midway_does_not_hang_the_next_load() -> None:
    from verispec.kernels import build, dispatch

    require_kernels()  # built (or skipped, saying why) before the test
    chosen = dispatch.selected()
    folder = build.cache_dir(None) / f"{chosen.name}-{build.build_key(chosen)}"
    assert any(folder.glob("*.so"))
    (folder / build.TORCH_BUILD_LOCK).touch()  # what torch's builder leaves when killed while compiling
    code = "from verispec.kernels import build; build.load(); print('loaded')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr
    assert not (folder / build.TORCH_BUILD_LOCK).exists()


def test_two_installs_of_one_version_build_in_folders_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verispec.kernels import build, dispatch

    chosen = dispatch.by_name("portable")
    here = build.build_key(chosen)
    assert build.build_key(chosen) == here  # (a key, not a draw)
    copy = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, copy)  # the same sources, installed elsewhere
    monkeypatch.setattr(build, "SOURCE_DIR", copy)
    assert build.build_key(chosen) != here


def test_a_fresh_build_removes_the_builds_nothing_loads_any_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import time

    from verispec.kernels import build, dispatch

    chosen = dispatch.by_name("portable")
    current = build.build_key(chosen)
    runtime = build._runtime()
    here = str(build.SOURCE_DIR.resolve())
    gone = str(tmp_path / "deleted-checkout" / "csrc")
    elsewhere = tmp_path / "other-install" / "csrc"
    elsewhere.mkdir(parents=True)

    def folder(name: str, marker: str | None, age_s: float = 0.0) -> Path:
        path = tmp_path / "kernels" / name
        path.mkdir(parents=True)
        (path / "lib.so").write_bytes(b"")
        if marker is not None:
            (path / build.SOURCES_FILE).write_text(marker)
        stamp = time.time() - age_s
        os.utime(path, (stamp, stamp))
        return path

    ours = folder(f"portable-{current}", f"{here}\n{runtime}\n")
    earlier = folder("portable-0123456789abcdef", f"{here}\n{runtime}\n")  # this install, older sources
    other_torch = folder("portable-1111111111111111", f"{here}\n0.0.1|(3, 9)|x86_64\n")  # another venv's torch
    other_install = folder("avx2-2222222222222222", f"{elsewhere}\n{runtime}\n")
    deleted = folder("avx2-3333333333333333", f"{gone}\n{runtime}\n")
    unnamed_new = folder("avx512-4444444444444444", None)
    unnamed_old = folder("avx512-5555555555555555", None, age_s=build.UNNAMED_MAX_AGE_S + 60)
    retired_tier = folder("sse9-6666666666666666", f"{here}\n{runtime}\n")  # a tier this version lacks
    (tmp_path / "kernels" / ".lock").write_text("")

    removed = build.prune_stale(tmp_path / "kernels", keep=ours)
    assert sorted(removed) == sorted([earlier, deleted, unnamed_old, retired_tier])
    for kept in (ours, other_torch, other_install, unnamed_new):
        assert kept.is_dir()
    for path in removed:
        assert not path.exists()
    assert (tmp_path / "kernels" / ".lock").is_file()
