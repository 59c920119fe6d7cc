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
