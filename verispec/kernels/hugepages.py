"""Weights in transparent huge pages: :func:`on_huge_pages`, :func:`move_to_huge_pages`, and
whether the model cache's files get them here, :func:`file_huge_pages`.

A decode pass streams every weight once, so its speed is the memory's read bandwidth, and reads
over 4 KiB pages pay a TLB miss every 4 KiB and stop the hardware prefetchers at every page
boundary. Linux backs anonymous memory with 2 MiB pages where a mapping asks for them
(``MADV_HUGEPAGE``) when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (the usual
default) or ``always``; torch's allocator does not ask. The packed cache files' mappings do ask
(:func:`advise_huge_pages`, from ``formats.convert.load_safetensors``), which gives huge pages only
where the filesystem keeps large folios in the page cache (ext4 since Linux 6.16, XFS) and the
file's pages came in as such (read back from disk, or written in 2 MiB pieces as verispec writes
them). Two Zen 4 cores in ``madvise`` mode (``benchmarks/results/huge_pages_zen4.md``): the
kernels' ``stream_read`` read 8-15% more per second from huge pages; one-token passes of the int4
target ran 1.03x faster, of the int4-all draft 1.04x-1.09x (copies against the file's small pages).
But a process's first huge pages cost time to find (the kernel compacts memory, the hypervisor
backs it): the default pair's load took 2-6 s longer on that machine, which a 128-token ``verispec
generate`` does not earn back. So the move is made where ``VERISPEC_HUGE_PAGES=1`` (``verispec
serve`` sets it unless it is set: a server loads once and decodes for hours); ``0`` or unset leaves
the weights where they were loaded. Where the kernel gives no huge pages (``never``, or no memory
to compact) the copy is still correct, on small pages.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / AArch64 transparent huge page
ALIGN = 64  # bytes: each tensor starts on a cache line, as the kernels' loads expect
HUGE_PAGES_ENV = "VERISPEC_HUGE_PAGES"  # "1": move the packed weights to huge pages


def advise_huge_pages(mm: mmap.mmap) -> None:
    """Ask Linux for 2 MiB pages under the mapping ``mm`` (``MADV_HUGEPAGE``, before any of it is
    touched). Anonymous memory then gets huge pages; a file's mapping gets them where the
    filesystem keeps large folios in the page cache (the file is then also read ahead in 2 MiB
    folios). Elsewhere (no transparent huge pages, another OS) nothing changes: small pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            mm.madvise(advice)


def huge_page_buffer(nbytes: int) -> Tensor:
    """A zeroed uint8 ``[nbytes]`` CPU tensor starting on a huge-page boundary, in an anonymous
    mapping advised for transparent huge pages (where the OS knows the advice; the tensor keeps
    the mapping alive); torch's allocation where anonymous mappings cannot be asked for."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows)
        return torch.zeros(nbytes, dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(area)
    base = torch.frombuffer(area, dtype=torch.uint8)  # (holds a reference to the mapping)
    start = -base.data_ptr() % HUGE_PAGE
    return base[start : start + nbytes]


def on_huge_pages(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of the contiguous CPU ``tensors``, same dtypes, shapes and values, one after another
    (each on a 64-byte boundary) in one :func:`huge_page_buffer`. Empty input: empty output."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("on_huge_pages copies contiguous CPU tensors")
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if total == 0:
        return [t.clone() for t in tensors]
    arena = huge_page_buffer(total)
    out = []
    for t, offset in zip(tensors, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        copy = arena[offset : offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Put the packed weights of every kernel projection in ``model`` (int4, int8 and bf16 codes,
    their scales and biases) on huge pages (:func:`on_huge_pages`), in place, before anything
    holds them, where ``VERISPEC_HUGE_PAGES=1`` (see the module docstring); returns the bytes
    moved (0 otherwise: the weights stay where they were loaded)."""
    from verispec.kernels.linear import Bf16Linear, Int8Linear, Q4KLinear, Q6KLinear

    if os.environ.get(HUGE_PAGES_ENV) != "1" or not sys.platform.startswith("linux"):  # (Linux's pages)
        return 0

    slots = [
        (module, name)
        for module in model.modules()
        if isinstance(module, Q4KLinear | Q6KLinear | Int8Linear | Bf16Linear)
        for name, buffer in module.named_buffers(recurse=False)
        if buffer is not None
    ]
    copies = on_huge_pages([getattr(module, name) for module, name in slots])
    for (module, name), copy in zip(slots, copies, strict=True):
        setattr(module, name, copy)
    return sum(c.numel() * c.element_size() for c in copies)


def smaps_fields(address: int) -> dict[str, str]:
    """The fields of the mapping holding ``address`` in /proc/self/smaps (``{"Rss": "1024 kB",
    "FilePmdMapped": "0 kB", "VmFlags": "rd wr mr ...", ...}``); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside:
                    fields[head.rstrip(":")] = rest.strip()
    except (OSError, ValueError):
        return {}
    return fields


def file_huge_mapped(address: int) -> int | None:
    """Bytes of the file mapping holding ``address`` that huge pages map (``FilePmdMapped`` in
    /proc/self/smaps), or None where that is not known (no such mapping, no smaps)."""
    field = smaps_fields(address).get("FilePmdMapped")
    return None if field is None else int(field.split()[0]) * 1024


def file_huge_pages(folder: str | os.PathLike[str]) -> bool | None:
    """Whether a file written into ``folder`` as verispec writes its packed caches (2 MiB-aligned
    pieces) and mapped as it maps them (asking for huge pages) is read through huge pages here:
    the filesystem keeps large folios in the page cache and the kernel maps them whole. Measured
    on a 4 MiB scratch file, deleted after; None where it cannot be told (no /proc/self/smaps, a
    folder that cannot be written)."""
    import tempfile

    from verispec.formats.convert import AlignedWriter

    if not sys.platform.startswith("linux"):
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".huge-pages-probe-") as f:
            out = AlignedWriter(f)  # type: ignore[arg-type]
            out.write(bytes(range(256)) * (2 * HUGE_PAGE // 256))
            out.close()
            f.flush()
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                advise_huge_pages(mm)
                pages = torch.frombuffer(mm, dtype=torch.uint8)
                pages[::4096].sum()  # (reads every 4 KiB page: the faults map them)
                huge = file_huge_mapped(pages.data_ptr())
                del pages  # (before the mapping closes)
        return None if huge is None else huge > 0
    except OSError:
        return None
