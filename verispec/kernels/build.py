"""Compile the C++ kernels on first use and cache them: :func:`load` returns the extension module.

The sources (``csrc/*.cpp``, ``csrc/common.h``) are built with ``torch.utils.cpp_extension.load``
(g++ with OpenMP and the AVX-512 / AMX instruction flags, driven by ninja) into
``$VERISPEC_HOME/kernels/<key>/`` (default ``~/.cache/verispec/kernels``), where ``key`` hashes
the sources, the flags and the torch and Python versions: a first build takes about a minute
(logged as it starts), later processes import the cached library in well under a second. A file
lock (``kernels/.lock``, released by the OS if a process dies) serialises concurrent builds.

The kernels need an x86-64 Linux CPU with AVX-512 (F, BW, VL, DQ, BF16, VNNI) and AMX (TILE,
BF16, INT8): Intel Xeon 4th generation ("Sapphire Rapids") or newer. :func:`cpu_supported` says
whether this one qualifies; :func:`load` raises :class:`~verispec.errors.ConfigError` naming what
is missing (CPU features, compiler, ninja) and what to do instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from verispec.errors import ConfigError

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("common.h", "q4k.cpp", "w8a8.cpp", "bf16.cpp", "attention.cpp", "layer_ops.cpp", "bindings.cpp")
COMPILE_FLAGS = (
    "-O3",
    "-ffp-contract=off",  # a * b + c stays two roundings unless a kernel asks for an FMA
    "-fopenmp",  # at::parallel_for is an OpenMP region compiled into the extension
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mf16c",
    "-mfma",
    "-mamx-tile",
    "-mamx-bf16",
    "-mamx-int8",
)
#: /proc/cpuinfo flags the kernels execute.
REQUIRED_CPU_FLAGS = (
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "f16c",
    "fma",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_FALLBACK = "use --dtype bf16 (or fp32), which runs on any CPU"


class _State:
    module: Any = None
    seconds: float | None = None


_STATE = _State()


def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux reports them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def missing_cpu_features() -> list[str]:
    """What this machine lacks to run the kernels ([] when it has everything)."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return [f"x86-64 Linux (this is {sys.platform} on {platform.machine()})"]
    flags = cpu_flags()
    return [f for f in REQUIRED_CPU_FLAGS if f not in flags]


def cpu_supported() -> bool:
    """True when this CPU has every instruction the kernels use (AVX-512 BF16 / VNNI and AMX)."""
    return not missing_cpu_features()


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will call (``$CXX``, else ``c++``), if found."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_dir(home: Path | None = None) -> Path:
    """``$VERISPEC_HOME/kernels`` (default ``~/.cache/verispec/kernels``; the same home as the
    model cache of :mod:`verispec.formats.registry`, read here so that kernels import no model code)."""
    if home is None:
        home = Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec").expanduser()
    return home / "kernels"


def build_key() -> str:
    """Hash of what the built library depends on: sources, flags, torch and Python versions."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    digest.update(" ".join(COMPILE_FLAGS).encode())
    digest.update(f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}".encode())
    return digest.hexdigest()[:16]


def check_buildable() -> None:
    """Raise :class:`ConfigError` (with the remedy) unless this machine can build and run the kernels."""
    missing = missing_cpu_features()
    if missing:
        raise ConfigError(
            "the int4/int8 kernels need a CPU with AVX-512 BF16 / VNNI and AMX (Intel Xeon 4th gen or newer); "
            f"this one lacks {', '.join(missing)}: {_FALLBACK}"
        )
    if compiler() is None:
        raise ConfigError(
            "the int4/int8 kernels are compiled on first use, but no C++ compiler was found (looked for "
            f"{os.environ.get('CXX', 'c++')!r}): install g++ >= 11 (e.g. `apt-get install g++`) or set $CXX, "
            f"or {_FALLBACK}"
        )
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        raise ConfigError(
            "the int4/int8 kernels are compiled on first use with ninja, which is not installed: "
            f"`pip install ninja`, or {_FALLBACK}"
        )


@contextmanager
def _locked(folder: Path) -> Any:
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load(home: Path | None = None) -> Any:
    """The compiled kernel module (built on first use, then cached; see the module docstring).

    Raises :class:`ConfigError` when the CPU, the compiler or ninja is missing, when the build
    fails, or when the operating system refuses this process the AMX state."""
    if _STATE.module is not None:
        return _STATE.module
    check_buildable()
    from torch.utils.cpp_extension import load as load_extension

    key = build_key()
    root = cache_dir(home)
    folder = root / key
    start = time.perf_counter()
    with _locked(root):
        fresh = not any(folder.glob("*.so"))
        if fresh:
            logger.warning(
                "compiling verispec's int4/int8 CPU kernels into %s (once per install: about a minute)", folder
            )
        folder.mkdir(parents=True, exist_ok=True)
        try:
            module = load_extension(
                name=f"verispec_kernels_{key}",
                sources=[str(SOURCE_DIR / name) for name in SOURCES if name.endswith(".cpp")],
                extra_cflags=list(COMPILE_FLAGS),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(SOURCE_DIR)],
                build_directory=str(folder),
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            logger.error("building the kernels in %s failed:\n%s", folder, exc)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise ConfigError(
                f"building the int4/int8 kernels in {folder} failed ({lines[-1][:300]}; the compiler output is "
                f"logged above): check that g++ >= 11 is installed, or {_FALLBACK}"
            ) from exc
    seconds = time.perf_counter() - start
    if fresh:
        logger.warning("compiled the kernels in %.0f s", seconds)
    if not module.amx_available():
        raise ConfigError(
            "this CPU has AMX but the operating system refused this process the AMX state (Linux >= 5.16 "
            f"grants it on request): {_FALLBACK}"
        )
    _STATE.module, _STATE.seconds = module, seconds
    return module


def load_seconds() -> float | None:
    """Wall time the :func:`load` that imported the module took (a build: about a minute)."""
    return _STATE.seconds
