"""Building the kernels: a build killed midway (its lock file left in the folder) does not hang
the next process that loads them."""

from __future__ import annotations

import subprocess
import sys

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
