"""Which instruction-set tier of the CPU kernels runs here: picked from the CPU, or forced lower.

The kernels come in seven tiers, one compiled extension module each (:mod:`verispec.kernels.build`),
all with the same functions, packed layouts and results (see ``csrc/vec/linear.cpp``):

========== ======================================================== ==============================
tier       needs                                                    CPUs
========== ======================================================== ==============================
amx        AVX-512 F/BW/VL/DQ + BF16 + VNNI, AMX tiles (bf16, int8)  Intel Xeon 4th gen (Sapphire
                                                                    Rapids) and newer
avx512bf16 avx512's + AVX-512 BF16 (VDPBF16PS), on an AMD CPU       AMD Zen 4 / 5
avx512     AVX-512 F/BW/VL/DQ + VNNI, FMA, F16C                     Intel Ice Lake, Tiger Lake,
                                                                    Xeon 3rd gen (and Zen 4 / 5)
avx2vnni   AVX2, FMA, F16C + AVX-VNNI (256-bit VPDPBUSD)            Intel Alder Lake and later
                                                                    client CPUs (Core 12th gen+),
                                                                    AMD Zen 5 (where avx512 is
                                                                    not exposed)
avx2       AVX2, FMA, F16C                                          every x86-64 CPU since ~2013
                                                                    (Haswell, Zen 1-3)
neon       AArch64 NEON with the dot product extension (asimddp)    ARMv8.2-A and later: AWS
                                                                    Graviton 2-4, Ampere Altra,
                                                                    Neoverse N1/V1/V2
portable   plain C++ (the compiler vectorises what it can)          anything else
========== ======================================================== ==============================

int8 and int4 give the same bits on every tier. bf16 sums its products in one of three orders
(:attr:`Tier.bf16_order`, :func:`verispec.kernels.linear.reference_bf16_linear`): "chain" on
avx512, avx2vnni, avx2, neon and portable (the same bits on the five); "pairs" on avx512bf16
(VDPBF16PS: each input pair's odd product before its even one, denormals as zero); "amx" on amx
(AMX's own order of fp32 additions). The three differ by fp32 rounding. avx512bf16 asks for an
AMD CPU because VDPBF16PS's rounding was measured on AMD (Zen 4) only; an Intel CPU with AVX-512
BF16 runs amx (Sapphire Rapids and newer) or avx512. The neon tier is tested bit for bit against
the portable one by cross-compiling both for AArch64 and running them under qemu-user
(``tests/unit/test_kernel_neon.py``); its speed has not been measured on ARM hardware.
``$VERISPEC_ISA=amx|avx512bf16|avx512|avx2vnni|avx2|neon|portable`` forces a tier (for tests and
comparisons): one this CPU cannot execute is a :class:`~verispec.errors.ConfigError`.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import ConfigError

ISA_ENV = "VERISPEC_ISA"

_VEC = ("vec/pack.cpp", "vec/quantize.cpp", "vec/attention.cpp", "vec/layer_ops.cpp", "vec/pick.cpp")
_VECTOR_TIER = ("vec/linear.cpp", *_VEC, "bindings.cpp")  # every tier's sources (amx adds its tiles')
#: Headers every tier includes (part of each build key).
HEADERS = ("common.h", "vec/vec.h", "vec/dots.h", "vec/q4k_scales.h", "amx/amx.h")


@dataclass(frozen=True)
class Tier:
    """One build of the kernels: its sources (under ``csrc/``), compiler flags, the
    ``/proc/cpuinfo`` flags a CPU needs to execute it, the machine it needs ("x86_64",
    "aarch64", or None for any), the CPU vendor it is picked for by default (``/proc/cpuinfo``'s
    ``vendor_id``, or None for any: on other vendors it runs only when forced, and its tests run
    wherever it executes), and the order its bf16 kernel sums in ("chain", "pairs" or "amx")."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    machine: str | None = "x86_64"
    default_vendor: str | None = None
    bf16_order: str = "chain"

    def needs(self) -> str:
        """What a CPU needs to execute this tier, in words: its flags."""
        return ", ".join(self.cpu_flags)


#: The neon tier's compiler flags (also used by the tests that cross-compile it).
NEON_FLAGS = ("-march=armv8.2-a+dotprod",)
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c")
_AVX512_CPU = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c")

