"""Correctness of the Llama-family runtime (verispec.models.transformer).

Two kinds of tests:

- against Hugging Face transformers' own Qwen2 / Llama / Mistral implementations with the same random
  weights (prefill logits, greedy generation), skipped when transformers is not installed;
- self-consistency, always run: incremental decode = full forward, one K-token verification pass =
  K single-token decodes, a ragged batch = each sequence alone, rollback then re-extend = never
  extended, a tree pass = each root-to-leaf path as a chain, compaction = having fed the path.

Models are tiny (hidden 64, 4 heads, 2 kv heads, vocab 97) with weights large enough (std 0.2) that
attention is far from uniform and the logits far from flat.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.tiny import feed_tree_by_levels
from verispec.errors import InputError, ModelLoadError, UnsupportedModelError
from verispec.models.config import ModelConfig, RopeScaling
from verispec.models.transformer import Transformer, random_state_dict, tree_attention_mask

V = 97
STD = 0.2
FP32_HF_TOL = 1e-4  # max abs logit difference allowed against transformers in fp32
# the same model computing the same thing through different kernel shapes: fp32 sums in another
# order (1.04e-5 seen on an AMD Zen 5 for logits near 1, where 1e-5 was enough on other CPUs)
SELF_TOL = 3e-5


def make_config(arch: str = "qwen2", **overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position=512,
        tie_word_embeddings=arch == "qwen2",
        attention_bias=arch == "qwen2",
    )
    base.update(overrides)
    return ModelConfig(**base)


CONFIGS = {
    "qwen2-tied": make_config("qwen2", rope_theta=1e6),
    "qwen2-untied": make_config("qwen2", tie_word_embeddings=False, num_layers=3),
    "llama3-scaled": make_config(
        "llama",
        num_layers=4,
        num_kv_heads=1,
        rope_theta=500000.0,
        max_position=512,
        rope_scaling=RopeScaling("llama3", 8.0, 16, (("high_freq_factor", 4.0), ("low_freq_factor", 1.0))),
    ),
    "llama-linear": make_config("llama", rope_scaling=RopeScaling("linear", 4.0)),
    "llama-dynamic": make_config("llama", max_position=8, rope_scaling=RopeScaling("dynamic", 2.0)),
    "qwen2-yarn": make_config("qwen2", max_position=128, rope_scaling=RopeScaling("yarn", 4.0, 32)),
    "mistral-wide-heads": make_config("llama", head_dim=32, num_layers=2),
}
HF_FAMILY = {"mistral-wide-heads": "mistral"}  # GGUF calls Mistral "llama"; transformers has a class


def build(name_or_cfg: str | ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    cfg = CONFIGS[name_or_cfg] if isinstance(name_or_cfg, str) else name_or_cfg
    return Transformer(cfg, random_state_dict(cfg, seed=seed, std=STD), dtype=dtype)


def tokens(*shape: int, seed: int = 0) -> Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- Hugging Face side


def hf_model(
    cfg: ModelConfig, state_dict: dict[str, Tensor], dtype: torch.dtype = torch.float32, family: str = ""
) -> Any:
    """transformers' implementation of ``cfg`` (class ``family``, default its architecture)
    holding ``state_dict``."""
    transformers = pytest.importorskip("transformers")
    # rope_theta + rope_scaling: the spelling transformers 4.x reads and 5.x still accepts.
    scaling: dict[str, Any] | None = None
    if cfg.rope_scaling is not None:
        scaling = dict(cfg.rope_scaling.extra)
        scaling.update(rope_type=cfg.rope_scaling.type, factor=cfg.rope_scaling.factor)
        if cfg.rope_scaling.original_max_position is not None:
            scaling["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_theta=cfg.rope_theta,
        rope_scaling=scaling,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    family = family or cfg.architecture
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=False, **common))
    result = model.load_state_dict(state_dict, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    return model.to(dtype).eval()


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the runtime: one prefill, then one token per step."""
    cache = model.new_cache(1, len(prompt) + n)
    logits = model(torch.tensor([prompt]), None, cache, logits_at=torch.tensor([[len(prompt) - 1]]))
    out: list[int] = []
    for _ in range(n):
        nxt = logits[0, -1].argmax()
        out.append(int(nxt))
        if len(out) == n:
            break
        logits = model(nxt.view(1, 1), None, cache)
    return out


