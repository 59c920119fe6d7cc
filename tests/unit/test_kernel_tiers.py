"""Every instruction-set tier of the kernels this CPU can execute computes the same bits: int8,
Q4_K, the activation quantisation, attention, RMSNorm, RoPE, SwiGLU, the greedy and sampled picks and the Q4_K
dequantiser on all tiers; bf16 on the tiers that sum in input order (avx512, avx2vnni, avx2, portable: "chain"),
while amx (AMX's order) and avx512bf16 (VDPBF16PS's pairs) differ from them by fp32 rounding only,
as the amx tier's bf16 attention does (its scores on AMX tiles).
Tiers this CPU cannot run are skipped, by name; those of this machine's architecture are still
compiled, so that a change to the code they share cannot break a tier only other CPUs run."""

from __future__ import annotations

import itertools
import platform
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.kernels import q4k_blocks, require_kernels
from verispec.errors import ConfigError
from verispec.kernels import build, dispatch

OTHERS = [t for t in dispatch.TIER_NAMES if t != "portable"]


def outputs(module: Any) -> dict[str, Any]:
    """Each kernel's result on fixed inputs (ragged sizes: partial 16-row blocks, short vectors)."""
    gen = torch.Generator().manual_seed(0)
    n, k = 72, 768
    w = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.zeros(80)
    scale[:n] = torch.rand(n, generator=gen) / 64
    q4k = module.q4k_pack(torch.from_numpy(q4k_blocks(n, k, seed=1)), n, k)
    int8 = module.w8a8_pack(codes)
    bf16 = module.bf16_pack(w.to(torch.bfloat16))
    out: dict[str, Any] = {"dequantize": module.q4k_dequantize(q4k, n, k)}
    for m in (1, 3, 7, 9, 16, 21):
        x = (torch.randn(m, k, generator=gen) * torch.where(torch.rand(m, k, generator=gen) < 0.05, 40.0, 1.0)).to(
            torch.bfloat16
        )
        out[f"q4k {m}"] = module.q4k_linear(x, q4k, n, k, bias)
        out[f"q4k fp32 {m}"] = module.q4k_linear(x.float(), q4k, n, k, None)
        out[f"int8 {m}"] = module.w8a8_linear(x, int8, scale, n, k, bias)
        out[f"int8 fp32 {m}"] = module.w8a8_linear(x.float(), int8, scale, n, k, None)
        out[f"quantize {m}"] = module.w8a8_quantize(x)
        out[f"bf16 {m}"] = module.bf16_linear(x, bf16, n, k, bias, True)
    # NaN (also in a block's first lane), infinity, blocks of zeros of both signs: the block maxima
    # take their in-order path; compared as bits (a NaN scale equals itself there)
    special = torch.randn(3, 256, generator=gen)
    special[0, 5], special[0, 70], special[2, 0] = float("nan"), float("inf"), float("nan")
    special[1, :64], special[1, 64:128], special[1, 130] = -0.0, 0.0, -0.0
    special[1, 192:256:2] = -0.0
    special[1, 193:256:2] = 0.0
    codes, scales, sums = module.w8a8_quantize(special.to(torch.bfloat16))
    out["quantize specials"] = (codes, scales.view(torch.int32), sums)
    h = (3 * torch.randn(5, 200, generator=gen)).to(torch.bfloat16)
    out["rms_norm"] = (module.rms_norm(h, torch.randn(5, 200, generator=gen).to(torch.bfloat16), h[0], 1e-6), h)
    gate_up = (4 * torch.randn(6, 272, generator=gen)).to(torch.bfloat16)
    out["silu_mul"] = module.silu_mul(gate_up[:, :136], gate_up[:, 136:])
    cos, sin = (torch.randn(7, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    out["rotary"] = module.rotary(torch.randn(7, 192, generator=gen).to(torch.bfloat16), cos, sin, 3, 64)
    scores = (3 * torch.randn(3, 301, generator=gen)).to(torch.bfloat16)
    more = (3 * torch.randn(3, 21, generator=gen)).float()
    names = torch.randperm(322, generator=gen)
    picked = module.greedy_pick(scores, names[:301].sort().values, more, names[301:].sort().values, more < 0)
    out["greedy_pick"] = (picked[0], picked[1].view(torch.int32), picked[2])  # (the confidence's bits)
    q = torch.randn(2, 3, 4, 64, generator=gen)
    keys, values = (torch.randn(2, 2, 37, 64, generator=gen) for _ in range(2))
    visible = torch.rand(2, 3, 37, generator=gen) < 0.7
    visible[:, :, 0] = True
    for dtype in (torch.bfloat16, torch.float32):
        out[f"attention {dtype}"] = module.attention_rows(q.to(dtype), keys.to(dtype), values.to(dtype), visible, 0.125)
    q = torch.randn(1, 2, 12, 48, generator=gen)  # a head size without unrolled loops, 6 query heads per key head
    keys, values = (torch.randn(1, 2, 29, 48, generator=gen) for _ in range(2))
    visible = torch.rand(1, 2, 29, generator=gen) < 0.7
    visible[:, :, 0] = True
    for dtype in (torch.bfloat16, torch.float32):
        out[f"attention d48 {dtype}"] = module.attention_rows(
            q.to(dtype), keys.to(dtype), values.to(dtype), visible, 0.125
        )
    x = (3 * torch.randn(3, 301, generator=gen)).to(torch.bfloat16).float()
    rules = torch.tensor([[0.8, 0, 0.9, 0.0], [1.0, 7, 1.0, 0.05], [1.3, 0, 0.99, 0.0]], dtype=torch.float64)
    sampled = module.sampled_pick(x, rules, torch.rand(3, dtype=torch.float64, generator=gen))
    out["sampled_pick"] = (sampled[0], sampled[1].view(torch.int32), sampled[2])  # (the law's bits)
    return out


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return {
        tier: outputs(require_kernels(tier))
        for tier in dispatch.TIER_NAMES
        if not dispatch.missing(dispatch.by_name(tier))
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b)


@pytest.mark.parametrize("tier", OTHERS)
def test_each_tier_equals_the_portable_one_bit_for_bit(tier: str, results: dict[str, dict[str, Any]]) -> None:
    if tier not in results:
        pytest.skip(
            f"this CPU cannot run the {tier} tier (it lacks {', '.join(dispatch.missing(dispatch.by_name(tier)))})"
        )
    ours, portable = results[tier], results["portable"]
    differ = [key for key in portable if not same(ours[key], portable[key])]
    other_order = dispatch.by_name(tier).bf16_order != "chain"
    expected = [key for key in portable if key.startswith("bf16 ")] if other_order else []
    assert [key for key in differ if key not in MAY_DIFFER.get(tier, ())] == expected


# Results a tier computes in another order whose rounding may or may not show in its bf16 output: the
# amx tier's bf16 attention scores come from AMX tiles (csrc/amx/attention_tiles.cpp; head size 64
# here, while the head size 48 keeps the vectors' order)
MAY_DIFFER = {"amx": (f"attention {torch.bfloat16}",)}


@pytest.mark.parametrize("tier", [t.name for t in dispatch.TIERS if t.bf16_order != "chain"])
def test_a_bf16_of_another_order_differs_by_fp32_rounding_only(tier: str, results: dict[str, dict[str, Any]]) -> None:
    if tier not in results:
        pytest.skip(
            f"this CPU cannot run the {tier} tier (it lacks {', '.join(dispatch.missing(dispatch.by_name(tier)))})"
        )
    for key in (k for k in results["portable"] if k.startswith("bf16 ")):
        a, b = results[tier][key].double(), results["portable"][key].double()
        assert ((a - b).abs() <= 1e-5 * b.abs().max() + 1e-6).all(), key
    for key in MAY_DIFFER.get(tier, ()):  # (outputs in bf16: one unit in the last place at most)
        a, b = results[tier][key].double(), results["portable"][key].double()
        assert ((a - b).abs() <= 2**-7 * b.abs()).all(), key


def test_the_tiers_are_ordered_and_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = [t.name for t in dispatch.runnable()]
    assert runnable[-1] == "portable" and runnable == [t for t in dispatch.TIER_NAMES if t in runnable]
    monkeypatch.delenv(dispatch.ISA_ENV, raising=False)
    # the fastest, but for a tier picked by default on another vendor's CPUs only (avx512bf16)
    picked = [t for t in runnable if dispatch.by_name(t).default_vendor in (None, dispatch.cpu_vendor())]
    assert dispatch.selected().name == dispatch.best().name == picked[0]
    # a CPU that runs a tier runs every tier below it (of its own machine, and the portable one), but
    # for avx2vnni: AVX-VNNI is an extension of its own, which AVX-512 CPUs may lack (Ice Lake, Zen 4)
    chain = [t for t in dispatch.TIERS if t.name != "avx2vnni"]
    for higher, lower in itertools.pairwise(chain):
        if lower.machine in (None, higher.machine):
            assert set(higher.cpu_flags) >= set(lower.cpu_flags)
    vnni = dispatch.by_name("avx2vnni")
    assert set(vnni.cpu_flags) == set(dispatch.by_name("avx2").cpu_flags) | {"avx_vnni"}
    assert [t.name for t in dispatch.TIERS if t.machine == "aarch64"] == ["neon"]
    for name in runnable:
        monkeypatch.setenv(dispatch.ISA_ENV, name.upper())
        assert dispatch.selected().name == name


def test_avx512bf16_is_picked_on_amd_and_runs_forced_on_intel(monkeypatch: pytest.MonkeyPatch) -> None:
    """VDPBF16PS adds in the pairs order on AMD and Intel alike, but only pays on AMD (Zen 4's one
    512-bit FMA pipe): an Intel CPU with the same flags (Cooper Lake) picks avx512 and runs
    avx512bf16 when it is forced (and its tests); one with AMX picks amx."""
    tier = dispatch.by_name("avx512bf16")
    flags = frozenset(tier.cpu_flags)
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: flags)
    monkeypatch.setattr(dispatch, "linux_machine", lambda: "x86_64")
    monkeypatch.delenv(dispatch.ISA_ENV, raising=False)
    monkeypatch.setattr(dispatch, "cpu_vendor", lambda: "AuthenticAMD")
    assert dispatch.missing(tier) == [] and dispatch.selected().name == "avx512bf16"
    monkeypatch.setattr(dispatch, "cpu_vendor", lambda: "GenuineIntel")
    assert dispatch.missing(tier) == [] and tier in dispatch.runnable()
    assert dispatch.selected().name == "avx512"
    monkeypatch.setenv(dispatch.ISA_ENV, "avx512bf16")
    assert dispatch.selected().name == "avx512bf16"
    monkeypatch.delenv(dispatch.ISA_ENV)
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: flags | set(dispatch.by_name("amx").cpu_flags))
    assert dispatch.selected().name == "amx"
    monkeypatch.setattr(dispatch, "cpu_flags", lambda: flags - {"avx512_bf16"})
    with pytest.raises(ConfigError, match=r"need a CPU with avx2, .*avx512_bf16; this one lacks avx512_bf16"):
        build.check_buildable(tier)


