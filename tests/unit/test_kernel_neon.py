"""The neon tier computes the same bits as the portable one, on AArch64, without ARM hardware.

``kernel_check.cpp`` runs every kernel of ``csrc/vec`` (int8, Q4_K, Q6_K and bf16 projections at
1 to 21 rows, the activation quantisation with NaN / infinities / ties, the packers, the Q4_K and
Q6_K dequantisers, RMSNorm, RoPE, SwiGLU, attention in bf16 and fp32, the greedy and sampled
picks) on fixed inputs and prints a hash of each output. It is cross-compiled for AArch64
twice, with the neon tier's flags and with none (plain C++), run under qemu-user, and compiled for
this machine as plain C++; the three must print the same lines, and the neon build must have taken
vec.h's NEON branch. A build with multiply-adds fused where the kernels keep two roundings
(``-ffp-contract=fast``) must differ: the comparison sees a one-rounding change.

Needs Debian's ``g++-aarch64-linux-gnu`` and ``qemu-user`` (CI installs them); skipped, saying so,
without them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from verispec.kernels import dispatch
from verispec.kernels.build import COMMON_FLAGS, SOURCE_DIR

CHECK = Path(__file__).with_name("kernel_check.cpp")
#: The neon tier's sources but the torch bindings.
SOURCES = [SOURCE_DIR / name for name in dispatch.by_name("neon").sources if name != "bindings.cpp"]
CROSS, QEMU, NATIVE = "aarch64-linux-gnu-g++", "qemu-aarch64", "g++"
#: The kernels' flags without OpenMP (the entry points themselves run single-threaded).
FLAGS = [f for f in COMMON_FLAGS if f != "-fopenmp"] + ["-std=c++17", f"-I{SOURCE_DIR}", f"-I{SOURCE_DIR / 'vec'}"]


def _needs(*tools: str) -> None:
    lacking = [t for t in tools if shutil.which(t) is None]
    if lacking:
        pytest.skip(
            f"{', '.join(lacking)} not found: install Debian's g++-aarch64-linux-gnu and qemu-user to "
            "test the neon tier under emulation"
        )


def _build(tmp: Path, name: str, compiler: str, flags: list[str]) -> Path:
    out = tmp / name
    cmd = [compiler, *FLAGS, *flags, *map(str, SOURCES), str(CHECK), "-o", str(out)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def _run(cmd: list[str]) -> list[str]:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    _needs(CROSS, QEMU, NATIVE)
    tmp = tmp_path_factory.mktemp("neon")
    emulate = [QEMU, "-cpu", "max"]  # a CPU with every extension qemu knows, dot product included
    builds = {
        "neon": (CROSS, ["-static", *dispatch.NEON_FLAGS], emulate),
        "arm portable": (CROSS, ["-static"], emulate),
        "native portable": (NATIVE, [], []),
        "neon fused": (CROSS, ["-static", *dispatch.NEON_FLAGS, "-ffp-contract=fast"], emulate),
    }
    return {
        name: _run([*runner, str(_build(tmp, name.replace(" ", "_"), compiler, flags))])
        for name, (compiler, flags, runner) in builds.items()
    }


def test_the_neon_tier_equals_plain_cpp_bit_for_bit(outputs: dict[str, list[str]]) -> None:
    neon, arm, native = outputs["neon"], outputs["arm portable"], outputs["native portable"]
    assert neon[0] == "branch neon" and arm[0] == "branch portable" and native[0] == "branch portable"
    assert len(neon) > 100 and [line.rsplit(" ", 1)[0] for line in neon] == [line.rsplit(" ", 1)[0] for line in arm]
    assert neon[1:] == arm[1:]  # the same bits on AArch64 with and without NEON
    assert arm[1:] == native[1:]  # and on this machine


def test_a_fused_multiply_add_is_told_apart(outputs: dict[str, list[str]]) -> None:
    """Negative control: fusing the int8 epilogue's multiply and add (one rounding instead of two)
    changes hashes, so equal hashes above mean equal roundings, not an insensitive check."""
    differ = {line.split()[0] for line in set(outputs["neon fused"]) - set(outputs["neon"])}
    assert "int8" in differ
