"""Unit tests of the static KV cache (verispec.models.kv_cache), driven directly, without a model.

Keys written are recognisable numbers (slot * 1000 + position) so that every check states exactly
which entry must be where.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from verispec.errors import ConfigError, InputError
from verispec.models.config import ModelConfig
from verispec.models.kv_cache import KVCache

CFG = ModelConfig(
    architecture="llama",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position=128,
    tie_word_embeddings=False,
    attention_bias=False,
)


def marked(values: Tensor) -> Tensor:
    """``[B, T]`` numbers -> ``[B, T, H_kv, D]`` keys whose every channel holds that number."""
    return values.to(torch.float32)[:, :, None, None].expand(-1, -1, CFG.num_kv_heads, CFG.head_dim)


def append(cache: KVCache, values: Tensor, slots: list[int] | None = None, num_new: object = None) -> None:
    """What a forward pass does to the cache: plan, write every layer (layer l adds 100 * l), commit."""
    b, t = values.shape
    plan = cache.begin_step(slots, t, b, num_new)  # type: ignore[arg-type]
    for layer in range(cache.num_layers):
        cache.write(layer, plan, marked(values + 100 * layer), -marked(values + 100 * layer))
    cache.end_step(plan)


def stored(cache: KVCache, slot: int, layer: int = 0) -> list[int]:
    """The numbers held by ``slot`` at positions ``[0, length)``."""
    n = int(cache.lengths[slot])
    return [int(x) for x in cache.k[layer, slot, 0, :n, 0].tolist()]


def test_shapes_dtype_and_memory() -> None:
    cache = KVCache(CFG, 3, 20, dtype=torch.bfloat16)
    assert cache.k.shape == (3, 3, 2, 21, 8) and cache.v.shape == cache.k.shape
    assert cache.k.dtype == torch.bfloat16 and cache.lengths.dtype == torch.int64
    assert cache.memory_bytes() == 2 * 3 * 3 * 2 * 21 * 8 * 2
    assert cache.bytes_per_token() == 2 * 3 * 2 * 8 * 2
    assert "MiB" in repr(cache)
    with pytest.raises(ConfigError):
        KVCache(CFG, 0, 20)


def test_append_at_each_sequences_own_offset() -> None:
    cache = KVCache(CFG, 2, 16)
    append(cache, torch.tensor([[1, 2, 3], [11, 12, 0]]), num_new=[3, 2])
    append(cache, torch.tensor([[4, 5], [13, 0]]), num_new=torch.tensor([2, 1]))
    assert cache.lengths.tolist() == [5, 3]
    assert stored(cache, 0) == [1, 2, 3, 4, 5]
    assert stored(cache, 1) == [11, 12, 13]
    assert stored(cache, 1, layer=2) == [211, 212, 213]
    assert int(cache.v[1, 0, 0, 2, 0]) == -103
    # Padding went to the scratch column, never inside [0, max_len).
    assert cache.k[:, 1, :, 3:16].abs().sum() == 0


def test_read_views_for_consecutive_slots_and_gathers_otherwise() -> None:
    cache = KVCache(CFG, 4, 16)
    append(cache, torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]))
    plan = cache.begin_step([1, 2], 1, 2, [0, 0])
    k, _ = cache.read(0, plan)
    assert k.shape == (2, 2, plan.span, 8) and k.data_ptr() == cache.k[0, 1].data_ptr()  # a view
    plan = cache.begin_step([3, 0], 1, 2, [0, 0])
    k, _ = cache.read(0, plan)
    assert k[:, 0, :2, 0].tolist() == [[7, 8], [1, 2]]


def test_truncate_is_o1_and_only_shrinks() -> None:
    cache = KVCache(CFG, 2, 16)
    append(cache, torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    before = cache.k.clone()
    ptr = cache.k.data_ptr()
    cache.truncate([2, 3])
    assert cache.lengths.tolist() == [2, 3]
    assert cache.k.data_ptr() == ptr and torch.equal(cache.k, before)  # nothing moved
    cache.truncate(torch.tensor([1]), slots=[0])
    cache.truncate([9], slots=[1])  # growing is refused silently: lengths only shrink
    assert cache.lengths.tolist() == [1, 3]
    append(cache, torch.tensor([[20], [30]]))
    assert stored(cache, 0) == [1, 20] and stored(cache, 1) == [5, 6, 7, 30]
    with pytest.raises(InputError):
        cache.truncate([1, 2, 3])


def test_keep_step_prefix_rolls_back_relative_to_the_last_step() -> None:
    cache = KVCache(CFG, 2, 16)
    append(cache, torch.tensor([[1, 2, 3], [4, 5, 0]]), num_new=[3, 2])
    append(cache, torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]]))  # last token + 3 drafts
    cache.keep_step_prefix([2, 1])  # 1 and 0 drafts accepted
    assert stored(cache, 0) == [1, 2, 3, 10, 11] and stored(cache, 1) == [4, 5, 20]
    assert cache.length_bound([0, 1]) == 5
    append(cache, torch.tensor([[30, 31], [40, 41]]))
    cache.keep_step_prefix(torch.tensor([1]), slots=[1])
    assert stored(cache, 0) == [1, 2, 3, 10, 11, 30, 31] and stored(cache, 1) == [4, 5, 20, 40]


def test_slots_can_be_added_and_removed() -> None:
    cache = KVCache(CFG, 3, 8)
    assert [cache.add_sequence() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(InputError, match="full"):
        cache.add_sequence()
    append(cache, torch.tensor([[1], [2], [3]]))
    cache.remove_sequence(1)
    assert cache.active_slots == [0, 2]
    assert cache.add_sequence() == 1
    assert cache.lengths.tolist() == [1, 0, 1]
    append(cache, torch.tensor([[9]]), slots=[1])
    assert stored(cache, 1) == [9]
    with pytest.raises(InputError):
        cache.remove_sequence(5)
    with pytest.raises(InputError, match="distinct"):
        append(cache, torch.tensor([[1], [2]]), slots=[0, 0])
    cache.reset()
    assert cache.active_slots == [] and cache.lengths.tolist() == [0, 0, 0]


def test_overflow_is_detected_without_false_alarms() -> None:
    cache = KVCache(CFG, 1, 6)
    append(cache, torch.tensor([[1, 2, 3, 4, 5]]))
    with pytest.raises(InputError, match="overflow"):
        append(cache, torch.tensor([[6, 7]]))
    # A device-tensor rollback leaves the host bound stale; the cache must check the truth.
    cache.truncate(torch.tensor([1]))
    append(cache, torch.tensor([[6, 7, 8, 9, 10]]))
    assert stored(cache, 0) == [1, 6, 7, 8, 9, 10]


def test_host_bounds_follow_host_lengths_and_sync() -> None:
    cache = KVCache(CFG, 2, 32)
    append(cache, torch.ones(2, 8, dtype=torch.int64))
    cache.truncate(torch.tensor([3, 5]))
    assert cache.length_bound([0, 1]) == 8  # an overestimate, never an underestimate
    cache.sync_bounds()
    assert cache.length_bound([0]) == 3 and cache.length_bound([0, 1]) == 5
    cache.truncate([2, 2])
    assert cache.length_bound([0, 1]) == 2


def test_compact_moves_the_accepted_path_into_place() -> None:
    cache = KVCache(CFG, 2, 16)
    append(cache, torch.tensor([[1, 2, 0], [11, 12, 13]]), num_new=[2, 3])
    # Tree step: node 0 = last committed token, then draft nodes.
    append(cache, torch.tensor([[50, 51, 52, 53, 54], [60, 61, 62, 63, 64]]), num_new=[5, 4])
    cache.compact([0, 1], torch.tensor([[0, 2, 4], [0, 3, 3]]), num_keep=[3, 2])
    assert cache.lengths.tolist() == [5, 5]
    assert stored(cache, 0) == [1, 2, 50, 52, 54]
    assert stored(cache, 1) == [11, 12, 13, 60, 63]
    assert stored(cache, 1, layer=1) == [111, 112, 113, 160, 163]
    assert int(cache.v[2, 0, 1, 3, 5]) == -252
    # The one-slot form, with the default num_keep.
    append(cache, torch.tensor([[70, 71, 72]]), slots=[1])
    cache.compact(1, torch.tensor([0, 2]))
    assert stored(cache, 1) == [11, 12, 13, 60, 63, 70, 72]
    assert cache.length_bound([1]) == 7


def test_next_positions() -> None:
    cache = KVCache(CFG, 3, 16)
    append(cache, torch.tensor([[1, 2, 3], [1, 0, 0], [1, 2, 0]]), num_new=[3, 1, 2])
    assert cache.next_positions(2, slots=[2, 0]).tolist() == [[2, 3], [3, 4]]
    assert cache.next_positions(1, batch_size=3).tolist() == [[3], [1], [2]]


def test_cache_built_inside_inference_mode_can_be_rolled_back_outside() -> None:
    with torch.inference_mode():
        cache = KVCache(CFG, 1, 8)
        append(cache, torch.tensor([[1, 2, 3]]))
    cache.truncate([1])
    append(cache, torch.tensor([[4]]))
    assert stored(cache, 0) == [1, 4]
