"""``verispec doctor``: the machine as verispec sees it, as JSON and as a table."""

from __future__ import annotations

import json

import pytest

from verispec.cli import main
from verispec.kernels import dispatch


def test_doctor_reports_the_cpu_the_kernels_and_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--no-bandwidth"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cpu"] and report["cores"] >= 1 and report["read_bandwidth_gbps"] is None
    kernels = report["kernels"]
    assert kernels["tiers"] == [t.name for t in dispatch.runnable()] and kernels["tiers"][-1] == "portable"
    assert kernels["tier"] == dispatch.selected().name and kernels["status"] in ("ready", "failed")
    assert report["huge_pages"]["cache_files"] in (True, False, None)  # measured on a scratch file
    cache = kernels["cache"]  # the kernel build folders and their size
    assert cache["path"].endswith("kernels") and cache["builds"] >= (kernels["status"] == "ready") and cache["mb"] >= 0
    if report["kernels"]["status"] == "ready":  # what generate would pick for the default pair
        from verispec.pipeline import machine_defaults

        assert report["recommended"]["flags"] == machine_defaults().flags()
        assert report["recommended"]["flags"].split()[3] in ("int4-all", "int8")  # the draft's precision
    else:
        assert "int8" not in report["recommended"]["flags"]
    assert main(["doctor"]) == 0  # the table, bandwidth measured
    out = capsys.readouterr().out
    assert "verispec kernels" in out and "tier" in out and "GB/s" in out and "recommended" in out
    assert "kernel builds" in out


def test_the_cpu_is_named_down_to_its_microarchitecture() -> None:
    """A virtual machine often says only "AMD EPYC": the family and model say which generation
    (and so which instructions and speeds) it is; every benchmark prints that with the tier."""
    from verispec.cli.doctor import cpu_model, machine_line, microarchitecture

    assert microarchitecture("AuthenticAMD", 25, 1) == "Zen 3"  # Milan
    assert microarchitecture("AuthenticAMD", 25, 17) == "Zen 4"  # Genoa
    assert microarchitecture("AuthenticAMD", 25, 0x61) == "Zen 4"  # Raphael
    assert microarchitecture("AuthenticAMD", 26, 2) == "Zen 5"
    assert microarchitecture("AuthenticAMD", 23, 0x31) == "Zen 2"
    assert microarchitecture("GenuineIntel", 6, 0x8F) == "Sapphire Rapids"
    assert microarchitecture("GenuineIntel", 6, 0x6A) == "Ice Lake-SP"
    assert microarchitecture("AuthenticAMD", 25, 0x90) is None  # not guessed
    assert microarchitecture("GenuineIntel", 6, 0x01) is None
    # a hypervisor's model number (167: a desktop part without AMX) on a CPU with AMX: its flags say
    assert microarchitecture("GenuineIntel", 6, 167, frozenset({"avx512f", "amx_tile"})) == (
        "Sapphire / Emerald Rapids class, by its AMX"
    )
    assert "Granite Rapids" in str(microarchitecture("GenuineIntel", 6, 167, frozenset({"amx_tile", "amx_fp16"})))
    assert microarchitecture("GenuineIntel", 6, 0x8F, frozenset({"amx_fp16"})) == "Sapphire Rapids"  # the model first
    assert microarchitecture("GenuineIntel", 6, 167, frozenset({"avx512f"})) is None  # no AMX: not guessed
    assert microarchitecture("ARM", 0, 0) is None
    assert cpu_model()
    assert f"{dispatch.selected().name} tier" in machine_line() and "threads" in machine_line()


def test_read_bandwidth_reads_the_buffer_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated probes (decode_speed.py, once a round) reuse one buffer: ``buf`` is what is read,
    whatever ``nbytes`` says (here torch's sum, the path where the kernels do not build)."""
    import torch

    from verispec.errors import ConfigError
    from verispec.kernels import bandwidth, build

    def no_kernels() -> None:
        raise ConfigError("no kernels here")

    monkeypatch.setattr(build, "load", no_kernels)
    seen: list[int] = []
    buf = torch.ones(1 << 16)
    monkeypatch.setattr(torch.Tensor, "sum", lambda self: seen.append(self.data_ptr()) or torch.tensor(0.0))
    out = bandwidth.read_bandwidth(1 << 30, reps=2, buf=buf)
    assert seen == [buf.data_ptr()] * 3 and out["best"] >= out["median"] > 0  # (a warm-up, then 2 reads)


def test_the_bandwidth_probe_is_ones_on_huge_page_memory() -> None:
    import mmap

    import torch

    from verispec.kernels.bandwidth import probe_buffer
    from verispec.kernels.hugepages import HUGE_PAGE

    buf = probe_buffer(3 << 20)
    assert buf.dtype == torch.float32 and buf.numel() == (3 << 20) // 4 and bool((buf == 1).all())
    if hasattr(mmap, "MAP_ANONYMOUS"):  # (a huge_page_buffer: advised for huge pages where the OS has them)
        assert buf.data_ptr() % HUGE_PAGE == 0
    assert probe_buffer(10).numel() == 64  # (at least 64 floats)