@pytest.mark.parametrize("shape", [(2, 40), (1, 12)], ids=["gemm", "skinny"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_transformers(name: str, shape: tuple[int, int]) -> None:
    # (2, 40): 80 rows, the F.linear path; (1, 12): the weight @ x.T path of short passes.
    # 40 tokens exceed max_position of the dynamic config. A fresh HF model per case: its
    # dynamic RoPE keeps state between calls, ours does not.
    cfg = CONFIGS[name]
    sd = random_state_dict(cfg, seed=1, std=STD)
    hf = hf_model(cfg, sd, family=HF_FAMILY.get(name, ""))
    ours = Transformer(cfg, sd)
    toks = tokens(*shape, seed=2)
    with torch.no_grad():
        ref = hf(toks).logits.float()
    got = ours(toks, None, ours.new_cache(shape[0], 64))
    assert got.dtype == torch.float32 and got.shape == (*shape, V)
    assert ref.abs().max() > 1.0  # the test is not comparing two near-zero tensors
    diff = (got - ref).abs().max().item()
    assert diff < FP32_HF_TOL, f"{name}: max abs diff {diff:.3g} vs transformers"


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen2-untied", "llama3-scaled", "mistral-wide-heads"])
def test_greedy_generation_matches_transformers(name: str) -> None:
    cfg = CONFIGS[name]
    sd = random_state_dict(cfg, seed=3, std=STD)
    hf = hf_model(cfg, sd, family=HF_FAMILY.get(name, ""))
    ours = Transformer(cfg, sd)
    prompt = tokens(1, 9, seed=4)[0].tolist()
    n = 30
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
    assert greedy(ours, prompt, n) == ref


def test_bf16_matches_transformers_bf16() -> None:
    cfg = CONFIGS["qwen2-untied"]
    sd = random_state_dict(cfg, seed=5, std=STD)
    hf = hf_model(cfg, sd, torch.bfloat16)
    ours = Transformer(cfg, sd, dtype=torch.bfloat16)
    toks = tokens(1, 24, seed=6)
    with torch.no_grad():
        ref = hf(toks).logits.float()
    got = ours(toks, None, ours.new_cache(1, 32))
    assert got.dtype == torch.float32
    # Same bf16 arithmetic up to kernel order: a few bf16 ulps of logits of size ~10.
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()


# ------------------------------------------------------------------------------ self-consistency


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3-scaled"])
def test_incremental_decode_equals_full_forward(name: str) -> None:
    model = build(name)
    toks = tokens(1, 20, seed=7)
    full = model(toks, None, model.new_cache(1, 20))
    cache = model.new_cache(1, 20)
    parts = [model(toks[:, :8], None, cache)]
    parts += [model(toks[:, i : i + 1], None, cache) for i in range(8, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=SELF_TOL, rtol=0)
    assert cache.lengths[0].item() == 20


def test_verification_pass_equals_single_token_decodes() -> None:
    model = build("qwen2-untied")
    toks = tokens(1, 16, seed=8)
    k = 5
    a, b = model.new_cache(1, 32), model.new_cache(1, 32)
    model(toks[:, :10], None, a)
    model(toks[:, :10], None, b)
    verify = model(toks[:, 10 : 10 + k + 1], None, a)  # last committed token + K draft tokens
    singles = torch.cat([model(toks[:, i : i + 1], None, b) for i in range(10, 10 + k + 1)], dim=1)
    torch.testing.assert_close(verify, singles, atol=SELF_TOL, rtol=0)
    torch.testing.assert_close(a.k[:, :, :, :16], b.k[:, :, :, :16], atol=SELF_TOL, rtol=1e-5)


def test_ragged_batch_equals_each_sequence_alone() -> None:
    model = build("llama3-scaled")
    lens = [3, 9, 6]
    prompts = [tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lens)]
    batch = torch.full((3, max(lens)), -1)
    for i, p in enumerate(prompts):
        batch[i, : len(p)] = p
    cache = model.new_cache(3, 32)
    last = torch.tensor(lens)[:, None] - 1
    got_prefill = model(batch, None, cache, num_new=lens, logits_at=last)[:, 0]  # [3, V]
    assert cache.lengths.tolist() == lens
    # A second step with a different number of new tokens per row (as in ragged verification).
    step_new = [2, 4, 1]
    step = tokens(3, 4, seed=20)
    got_step = model(step, None, cache, num_new=torch.tensor(step_new))
    for i, p in enumerate(prompts):
        alone = model.new_cache(1, 32)
        ref_prefill = model(p[None], None, alone)[0, -1]
        ref_step = model(step[i : i + 1, : step_new[i]], None, alone)[0]
        torch.testing.assert_close(got_prefill[i], ref_prefill, atol=SELF_TOL, rtol=0)
        torch.testing.assert_close(got_step[i, : step_new[i]], ref_step, atol=SELF_TOL, rtol=0)
        assert cache.lengths[i].item() == lens[i] + step_new[i]


def test_noncontiguous_slots_equal_each_sequence_alone() -> None:
    model = build("qwen2-tied")
    cache = model.new_cache(4, 32)
    slots = [cache.add_sequence() for _ in range(4)]
    cache.remove_sequence(slots[1])
    running = [3, 0]  # non-contiguous, out of order
    toks = tokens(2, 7, seed=30)
    got = model(toks, None, cache, slots=running)
    nxt = model(tokens(2, 1, seed=31), None, cache, slots=running)
    for row, _slot in enumerate(running):
        alone = model.new_cache(1, 32)
        torch.testing.assert_close(got[row], model(toks[row : row + 1], None, alone)[0], atol=SELF_TOL, rtol=0)
        ref_next = model(tokens(2, 1, seed=31)[row : row + 1], None, alone)[0]
        torch.testing.assert_close(nxt[row], ref_next, atol=SELF_TOL, rtol=0)
    assert cache.lengths.tolist() == [8, 0, 0, 8]


@pytest.mark.parametrize("host_lengths", [True, False])
def test_rollback_then_extend_equals_never_extended(host_lengths: bool) -> None:
    model = build("qwen2-untied")
    prompt, draft, fresh = tokens(1, 12, seed=40), tokens(1, 5, seed=41), tokens(1, 4, seed=42)
    cache = model.new_cache(1, 32)
    model(prompt, None, cache)
    model(draft, None, cache)  # verify 5 tokens, keep 2 of them
    cache.truncate([14] if host_lengths else torch.tensor([14]))
    got = model(fresh, None, cache)
    ref_cache = model.new_cache(1, 32)
    model(torch.cat([prompt, draft[:, :2]], dim=1), None, ref_cache)
    ref = model(fresh, None, ref_cache)
    torch.testing.assert_close(got, ref, atol=SELF_TOL, rtol=0)
    torch.testing.assert_close(cache.k[:, :, :, :18], ref_cache.k[:, :, :, :18], atol=SELF_TOL, rtol=1e-5)


def _trees() -> tuple[Tensor, list[list[int]]]:
    # Node 0 is the last committed token; the others are draft nodes (parents precede children).
    parents = torch.tensor(
        [
            [-1, 0, 0, 1, 1, 2, 3, 0],  # depth up to 3, a leaf at every level
            [-1, 0, 1, 2, 0, 4, -9, -9],  # two chains of length 3 and 2; last two are padding
        ]
    )
    paths = [[[0, 1, 3, 6], [0, 1, 4], [0, 2, 5], [0, 7]], [[0, 1, 2, 3], [0, 4, 5]]]
    return parents, paths  # type: ignore[return-value]


def test_tree_attention_mask_ancestors() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    mask = tree_attention_mask(parents)[0]
    expected = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    assert mask.int().tolist() == expected
    with pytest.raises(InputError):
        tree_attention_mask(torch.tensor([[-1, 2, 0]]))


def test_tree_pass_equals_each_path_as_a_chain() -> None:
    model = build("llama3-scaled")
    parents, paths = _trees()
    num_new = [8, 6]
    parents = torch.where(torch.arange(8)[None] < torch.tensor(num_new)[:, None], parents, -1)
    mask = tree_attention_mask(parents)  # [2, 8, 8]
    depth = mask.sum(-1) - 1  # [2, 8]
    prompts = [tokens(1, 5, seed=50), tokens(1, 11, seed=51)]
    nodes = tokens(2, 8, seed=52)
    cache = model.new_cache(2, 32)
    batch = torch.zeros(2, 11, dtype=torch.int64)
    batch[0, :5], batch[1] = prompts[0][0], prompts[1][0]
    model(batch, None, cache, num_new=[5, 11])
    positions = cache.lengths[:, None] + depth
    got = model(nodes, positions, cache, mask, num_new=num_new)  # [2, 8, V]
    for b in range(2):
        for path in paths[b]:
            chain_cache = model.new_cache(1, 32)
            model(prompts[b], None, chain_cache)
            ref = model(nodes[b : b + 1, path], None, chain_cache)[0]
            torch.testing.assert_close(got[b, path], ref, atol=SELF_TOL, rtol=0)


def test_a_tree_fed_level_by_level_equals_the_tree_in_one_pass() -> None:
    """A window mask over the tree's cached earlier levels (how a tree drafter grows a tree)
    gives each node the logits of its path, as one tree pass does."""
    model = build("llama3-scaled")
    parents = [-1, -1, 0, 0, 1, 2, 2, 4, 5]
    nodes = tokens(1, 9, seed=60)[0].tolist()
    prompt = tokens(1, 7, seed=61)[0].tolist()
    levels = feed_tree_by_levels(model, parents, nodes, prompt)
    cache = model.new_cache(1, 32)
    model(torch.tensor([prompt]), None, cache)
    mask = tree_attention_mask(torch.tensor([parents]))
    one_pass = model(torch.tensor([nodes]), cache.lengths[:, None] + mask.sum(-1) - 1, cache, mask)[0]
    torch.testing.assert_close(levels, one_pass, atol=SELF_TOL, rtol=0)


def test_a_window_mask_of_a_ragged_batch_equals_the_rows_alone() -> None:
    """Rows with different numbers of cached tree nodes share one window: the columns before a
    row's own tree are its committed tokens, seen by every query."""
    model = build("qwen2-tied")
    prompts = [tokens(1, 6, seed=70)[0].tolist(), tokens(1, 9, seed=71)[0].tolist()]
    cache = model.new_cache(2, 32)
    model(torch.tensor([prompts[0] + [0] * 3, prompts[1]]), None, cache, num_new=[6, 9])
    # row 0: two level-1 nodes cached, then one child of the second; row 1: one node cached, then two children of it
    siblings = torch.eye(2, dtype=torch.bool).expand(2, 2, 2)  # level 1: each node sees only itself
    model(torch.tensor([[5, 6], [7, 0]]), torch.tensor([[6, 6], [9, 0]]), cache, siblings, num_new=[2, 1])
    window = torch.zeros((2, 2, 4), dtype=torch.bool)  # [B, T, W = 2 cached columns + 2 new]
    window[0, 0, 1] = True  # node 8 sees node 6 (its own column is added)
    window[1, :, :2] = True  # nodes 9 and 10 see a committed token (column 0) and node 7
    got = model(torch.tensor([[8, 0], [9, 10]]), torch.tensor([[7, 0], [10, 10]]), cache, window, num_new=[1, 2])
    alone0 = feed_tree_by_levels(model, [-1, -1, 1], [5, 6, 8], prompts[0])
    alone1 = feed_tree_by_levels(model, [-1, 0, 0], [7, 9, 10], prompts[1])
    torch.testing.assert_close(got[0, :1], alone0[2:], atol=SELF_TOL, rtol=0)
    torch.testing.assert_close(got[1], alone1[1:], atol=SELF_TOL, rtol=0)


def test_compact_accepted_path_equals_feeding_the_path() -> None:
    model = build("qwen2-tied")
    parents, paths = _trees()
    parents = parents.clamp(min=-1)
    parents[1, 6:] = -1
    mask = tree_attention_mask(parents)
    prompts = tokens(2, 6, seed=60)
    nodes = tokens(2, 8, seed=61)
    cache = model.new_cache(2, 32)
    model(prompts, None, cache)
    model(nodes, cache.lengths[:, None] + mask.sum(-1) - 1, cache, mask, num_new=[8, 6])
    accepted = [paths[0][0], paths[1][1]]  # [0, 1, 3, 6] and [0, 4, 5]
    keep = torch.tensor([accepted[0], [*accepted[1], 0]])
    cache.compact([0, 1], keep, num_keep=[4, 3])
    assert cache.lengths.tolist() == [10, 9]
    nxt = tokens(2, 1, seed=62)
    got = model(nxt, None, cache)
    for b in range(2):
        ref_cache = model.new_cache(1, 32)
        model(torch.cat([prompts[b], nodes[b, accepted[b]]])[None], None, ref_cache)
        ref = model(nxt[b : b + 1], None, ref_cache)[0]
        torch.testing.assert_close(got[b], ref, atol=SELF_TOL, rtol=0)


def test_padding_never_pollutes_the_cache() -> None:
    model = build("qwen2-untied")
    cache = model.new_cache(2, 12)
    model(tokens(2, 6, seed=70), None, cache, num_new=[6, 2])
    before_k, before_v = cache.k[:, :, :, :12].clone(), cache.v[:, :, :, :12].clone()
    # Row 1 fills its cache exactly to max_len; its padding must not overflow or overwrite anything.
    model(tokens(2, 10, seed=71), None, cache, num_new=torch.tensor([0, 10]))
    assert cache.lengths.tolist() == [6, 12]
    torch.testing.assert_close(cache.k[:, 0, :, :12], before_k[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(cache.v[:, 1, :, :2], before_v[:, 1, :, :2], atol=0, rtol=0)
    out = model(tokens(2, 3, seed=72), None, cache, num_new=[3, 0])
    assert torch.isfinite(out).all()
    # A row with nothing cached and nothing new (an idle slot in a batch) still gives finite logits.
    empty = model.new_cache(2, 8)
    assert torch.isfinite(model(tokens(2, 3, seed=73), None, empty, num_new=[3, 0])).all()
    assert empty.lengths.tolist() == [3, 0]


def test_every_query_row_of_the_mask_attends_somewhere() -> None:
    # Some SDPA backends turn a fully masked row into NaN; padding queries must not be one.
    from verispec.models.transformer import _additive_mask, _visibility

    cache = build("qwen2-tied").new_cache(3, 8)
    plan = cache.begin_step(None, 3, 3, [3, 0, 1])
    visible = _visibility(plan, 3, None)  # [3, 3, span]
    assert visible.any(dim=-1).all()  # the row kernel's form: every query sees something too
    mask = _additive_mask(visible, 2, torch.float32)  # [3, 1, 6, span]
    assert torch.isfinite(mask).any(dim=-1).all()
    real = torch.isfinite(mask[:, 0, :3])  # group 0, queries t = 0..2
    assert real[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert real[2, 0].tolist() == [True, False, False]


def test_the_causal_mask_without_padding_is_the_general_one() -> None:
    """A step whose rows are all full (no padding, no window) builds its mask in a shorter way:
    the same mask as the general construction, which a device tensor of counts still takes."""
    from verispec.models.transformer import _visibility

    for t in (1, 3):
        caches = [build("qwen2-tied").new_cache(3, 16) for _ in range(2)]
        for cache in caches:  # rows of 4, 1 and 2 cached tokens
            cache.end_step(cache.begin_step(None, 4, 3, [4, 1, 2]))
        short = caches[0].begin_step(None, t, 3, [t] * 3)
        general = caches[1].begin_step(None, t, 3, torch.full((3,), t))
        assert short.valid is None and general.valid is not None
        assert torch.equal(_visibility(short, t, None), _visibility(general, t, None))


def test_logits_at_and_hidden_states() -> None:
    model = build("qwen2-tied")
    toks = tokens(2, 9, seed=80)
    full = model.forward_with_hidden(toks, None, model.new_cache(2, 16))
    at = torch.tensor([[8], [3]])
    some = model.forward_with_hidden(toks, None, model.new_cache(2, 16), logits_at=at)
    assert some.logits.shape == (2, 1, V) and full.hidden.shape == (2, 9, 64)
    torch.testing.assert_close(some.logits[:, 0], full.logits[[0, 1], [8, 3]], atol=SELF_TOL, rtol=0)
    torch.testing.assert_close(some.hidden, full.hidden)
    nowhere = torch.empty((2, 0), dtype=torch.long)
    none = model.forward_with_hidden(toks, None, model.new_cache(2, 16), logits_at=nowhere)
    assert none.logits.shape == (2, 0, V)  # hidden states only: no LM head
    torch.testing.assert_close(none.hidden, full.hidden)
    lm = model.lm_weight
    torch.testing.assert_close(full.hidden @ lm.T, full.logits, atol=SELF_TOL, rtol=0)


def test_bf16_runs_close_to_fp32_and_returns_fp32() -> None:
    cfg = CONFIGS["llama3-scaled"]
    sd = random_state_dict(cfg, seed=90, std=STD)
    ref = Transformer(cfg, sd)
    low = Transformer(cfg, sd, dtype=torch.bfloat16)
    assert low.lm_weight.dtype == torch.bfloat16
    cache = low.new_cache(1, 16)
    assert cache.k.dtype == torch.bfloat16
    toks = tokens(1, 12, seed=91)
    a = ref(toks, None, ref.new_cache(1, 16))
    b = low(toks, None, cache)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.7


def test_moving_after_construction_equals_constructing_in_place() -> None:
    cfg = CONFIGS["llama3-scaled"]
    sd = random_state_dict(cfg, seed=92, std=STD)
    moved = Transformer(cfg, sd).to(torch.bfloat16)
    built = Transformer(cfg, sd, dtype=torch.bfloat16)
    assert moved.dtype == torch.bfloat16 and moved.new_cache(1, 4).k.dtype == torch.bfloat16
    toks = tokens(1, 10, seed=93)
    a = moved(toks, None, moved.new_cache(1, 10))
    b = built(toks, None, built.new_cache(1, 10))
    assert torch.equal(a, b)


def test_matching_weights_are_used_without_a_copy() -> None:
    cfg = CONFIGS["qwen2-untied"]
    sd = random_state_dict(cfg, seed=0)
    model = Transformer(cfg, sd)
    assert model.lm_weight.data_ptr() == sd["lm_head.weight"].data_ptr()
    assert not any(p.requires_grad for p in model.parameters())


def test_state_dict_mismatches_raise_model_load_error() -> None:
    cfg = CONFIGS["qwen2-untied"]
    sd = random_state_dict(cfg, seed=0)
    del sd["model.layers.1.self_attn.q_proj.bias"]
    with pytest.raises(ModelLoadError, match="missing"):
        Transformer(cfg, sd)
    sd = random_state_dict(cfg, seed=0)
    sd["model.norm.weight"] = torch.ones(63)
    with pytest.raises(ModelLoadError, match="shape"):
        Transformer(cfg, sd)
    tied = random_state_dict(CONFIGS["qwen2-tied"], seed=0)
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"]  # tolerated for tied checkpoints
    Transformer(CONFIGS["qwen2-tied"], tied)


def test_rope_frequency_factors_reproduce_llama3_scaling() -> None:
    # GGUF files of Llama 3.1 carry per-frequency divisors instead of a "llama3" block: with the
    # divisors llama.cpp's converter computes, the plain-RoPE model must equal the scaled one.
    scaled_cfg = CONFIGS["llama3-scaled"]
    plain_cfg = replace(scaled_cfg, rope_scaling=None)
    sd = random_state_dict(scaled_cfg, seed=95, std=STD)
    scaled = Transformer(scaled_cfg, sd)
    plain_rope = Transformer(plain_cfg, sd).rope.inv_freq
    factors = plain_rope / scaled.rope.inv_freq  # [D/2], what convert_hf_to_gguf.py stores
    assert factors.max() > 7.9 and factors.min() < 2.0  # long and medium wavelengths both present
    with_freqs = Transformer(plain_cfg, {**sd, "model.rope_freqs": factors})
    toks = tokens(1, 30, seed=96)
    a = scaled(toks, None, scaled.new_cache(1, 30))
    b = with_freqs(toks, None, with_freqs.new_cache(1, 30))
    torch.testing.assert_close(a, b, atol=SELF_TOL, rtol=0)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        Transformer(plain_cfg, {**sd, "model.rope_freqs": factors[:3]})


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3-scaled", "llama-linear", "qwen2-yarn", "mistral-wide-heads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_rope_table_holds_what_cos_sin_gives_each_position(name: str, dtype: torch.dtype) -> None:
    """``RotaryEmbedding.table`` (the kernels' native passes look RoPE up there) has, bit for bit,
    the values ``cos_sin`` computes for each position in any step's shape: one of 40,000
    positions (two threads split it), then grown."""
    rope = build(name).rope
    cos, sin = rope.table(40_000, dtype)  # [P, D] each
    assert cos.shape[0] >= 40_000 and cos.shape == sin.shape and cos.dtype == dtype
    gen = torch.Generator().manual_seed(7)
    for b, t in [(1, 1), (1, 5), (3, 7), (2, 33), (4, 300)]:
        positions = torch.randint(0, 40_000 - t, (b, 1), generator=gen) + torch.arange(t)[None, :]  # [B, T]
        step_cos, step_sin = rope.cos_sin(positions, dtype)  # [B, T, 1, D] each
        assert torch.equal(step_cos[:, :, 0], cos[positions]) and torch.equal(step_sin[:, :, 0], sin[positions])
    grown, _ = rope.table(90_000, dtype)
    assert grown.shape[0] >= 90_000 and torch.equal(grown[: cos.shape[0]], cos)
    assert rope.table(10, dtype)[0] is grown  # (kept)


def test_dynamic_rope_has_no_table() -> None:
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        build("llama-dynamic").rope.table(16, torch.float32)


def test_unsupported_rope_scaling_is_a_typed_error() -> None:
    cfg = replace(CONFIGS["qwen2-tied"], rope_scaling=RopeScaling("longrope", 2.0))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        build(cfg)


def test_bad_inputs_raise_input_error() -> None:
    model = build("qwen2-tied")
    cache = model.new_cache(1, 8)
    with pytest.raises(InputError):
        model(tokens(4), None, cache)
    with pytest.raises(InputError):
        model(tokens(1, 3), torch.zeros(1, 2, dtype=torch.int64), cache)
    with pytest.raises(InputError):
        model(tokens(1, 3), None, cache, torch.ones(1, 3, 3))
    with pytest.raises(InputError, match="overflow"):
        model(tokens(1, 9), None, cache)