#: The tiers, fastest first (on the vendor each is picked for).
TIERS: tuple[Tier, ...] = (
    Tier(
        "amx",
        ("amx/w8a8.cpp", "amx/q4k.cpp", "amx/bf16.cpp", "amx/prefill.cpp", "amx/attention_tiles.cpp", *_VECTOR_TIER),
        (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-DVS_TIER_AMX=1"),
        (*_AVX512_CPU, "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"),
        bf16_order="amx",
    ),
    Tier(
        "avx512bf16",
        _VECTOR_TIER,
        (*_AVX512, "-mavx512bf16", "-DVS_VEC_DPBF16=1"),
        (*_AVX512_CPU, "avx512_bf16"),
        # VDPBF16PS adds as the pairs reference on Zen 4 and on an Intel Xeon with AMX alike, but
        # only Zen 4's single 512-bit FMA pipe gains from it: whole bf16 passes against avx512's,
        # 0.62x at T = 8 on Zen 4 and 1.00 / 0.96 / 1.08x at T = 1 / 5 / 8 on that Xeon
        # (benchmarks/results/avx512bf16_intel.md)
        default_vendor="AuthenticAMD",
        bf16_order="pairs",
    ),
    # (Intel CPUs without AMX run this one: AMD's with AVX-512 have BF16 and run avx512bf16)
    Tier("avx512", _VECTOR_TIER, (*_AVX512, "-DVS_TIER_AVX512=1"), _AVX512_CPU),
    Tier(  # (Intel CPUs without AVX-512 from Alder Lake on: Zen 5 has AVX-VNNI but runs avx512bf16)
        "avx2vnni",
        _VECTOR_TIER,
        ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DVS_TIER_AVX2VNNI=1"),
        ("avx2", "fma", "f16c", "avx_vnni"),
    ),
    Tier("avx2", _VECTOR_TIER, ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    Tier("neon", _VECTOR_TIER, NEON_FLAGS, ("asimddp",), machine="aarch64"),
    Tier("portable", _VECTOR_TIER, (), (), machine=None),
)
TIER_NAMES = tuple(t.name for t in TIERS)


def by_name(name: str) -> Tier:
    for tier in TIERS:
        if tier.name == name:
            return tier
    raise ConfigError(f"{ISA_ENV} must be one of {', '.join(TIER_NAMES)}, got {name!r}")


def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU as Linux reports them (empty elsewhere); read once."""
    return _cpu_flags()


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags", "Features").split())  # x86, AArch64


def cpu_vendor() -> str:
    """This CPU's vendor as Linux reports it ("AuthenticAMD", "GenuineIntel"; "" when not said)."""
    return cpuinfo_field("vendor_id")


@functools.cache
def cpuinfo_field(*names: str) -> str:
    """The value of the first ``/proc/cpuinfo`` line whose key is one of ``names`` ("" if none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() in names:
            return value.strip()
    return ""


def linux_machine() -> str | None:
    """ "x86_64" or "aarch64" on Linux on those machines, else None."""
    if sys.platform != "linux":
        return None
    return {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        platform.machine().lower()
    )


def missing(tier: Tier) -> list[str]:
    """What this machine lacks to execute ``tier`` ([] when it has everything)."""
    if tier.machine is not None and linux_machine() != tier.machine:
        kind = {"x86_64": "x86-64", "aarch64": "AArch64"}[tier.machine]
        return [f"{kind} Linux (this is {sys.platform} on {platform.machine()})"]
    flags = cpu_flags()
    return [f for f in tier.cpu_flags if f not in flags]


def runnable() -> tuple[Tier, ...]:
    """Every tier this CPU can execute, fastest first (portable always among them)."""
    return tuple(t for t in TIERS if not missing(t))


def best() -> Tier:
    """The fastest tier this CPU executes (of those picked by default for its vendor)."""
    vendor = cpu_vendor()
    return next(t for t in runnable() if t.default_vendor in (None, vendor))


def selected() -> Tier:
    """The tier the kernels run on: ``$VERISPEC_ISA`` when set (a tier this CPU executes, else a
    :class:`ConfigError` naming what it lacks), otherwise :func:`best`."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return best()
    tier = by_name(forced)
    lacks = missing(tier)
    if lacks:
        raise ConfigError(
            f"{ISA_ENV}={tier.name} needs a CPU with {tier.needs()}; this one lacks "
            f"{', '.join(lacks)}: unset it, or choose one of {', '.join(t.name for t in runnable())}"
        )
    return tier
