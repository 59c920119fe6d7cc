"""Weights copied onto transparent huge pages (verispec.kernels.hugepages): the same values, the
kernels' alignment, and a kernel model whose logits do not change when its weights move."""

from __future__ import annotations

import pytest
import torch

from tests.kernels import require_kernels
from verispec.certify.tiny import tiny_config
from verispec.kernels.hugepages import HUGE_PAGE, HUGE_PAGES_ENV, move_to_huge_pages, on_huge_pages
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
