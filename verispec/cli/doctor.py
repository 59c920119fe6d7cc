"""``verispec doctor``: what this machine offers verispec, and the flags that fit it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

#: Instruction sets worth naming: what the kernels need, and what a CPU without them has instead.
FEATURES = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
            "amx_tile", "amx_bf16", "amx_int8", "asimd", "asimddp")  # fmt: skip


def register(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="show the CPU, whether verispec's kernels run on it, the memory bandwidth and the flags that fit",
        description="Report this machine as verispec sees it: CPU model and instruction sets, whether "
        "verispec's C++ kernels run here (and build them if they were not built yet), torch's threads, the "
        "measured memory read bandwidth, the CUDA devices, and the precision flags that fit.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurement (about a second)")
    p.set_defaults(run=run)


def cpu_model() -> str:
    """This CPU's name, and on x86 its family and model with the microarchitecture they identify:
    "AMD EPYC (family 25 model 17: Zen 4)". (A virtual machine often names only the brand, and
    the same brand spans microarchitectures of different instruction sets and speeds.)"""
    from verispec.kernels.dispatch import cpu_flags, cpu_vendor, cpuinfo_field

    name = cpuinfo_field("model name", "Model") or platform.processor() or platform.machine()
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    if not (family.isdigit() and model.isdigit()):
        return name
    arch = microarchitecture(cpu_vendor(), int(family), int(model), cpu_flags())
    return f"{name} (family {family} model {model}{': ' + arch if arch else ''})"


def machine_line() -> str:
    """One line naming what a measurement ran on, for benchmarks to print and record: the CPU
    (:func:`cpu_model`), the kernel tier in use and torch's threads."""
    import torch

    from verispec.errors import ConfigError
    from verispec.kernels import dispatch

    try:
        tier = f"{dispatch.selected().name} tier"
    except ConfigError:
        tier = f"no kernel tier (${dispatch.ISA_ENV} names none this CPU runs)"
    return f"{cpu_model()}, {tier}, {torch.get_num_threads()} threads, torch {torch.__version__}"


#: Intel family 6 models verispec names: the generations from AVX2 on that its tiers tell apart.
_INTEL_MODELS = {
    **dict.fromkeys((0x3C, 0x3F, 0x45, 0x46), "Haswell"),
    **dict.fromkeys((0x3D, 0x47, 0x4F, 0x56), "Broadwell"),
    0x55: "Skylake-SP / Cascade Lake / Cooper Lake",
    **dict.fromkeys((0x6A, 0x6C), "Ice Lake-SP"),
    **dict.fromkeys((0x7D, 0x7E), "Ice Lake"),
    **dict.fromkeys((0x8C, 0x8D), "Tiger Lake"),
    **dict.fromkeys((0x97, 0x9A), "Alder Lake"),
    **dict.fromkeys((0xB7, 0xBA, 0xBF), "Raptor Lake"),
    0x8F: "Sapphire Rapids",
    0xCF: "Emerald Rapids",
    **dict.fromkeys((0xAD, 0xAE), "Granite Rapids"),
}


#: AMD families and model ranges [first, last + 1) verispec tells apart.
_AMD_MODELS = (
    (0x17, 0x00, 0x30, "Zen / Zen+"),
    (0x17, 0x30, 0x100, "Zen 2"),
    (0x19, 0x00, 0x10, "Zen 3"),
    (0x19, 0x10, 0x20, "Zen 4"),
    (0x19, 0x20, 0x60, "Zen 3"),
    (0x19, 0x60, 0x80, "Zen 4"),
    (0x19, 0xA0, 0xB0, "Zen 4"),
    (0x1A, 0x00, 0x100, "Zen 5"),
)


#: Intel instructions that name a server generation where the model number does not (a hypervisor
#: may report another model than the host's, e.g. 167, a desktop part without AMX): the first
#: present wins.
_INTEL_BY_FLAGS = (
    ("amx_fp16", "Granite Rapids class, by its AMX-FP16"),
    ("amx_tile", "Sapphire / Emerald Rapids class, by its AMX"),
)


def microarchitecture(vendor: str, family: int, model: int, flags: frozenset[str] = frozenset()) -> str | None:
    """The microarchitecture an x86 vendor, family and model identify, where verispec knows it; for
    an Intel model it does not know, the server generation its ``flags`` (Linux's names) imply."""
    if vendor == "GenuineIntel" and family == 6:
        return _INTEL_MODELS.get(model) or next((name for flag, name in _INTEL_BY_FLAGS if flag in flags), None)
    if vendor == "AuthenticAMD":
        return next((name for f, lo, hi, name in _AMD_MODELS if f == family and lo <= model < hi), None)
    return None


