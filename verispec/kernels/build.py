"""Compile the C++ kernels on first use and cache them: :func:`load` returns the extension module.

One module per instruction-set tier (:mod:`verispec.kernels.dispatch`: amx, avx512, avx2,
neon, portable), built from ``csrc/`` with that tier's flags by ``torch.utils.cpp_extension.load`` (g++
with OpenMP, driven by ninja) into ``$VERISPEC_HOME/kernels/<key>/`` (default
``~/.cache/verispec/kernels``), where ``key`` hashes the tier, its sources (and their folder), the
flags and the torch and Python versions: a first build takes 30 s to a minute on two cores (logged
as it starts), later processes import the cached library in well under a second. A file lock (``kernels/.lock``,
released by the OS if a process dies) serialises concurrent builds. Each folder names the sources it
was built from (``SOURCES_FILE``); a fresh build removes the folders that can no longer be loaded
(:func:`prune_stale`: its own install's earlier versions, installs that are gone), so the cache does
not grow by a build of every version ever run.

:func:`load` builds the tier :func:`~verispec.kernels.dispatch.selected` picks (the fastest this
CPU executes, or ``$VERISPEC_ISA``'s) unless told another; it raises
:class:`~verispec.errors.ConfigError` naming what is missing (CPU features, compiler, ninja) and
what to do instead.
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
from verispec.kernels.dispatch import HEADERS, ISA_ENV, Tier, by_name, missing, selected

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=off",  # a * b + c stays two roundings unless a kernel asks for an FMA
    "-fopenmp",  # at::parallel_for is an OpenMP region compiled into the extension
)
_FALLBACK = "use --dtype bf16 (or fp32), which runs on torch's kernels"
#: The file in a build folder that names the sources folder and the runtime it was built from.
SOURCES_FILE = "sources"
#: A folder from before ``SOURCES_FILE`` existed is removed once it is this old (its owner rebuilds it).
UNNAMED_MAX_AGE_S = 7 * 24 * 3600


class _State:
    def __init__(self) -> None:
        self.modules: dict[str, Any] = {}  # by tier name
        self.by_env: dict[str, Any] = {}  # by the value of $VERISPEC_ISA ("" unset) that picked it


_STATE = _State()


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will call (``$CXX``, else ``c++``), if found."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cache_dir(home: Path | None = None) -> Path:
    """``$VERISPEC_HOME/kernels`` (default ``~/.cache/verispec/kernels``; the same home as the
    model cache of :mod:`verispec.formats.registry`, read here so that kernels import no model code)."""
    if home is None:
        home = Path(os.environ.get("VERISPEC_HOME") or Path.home() / ".cache" / "verispec").expanduser()
    return home / "kernels"


def flags_of(tier: Tier) -> tuple[str, ...]:
    """The compiler flags of ``tier``: the common ones, its instruction sets, its name."""
    return (*COMMON_FLAGS, *tier.flags, f"-DVS_TIER={tier.name}")


def build_key(tier: Tier | None = None) -> str:
    """Hash of what ``tier``'s library depends on: sources, flags, torch and Python versions, and
    where the sources are (the build files name them by path: two installs of one version that
    shared a folder would rebuild it each time the other one ran, ~30 s each)."""
    tier = tier or selected()
    digest = hashlib.sha256(tier.name.encode())
    digest.update(str(SOURCE_DIR.resolve()).encode() + b"\0")
    for name in (*HEADERS, *tier.sources):
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    digest.update(" ".join(flags_of(tier)).encode())
    digest.update(_runtime().encode())
    return digest.hexdigest()[:16]


def _runtime() -> str:
    """The torch and Python versions and the machine a build is for (part of its key)."""
    return f"{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}"


def _marker() -> str:
    """What ``SOURCES_FILE`` holds: the sources folder, then the runtime it was built for."""
    return f"{SOURCE_DIR.resolve()}\n{_runtime()}\n"


def check_buildable(tier: Tier) -> None:
    """Raise :class:`ConfigError` (with the remedy) unless this machine can build and run ``tier``."""
    lacks = missing(tier)
    if lacks:
        raise ConfigError(
            f"the {tier.name} kernels need a CPU with {tier.needs()}; this one lacks "
            f"{', '.join(lacks)}: use another tier ($VERISPEC_ISA unset picks one), or {_FALLBACK}"
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


def prune_stale(root: Path, keep: Path) -> list[Path]:
    """Remove the build folders under ``root`` (other than ``keep``) that nothing can load any more,
    and return them: those built from this install's sources for this runtime whose key the sources
    and flags no longer give (an earlier version), those whose sources folder is gone (a deleted
    checkout or virtual environment), and unnamed ones older than ``UNNAMED_MAX_AGE_S``. The builds
    of another install, or of this one for another torch or Python, are theirs to prune. Call it
    holding the ``root`` lock (no build runs meanwhile)."""
    here, runtime = str(SOURCE_DIR.resolve()), _runtime()
    current: dict[str, str] = {}  # tier name -> its key for these sources and this runtime
    removed = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not folder.is_dir() or folder == keep or "-" not in folder.name:
            continue
        tier_name, _, key = folder.name.partition("-")
        marker = folder / SOURCES_FILE
        if marker.is_file():
            sources, _, built_for = marker.read_text().strip().partition("\n")
            if sources == here and built_for == runtime:
                try:
                    if tier_name not in current:
                        current[tier_name] = build_key(by_name(tier_name))
                    stale = key != current[tier_name]
                except (ConfigError, OSError):  # a tier this version no longer has
                    stale = True
            else:
                stale = not Path(sources).is_dir()
        else:
            stale = time.time() - folder.stat().st_mtime > UNNAMED_MAX_AGE_S
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


#: The lock file torch.utils.cpp_extension's builder holds in a build folder while it compiles.
TORCH_BUILD_LOCK = "lock"


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


def load(home: Path | None = None, tier: str | None = None) -> Any:
    """The compiled kernel module of ``tier`` (default :func:`~verispec.kernels.dispatch.selected`),
    built on first use, then cached (see the module docstring).

    Raises :class:`ConfigError` when the CPU, the compiler or ninja is missing, when the build
    fails, or when the operating system refuses this process the AMX state."""
    if tier is None:  # the hot path (every projection asks): the module already picked for this $VERISPEC_ISA
        module = _STATE.by_env.get(os.environ.get(ISA_ENV, ""))
        if module is not None:
            return module
    chosen = by_name(tier) if tier else selected()
    module = _STATE.modules.get(chosen.name)
    if module is not None:
        if tier is None:
            _STATE.by_env[os.environ.get(ISA_ENV, "")] = module
        return module
    check_buildable(chosen)
    from torch.utils.cpp_extension import load as load_extension

    key = build_key(chosen)
    root = cache_dir(home)
    folder = root / f"{chosen.name}-{key}"
    start = time.perf_counter()
    with _locked(root):
        fresh = not any(folder.glob("*.so"))
        if fresh:
            logger.warning(
                "compiling verispec's CPU kernels (%s tier) into %s (once per install: 30 s to a minute)",
                chosen.name,
                folder,
            )
        folder.mkdir(parents=True, exist_ok=True)
        # torch's builder takes a lock file of its own in the folder, which a build killed midway
        # leaves behind (every later build would wait for it forever); holding our lock, no one
        # else builds here, so such a file is stale
        (folder / TORCH_BUILD_LOCK).unlink(missing_ok=True)
        try:
            module = load_extension(
                name=f"verispec_kernels_{chosen.name}_{key}",
                sources=[str(SOURCE_DIR / name) for name in chosen.sources],
                extra_cflags=list(flags_of(chosen)),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(SOURCE_DIR)],
                build_directory=str(folder),
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            logger.error("building the kernels in %s failed:\n%s", folder, exc)
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise ConfigError(
                f"building the {chosen.name} kernels in {folder} failed ({lines[-1][:300]}; the compiler output "
                f"is logged above): check that g++ >= 11 is installed, or {_FALLBACK}"
            ) from exc
        if not (folder / SOURCES_FILE).is_file():
            partial = folder / f"{SOURCES_FILE}.{os.getpid()}"
            partial.write_text(_marker())
            os.replace(partial, folder / SOURCES_FILE)  # whole or absent
        if fresh:
            removed = prune_stale(root, keep=folder)
            if removed:
                logger.info("removed %d kernel builds nothing loads any more from %s", len(removed), root)
    seconds = time.perf_counter() - start
    if fresh:
        logger.warning("compiled the kernels in %.0f s", seconds)
    if chosen.name == "amx" and not module.amx_available():
        raise ConfigError(
            "this CPU has AMX but the operating system refused this process the AMX state (Linux >= 5.16 "
            "grants it on request): set VERISPEC_ISA=avx512"
        )
    _STATE.modules[chosen.name] = module
    if tier is None:
        _STATE.by_env[os.environ.get(ISA_ENV, "")] = module
    return module