@pytest.mark.parametrize("tier", [t.name for t in dispatch.TIERS if t.machine == "x86_64"])
def test_a_tier_this_cpu_cannot_run_still_compiles(tier: str, tmp_path: Path) -> None:
    """Its sources (but the torch bindings) and tests/unit/kernel_check.cpp compile and link with its
    flags: the amx tier's, say, on every CPU without AMX, where nothing else would build it."""
    chosen = dispatch.by_name(tier)
    if not dispatch.missing(chosen):
        pytest.skip(f"this CPU runs the {tier} tier: the tests above build and run it")
    cxx = build.compiler()
    if platform.machine() != chosen.machine or cxx is None:
        pytest.skip(f"the {tier} tier is built for {chosen.machine}; this is {platform.machine()} (or has no g++)")
    # (-O1: inlining, where a wrong instruction set shows, at half the compile time of -O3)
    flags = [*(f for f in build.flags_of(chosen) if f != "-O3"), "-O1", "-std=c++17"]
    flags += [f"-I{build.SOURCE_DIR}", f"-I{build.SOURCE_DIR / 'vec'}"]
    sources = [build.SOURCE_DIR / name for name in chosen.sources if name != "bindings.cpp"]
    sources.append(Path(__file__).with_name("kernel_check.cpp"))

    def compile_one(source: Path) -> subprocess.CompletedProcess[str]:
        out = tmp_path / f"{source.parent.name}_{source.stem}.o"
        cmd = [cxx, *flags, "-c", str(source), "-o", str(out)]
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(compile_one, sources))
    failed = [(s.name, d.stderr[-3000:]) for s, d in zip(sources, done, strict=True) if d.returncode != 0]
    assert not failed, failed
    linked = subprocess.run(
        [cxx, *flags, *map(str, sorted(tmp_path.glob("*.o"))), "-o", str(tmp_path / "kernel_check")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert linked.returncode == 0, linked.stderr[-3000:]