def diagnose(measure_bandwidth: bool = True) -> dict[str, Any]:
    """Everything the command reports, as plain data (builds the kernels when the CPU can run them)."""
    import torch

    from verispec.errors import ConfigError
    from verispec.kernels import build, dispatch
    from verispec.kernels.bandwidth import read_bandwidth

    flags = dispatch.cpu_flags()
    runnable = [t.name for t in dispatch.runnable()]
    kernels: dict[str, Any] = {"tiers": runnable, "best": dispatch.best().name}
    try:
        tier = dispatch.selected()
        kernels["tier"] = tier.name
        start = time.perf_counter()
        build.load()
        kernels |= {"status": "ready", "seconds": round(time.perf_counter() - start, 2), "key": build.build_key()}
    except ConfigError as exc:
        kernels |= {"status": "failed", "error": str(exc)}
    kernels["supported"] = kernels["status"] == "ready"
    root = build.cache_dir()
    folders = [f for f in root.iterdir() if f.is_dir()] if root.is_dir() else []
    kernels["cache"] = {
        "path": str(root),
        "builds": len(folders),
        "mb": round(sum(f.stat().st_size for d in folders for f in d.rglob("*") if f.is_file()) / 1e6, 1),
    }
    if kernels["supported"]:
        from verispec.pipeline import machine_defaults

        picked = machine_defaults()  # the default pair (the header of a prepared GGUF, if any, says int4)
        flags_hint, why = picked.flags(), picked.why
    else:
        flags_hint = "--dtype bf16 --draft-dtype bf16"
        why = "torch's kernels (verispec's did not build here); int8 / int4 do not run"
    report: dict[str, Any] = {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "features": sorted(f for f in FEATURES if f in flags),
        "kernels": kernels,
        "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "read_bandwidth_gbps": round(read_bandwidth(1 << 29, 5)["best"], 1) if measure_bandwidth else None,
        "huge_pages": huge_pages(),
        "recommended": {"flags": flags_hint, "why": why},
        "loadavg": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    return report


def huge_pages() -> dict[str, Any]:
    """Linux's transparent-huge-page setting, and whether packed weights written to and mapped from
    the model cache are read through huge pages here (measured: :func:`file_huge_pages`)."""
    from verispec.formats.registry import verispec_home
    from verispec.kernels.hugepages import file_huge_pages

    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    try:
        chosen = setting.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        chosen = None
    return {"transparent": chosen, "cache_files": file_huge_pages(verispec_home())}


def huge_pages_line(hp: dict[str, Any]) -> str:
    """The table's line for :func:`huge_pages`' report: what it found, and what to do about it."""
    if hp["cache_files"]:
        return f"the model cache's files are read through huge pages (transparent huge pages: {hp['transparent']})"
    if hp["cache_files"] is False:
        return (
            "the model cache's files are read through 4 KiB pages here; VERISPEC_HUGE_PAGES=1 copies the weights "
            "onto huge pages at load (seconds; verispec serve does it)"
            + ("" if hp["transparent"] in ("madvise", "always") else f" (transparent huge pages: {hp['transparent']})")
        )
    return "not measured here (not Linux, or the model cache cannot be written)"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    with err.status("looking at this machine (the kernels build once, 30 s to a minute)", spinner="dots"):
        report = diagnose(measure_bandwidth=not args.no_bandwidth)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    k = report["kernels"]
    status = f"{k.get('tier', '?')} tier, {k['status']}" + (f" ({k['seconds']} s)" if "seconds" in k else "")
    status += f"; this CPU runs {', '.join(k['tiers'])}"
    if k.get("error"):
        status += f": {k['error']}"
    table = Table(title="verispec doctor", show_header=False, box=None)
    table.add_row("cpu", f"{report['cpu']} ({report['machine']}, {report['cores']} cores)")
    table.add_row("instructions", ", ".join(report["features"]) or "-")
    table.add_row("verispec kernels", status)
    cache = k["cache"]
    table.add_row(
        "kernel builds", f"{cache['builds']} in {cache['path']} ({cache['mb']:.0f} MB; a new build removes stale ones)"
    )
    table.add_row("torch", f"{report['torch']}, {report['torch_threads']} threads")
    bw = report["read_bandwidth_gbps"]
    table.add_row(
        "read bandwidth", "-" if bw is None else f"{bw:.1f} GB/s (512 MiB, best of 5; load {report['loadavg']})"
    )
    table.add_row("huge pages", huge_pages_line(report["huge_pages"]))
    table.add_row("cuda", ", ".join(report["cuda"]) or "none")
    table.add_row("recommended", f"{report['recommended']['flags']}  ({report['recommended']['why']})")
    Console().print(table)
    return 0
