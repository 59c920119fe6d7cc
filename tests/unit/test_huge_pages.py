"""Where packed weights lie in memory: copies on transparent huge pages (verispec.kernels.hugepages:
the same values, the kernels' alignment, a kernel model whose logits do not change when its weights
move), file mappings that ask for huge pages and files written for them (verispec.formats.convert),
and fused projections that view adjacent weights instead of copying them."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import require_kernels
from verispec.certify.tiny import tiny_config
from verispec.kernels.hugepages import HUGE_PAGE, HUGE_PAGES_ENV, move_to_huge_pages, on_huge_pages, smaps_fields
from verispec.models.transformer import Transformer, random_state_dict


def test_copies_keep_values_dtypes_and_shapes_on_aligned_addresses() -> None:
    tensors = [
        torch.arange(10, dtype=torch.int16),
        torch.randn(3, 5),
        torch.empty(0),
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
        torch.randn(7, dtype=torch.bfloat16),
    ]
    copies = on_huge_pages(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % 64 == 0 and (t.numel() == 0 or c.data_ptr() != t.data_ptr())
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    with pytest.raises(ValueError, match="contiguous"):
        on_huge_pages([torch.randn(4, 4).t()])


def kernel_model() -> Transformer:
    require_kernels()
    config = tiny_config(64, hidden=128, layers=2)  # (head size 32: the row kernels')
    state = random_state_dict(config, seed=3, dtype=torch.bfloat16)
    return Transformer(config, state, dtype=torch.bfloat16, cpu_kernels=True)


def logits(model: Transformer) -> torch.Tensor:
    return model(torch.tensor([[1, 5, 9, 2, 7]]), None, model.new_cache(1, 16))


def test_weights_move_only_when_asked_and_the_logits_stay_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    import verispec.kernels.hugepages as hugepages

    calls: list[int] = []
    real = hugepages.on_huge_pages
    monkeypatch.setattr(hugepages, "on_huge_pages", lambda ts: calls.append(len(ts)) or real(ts))
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    model = kernel_model()
    assert model.cpu_kernels and calls == []  # by default the weights stay where they were loaded
    monkeypatch.setenv(HUGE_PAGES_ENV, "1")
    moved = kernel_model()
    packed = [m for m in moved.modules() if m.__class__.__name__ in ("Bf16Linear", "Int8Linear", "Q4KLinear")]
    assert len(calls) == 1 and calls[0] >= len(packed) > 0  # every packed projection, the head too, at once
    assert torch.equal(logits(model), logits(moved))  # the native layer loop reads the moved copies
    assert move_to_huge_pages(torch.nn.Linear(2, 2)) == 0  # nothing packed, nothing moved


class Recorder:
    """A binary file that remembers where each write began and how long it was."""

    def __init__(self) -> None:
        self.data, self.writes = bytearray(), []

    def write(self, b: bytes | memoryview) -> int:
        self.writes.append((len(self.data), len(b)))
        self.data += b
        return len(b)


def test_aligned_writer_passes_every_byte_on_in_writes_on_2_mib_boundaries() -> None:
    from verispec.formats.convert import AlignedWriter

    rng = torch.Generator().manual_seed(0)
    pieces = [8, 100, HUGE_PAGE - 108, 3, 3 * HUGE_PAGE + 5, 0, HUGE_PAGE, 17, 5 * HUGE_PAGE // 2]
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes() for n in pieces]
    f = Recorder()
    out = AlignedWriter(f)  # type: ignore[arg-type]
    for c in chunks:
        out.write(memoryview(c))
    out.close()
    assert bytes(f.data) == b"".join(chunks)
    for start, length in f.writes[:-1]:
        assert start % HUGE_PAGE == 0 and length % HUGE_PAGE == 0 and length > 0
    assert f.writes[-1][0] % HUGE_PAGE == 0  # the end: whatever is left, from a boundary


def test_safetensors_mappings_ask_for_huge_pages(tmp_path) -> None:
    import mmap
    import os

    from verispec.formats.convert import load_safetensors, write_tensors

    if not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        pytest.skip("this OS has no transparent huge pages to ask for")
    path = tmp_path / "w.safetensors"
    weights = torch.randint(-128, 127, (3 << 20,), dtype=torch.int8)
    write_tensors(path, [("w", torch.int8, (3 << 20,))], [("w", weights)])
    loaded = load_safetensors(path)["w"]
    assert torch.equal(loaded, weights)
    flags = smaps_fields(loaded.data_ptr()).get("VmFlags", "").split()
    if not flags:
        pytest.skip("no /proc/self/smaps VmFlags here")
    assert "hg" in flags  # (recorded whatever /sys/kernel/mm/transparent_hugepage/enabled says)


def test_cat_adjacent_views_parts_that_lie_back_to_back_and_copies_the_others() -> None:
    from verispec.kernels.linear import cat_adjacent

    whole = torch.arange(100, dtype=torch.uint8)
    parts = [whole[10:30], whole[30:31], whole[31:70]]
    joined = cat_adjacent(parts)
    assert torch.equal(joined, torch.cat(parts))
    assert joined.data_ptr() == parts[0].data_ptr() and joined.untyped_storage().data_ptr() == whole.data_ptr()
    for others in (
        [whole[10:30], whole[31:70]],  # a gap
        [whole[30:40], whole[10:30]],  # out of order
        [whole[10:30], whole.clone()[30:40]],  # another storage
        [whole[10:30], whole[30:46].view(torch.int16)],  # another dtype
    ):
        copy = cat_adjacent(others)
        assert copy.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        if others[1].dtype == torch.uint8:
            assert torch.equal(copy, torch.cat(others))


def test_memory_reports_count_the_bytes_tensors_span_not_the_storage_they_view() -> None:
    from verispec.bench.local import tensor_bytes

    mapping = torch.zeros(1000, dtype=torch.uint8)  # (as a file's mapping: every weight a view of it)
    module = torch.nn.Module()
    module.register_buffer("a", mapping[100:300])
    module.register_buffer("b", mapping[200:400].view(torch.int16))  # overlaps a: 100 new bytes
    module.register_buffer("c", mapping[900:910])
    cache = torch.zeros(4, 8, dtype=torch.float32)
    root = {"model": module, "caches": [cache[:2]], "whole_cache": cache}
    assert tensor_bytes(root) == {"weights": 310, "other": 128}
    strided = torch.zeros(10, 10)[:, 2]  # 10 floats, 9 rows apart: spans 91 of them
    assert tensor_bytes([strided]) == {"weights": 0, "other": 91 * 4}


def test_safetensors_tensors_are_views_of_one_mapping_where_their_offsets_allow(tmp_path) -> None:
    import json
    import struct

    import numpy as np

    from verispec.formats.convert import load_safetensors

    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},  # aligned: a view
        "c": {"dtype": "U8", "shape": [3], "data_offsets": [12, 15]},
        "d": {"dtype": "F32", "shape": [2], "data_offsets": [15, 23]},  # 4-byte values at an odd offset
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    data = bytes([1, 2, 3, 4]) + np.array([1.5, -2.0], np.float32).tobytes() + bytes([5, 6, 7])
    data += np.array([0.25, 8.0], np.float32).tobytes()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    t = load_safetensors(path)
    assert t["a"].tolist() == [1, 2, 3, 4] and t["b"].tolist() == [1.5, -2.0] and t["c"].tolist() == [5, 6, 7]
    assert t["d"].tolist() == [0.25, 8.0]
    shared = {t[name].untyped_storage().data_ptr() for name in "abc"}
    assert len(shared) == 1 and t["a"].untyped_storage().nbytes() == path.stat().st_size


def test_whether_cache_files_get_huge_pages_is_measured_and_leaves_nothing(tmp_path) -> None:
    import sys

    from verispec.cli.doctor import huge_pages_line
    from verispec.kernels.hugepages import file_huge_mapped, file_huge_pages

    answer = file_huge_pages(tmp_path)
    assert answer in (True, False, None) and list(tmp_path.iterdir()) == []  # the scratch file is gone
    if sys.platform.startswith("linux"):
        assert answer is not None  # (a writable folder, /proc/self/smaps)
        assert file_huge_pages("/proc/no-such-folder") is None  # cannot be written: not known
        assert file_huge_mapped(0) is None  # no mapping holds address 0
    lines = {True: "read through huge pages", False: "VERISPEC_HUGE_PAGES=1", None: "not measured"}
    for cache_files, says in lines.items():
        assert says in huge_pages_line({"transparent": "madvise", "cache_files": cache_files})
