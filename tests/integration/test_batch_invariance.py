"""Batch invariance on verispec's CPU kernels: in bf16 and int8, a verification pass over K + 1
tokens computes each token's logits exactly as the one-token decode step would, so greedy
speculative output equals greedy plain output token for token (not only in fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.kernels import require_kernels
from tests.tiny import feed_tree_by_levels
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.base import BatchView
from verispec.drafters.model import restricted_head
from verispec.drafters.registry import make_drafter
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.errors import InputError
from verispec.formats import packing
from verispec.kernels.linear import native_projection
from verispec.models.config import ModelConfig
from verispec.models.transformer import (
    PREFILL_MIN_TOKENS,
    DraftSampling,
    Transformer,
    random_state_dict,
    tree_attention_mask,
)
from verispec.verify.base import Draft

VOCAB = 96
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [5] * 12, [10, 20, 30, 40, 10, 20, 30]]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> object:
    return require_kernels()


def config() -> ModelConfig:
    """Small, but with the shapes the kernels take: head size 32, inputs multiples of 32."""
    return ModelConfig(
        architecture="qwen2", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, max_position=512,
        tie_word_embeddings=True, attention_bias=True, eos_token_id=None, name="tiny-wide",
    )  # fmt: skip


def model(precision: str, seed: int = 0, noise: float = 0.0, kernels: bool = True) -> Transformer:
    """A random model in "bf16", "int8", "mixed" or "int4-all" (``noise``: a perturbed copy, for a draft)."""
    sd = random_state_dict(config(), seed=0, std=0.08)
    if noise:
        gen = torch.Generator().manual_seed(seed)
        sd = {
            k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.numel() > 1 else v for k, v in sd.items()
        }
    if precision in ("int8", "mixed", "int4-all"):  # int4-all: Q4_K with the 128-input rows padded to 256
        kind = "int4-all" if precision == "int4-all" else "int8"
        packed = packing.pack(packing.WeightSource(state_dict=sd), config(), kind)
        if precision == "mixed":  # v and up stay bf16, like a Q4_K_M file's Q6_K tensors: nothing fuses
            packed = {k: v for k, v in packed.items() if ".v_proj." not in k and ".up_proj." not in k}
        sd = packing.merge(sd, packed)
    return Transformer(config(), sd, dtype=torch.bfloat16, cpu_kernels=kernels)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4-all"])
def test_a_verification_pass_equals_its_decode_steps(precision: str) -> None:
    m = model(precision)
    assert m.cpu_kernels
    prompt, block = torch.tensor([PROMPTS[0]]), torch.tensor([[11, 12, 13, 14, 15]])
    wide = m.new_cache(1, 64)
    m(prompt, None, wide)
    verify = m(block, None, wide)[0]  # [5, V]
    steps = m.new_cache(1, 64)
    m(prompt, None, steps)
    decode = torch.cat([m(block[:, i : i + 1], None, steps)[0] for i in range(block.shape[1])])
    assert torch.equal(verify, decode)


def test_rows_of_a_ragged_batch_equal_the_rows_alone() -> None:
    m = model("bf16")
    batch = m.new_cache(2, 64)
    m(torch.tensor([PROMPTS[0], PROMPTS[3] + [0]]), None, batch, num_new=[8, 7])
    new = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    together = m(new, None, batch, num_new=[4, 2])  # [2, 4, V]
    for row, (prompt, count) in enumerate(((PROMPTS[0], 4), (PROMPTS[3], 2))):
        alone = m.new_cache(1, 64)
        m(torch.tensor([prompt]), None, alone)
        assert torch.equal(m(new[row : row + 1, :count], None, alone)[0], together[row, :count]), row


def test_the_kernels_compute_what_torch_computes() -> None:
    """Same model, torch's kernels (SDPA, matmul) vs verispec's: equal up to bf16 rounding."""
    ids = torch.tensor([PROMPTS[1] + PROMPTS[0]])
    ours, theirs = model("bf16"), model("bf16", kernels=False)
    a = ours(ids, None, ours.new_cache(1, 64))
    b = theirs(ids, None, theirs.new_cache(1, 64))
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize(("drafter", "k"), [("model", 4), ("model", None), ("ngram", 4), ("composite", None)])
def test_greedy_speculation_equals_greedy_plain(precision: str, drafter: str, k: int | None) -> None:
    target, draft = model(precision), model("int8", seed=1, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=24)

    def run(name: str, k: int | None) -> list[list[int]]:
        d = make_drafter(name, draft_model=draft, vocab_size=VOCAB, max_batch=4, max_len=128)
        e = Engine(target, None, d, EngineConfig(max_batch=4, max_len=128, num_draft_tokens=k))
        return [o.token_ids for o in e.generate(PROMPTS, params)]

    plain = run("none", 0)
    assert run(drafter, k) == plain


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("children", ["fixed", "sampled", "distinct"])
def test_greedy_tree_speculation_equals_greedy_plain(precision: str, children: str) -> None:
    """Every tree node's logits are those of its path decoded alone, bit for bit (the kernels'
    attention sums the visible keys in order, wherever the tree put them in the buffer)."""
    target, draft = model(precision), model("int8", seed=1, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=24)
    d = make_drafter(
        "tree", draft_model=draft, vocab_size=VOCAB, max_batch=4, max_len=128, tree=TreeShape(4, 2, 2, 12),
        tree_children=children, draft_head=64,
    )  # fmt: skip
    e = Engine(target, None, d, EngineConfig(max_batch=4, max_len=128, num_draft_tokens=4, max_draft_tokens=12))
    plain = Engine(target, None, None, EngineConfig(max_batch=4, max_len=128, num_draft_tokens=0))
    assert [o.token_ids for o in e.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(PROMPTS, params)]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_tree_fed_level_by_level_equals_the_tree_in_one_pass_bit_for_bit(precision: str) -> None:
    """How a tree drafter grows a tree (each level after the cached earlier ones, under a window
    mask) computes every node's logits exactly as one tree pass does."""
    m = model(precision)
    parents, nodes = [-1, -1, 0, 0, 1, 2, 2, 4, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    levels = feed_tree_by_levels(m, parents, nodes, PROMPTS[0])
    cache = m.new_cache(1, 64)
    m(torch.tensor([PROMPTS[0]]), None, cache)
    mask = tree_attention_mask(torch.tensor([parents]))
    assert torch.equal(levels, m(torch.tensor([nodes]), cache.lengths[:, None] + mask.sum(-1) - 1, cache, mask)[0])


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_restricted_draft_head_on_the_kernels_scores_as_the_full_head(precision: str) -> None:
    draft = model(precision, seed=1, noise=0.3)
    d = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=4, max_len=128, draft_head=40)
    assert d._head_module is not None  # sliced from the packed head, not dequantised
    ids = torch.tensor([PROMPTS[0]])
    full = draft(ids, None, draft.new_cache(1, 64))[0, -1]  # [V]
    hidden = draft.forward_with_hidden(ids, None, draft.new_cache(1, 64)).hidden[:, -1]  # [1, C]
    assert torch.equal(d._head_module(hidden)[0].float(), full[:40])
    target = model(precision)
    params = SamplingParams(temperature=0, max_tokens=24)
    e = Engine(target, None, d, EngineConfig(max_batch=4, max_len=128, num_draft_tokens=3))
    plain = Engine(target, None, None, EngineConfig(max_batch=4, max_len=128, num_draft_tokens=0))
    assert [o.token_ids for o in e.generate(PROMPTS, params)] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert d._pool  # ids of the requests' own outside the head, scored by rows cut from the packed head too
    assert d._pool_module is not None and torch.equal(d._pool_module(hidden)[0].float(), full[list(d._pool)])


class _ConfidenceStop:
    """A draft stop that records every call and ends a row's draft below a confidence."""

    def __init__(self, below: float) -> None:
        self.below = below
        self.calls: list[tuple[int, int, float]] = []

    def keep_drafting(self, row: int, drafted: int, confidence: float) -> bool:
        self.calls.append((row, drafted, confidence))
        return confidence >= self.below


# Three requests for the drafting loops' comparisons: ids >= 40 lie outside the head of 40 ids;
# c's prompt is long enough for the prefill path. Each round's draft lengths, twice over.
LOOP_PROMPTS = {"a": PROMPTS[0], "b": [50, 61, 7, 8, 9, 70, 3], "c": (PROMPTS[3] * 15)[:PREFILL_MIN_TOKENS]}
LOOP_ROUNDS = [[5, 2, 7], [3, 0, 6], [6, 4, 1], [2, 6, 6]] * 2


def _drafting_rounds(
    draft: Transformer, native: bool, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[tuple[Draft, list[tuple[int, int, float]]]], tuple[torch.Tensor, ...], Any]:
    """The model drafter (a head of 40 ids) proposing LOOP_ROUNDS for LOOP_PROMPTS in one native
    call a proposal, or (``native`` False) in its Python loop, stopped by confidence (0.05); each
    round commits the first ``round % 3`` draft tokens and one more. Returns each round's draft and
    stop calls, the draft cache afterwards (keys, values, lengths) and the drafter."""
    d = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=4, max_len=256, draft_head=40)
    assert d._natively()
    if not native:
        d._natively = lambda: False  # type: ignore[method-assign]
    contexts = {rid: list(p) for rid, p in LOOP_PROMPTS.items()}
    for rid, context in contexts.items():
        d.begin(rid, context)
    rounds = []
    for step, ks in enumerate(LOOP_ROUNDS):
        stop = _ConfidenceStop(0.05)
        out = d.propose(BatchView(list(contexts), params, generators, stop=stop), ks)
        rounds.append((out, stop.calls))
        for row, (rid, context) in enumerate(contexts.items()):
            kept = [*out.token_ids[row, : min(step % 3, int(out.num_tokens[row]))].tolist(), step % 40]
            d.observe(rid, kept)
            context.extend(kept)
    used = int(d.cache.lengths.max())
    cache = (d.cache.k[:, :, :, :used].clone(), d.cache.v[:, :, :, :used].clone(), d.cache.lengths.clone())
    return rounds, cache, d


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4-all"])
def test_greedy_drafting_in_one_native_call_equals_the_python_loop(precision: str) -> None:
    """The model drafter's greedy drafts on the kernels (a proposal in one native call:
    ``Transformer.draft``; after a prompt long enough for the prefill path, its first pass
    in Python) are its Python loop's: the same tokens and the same stop calls for rows of
    different lengths feeding different numbers of tokens, a row drafting nothing, ids of the
    requests' own outside the head (rows b and c), a stop ending rows by their confidence; and the
    same draft cache afterwards (keys, values, lengths)."""
    draft = model(precision, seed=1, noise=0.3)
    greedy = SamplingParams(temperature=0)
    runs = [_drafting_rounds(draft, native, [greedy] * 3, [None] * 3) for native in (True, False)]
    (rounds, (k, v, lens), _), (py_rounds, (py_k, py_v, py_lens), d) = runs
    drafts, py_drafts = (
        [(o.token_ids.tolist(), o.num_tokens.tolist(), o.probs) for o, _ in r] for r in (rounds, py_rounds)
    )
    calls, py_calls = ([c for _, c in r] for r in (rounds, py_rounds))
    assert drafts == py_drafts
    assert any(
        n < max(ks) for (_, num, _), ks in zip(drafts, LOOP_ROUNDS, strict=True) for n in num
    )  # stops ended some
    assert [[(r, n) for r, n, _ in c] for c in calls] == [[(r, n) for r, n, _ in c] for c in py_calls]
    assert max(n for c in calls for _, n, _ in c) >= 4  # (passes of the native loop took part)
    confidence = torch.tensor([f for c in calls for _, _, f in c])
    torch.testing.assert_close(confidence, torch.tensor([f for c in py_calls for _, _, f in c]), rtol=1e-5, atol=0)
    assert torch.equal(lens, py_lens) and torch.equal(k, py_k) and torch.equal(v, py_v)
    assert d._pool  # (the head of the requests' own ids took part)


@pytest.mark.parametrize("precision", ["bf16", "int4-all"])
def test_sampled_drafting_in_one_native_call_matches_the_python_loop(precision: str) -> None:
    """Sampled drafts on the kernels (``Transformer.draft`` with a ``DraftSampling``: the laws by
    ``ops.sampled_pick``, one uniform of the request's generator a token) against the Python loop
    (``build_laws`` and ``sample``) with the same seeds: the same tokens, stop calls and draft
    cache, laws equal up to fp32 rounding (the same supports), each drafted token inside its law.
    Rows: temperature and top-p, a greedy row beside them (its law the point mass), top-k with
    min-p; ids of the requests' own outside the head; a first proposal after a prompt long
    enough for the prefill path (the Python loop's) and stops by confidence."""
    draft = model(precision, seed=1, noise=0.3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=7, min_p=0.02),
    ]
    sampled_calls = []  # (whether each native call sampled)
    real_draft = draft.draft
    draft.draft = lambda *a, **kw: (sampled_calls.append(kw["sampling"] is not None), real_draft(*a, **kw))[1]
    runs = []
    for native in (True, False):
        gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
        runs.append(_drafting_rounds(draft, native, params, gens))
    (rounds, (k, v, lens), _), (py_rounds, (py_k, py_v, py_lens), d) = runs
    drafts, py_drafts = ([(o.token_ids.tolist(), o.num_tokens.tolist()) for o, _ in r] for r in (rounds, py_rounds))
    laws, py_laws = ([o.probs for o, _ in r] for r in (rounds, py_rounds))
    calls, py_calls = ([c for _, c in r] for r in (rounds, py_rounds))
    assert all(law is not None for law in laws + py_laws)
    assert sampled_calls == [True] * (len(LOOP_ROUNDS) - 1)  # (every proposal but the prompt's)
    assert drafts == py_drafts
    assert [[(r, n) for r, n, _ in c] for c in calls] == [[(r, n) for r, n, _ in c] for c in py_calls]
    assert max(n for c in calls for _, n, _ in c) >= 4  # (passes of the native loop took part)
    confidence = torch.tensor([f for c in calls for _, _, f in c])
    torch.testing.assert_close(confidence, torch.tensor([f for c in py_calls for _, _, f in c]), rtol=1e-5, atol=1e-7)
    for (ids, num), law, py_law in zip(drafts, laws, py_laws, strict=True):
        for row, n in enumerate(num):
            assert torch.equal(law[row, :n] > 0, py_law[row, :n] > 0)
            torch.testing.assert_close(law[row, :n], py_law[row, :n], rtol=1e-5, atol=1e-7)
            drawn = law[row, :n].gather(1, torch.tensor(ids[row][:n])[:, None])
            assert bool((drawn > 0).all())
    assert torch.equal(lens, py_lens) and torch.equal(k, py_k) and torch.equal(v, py_v)
    assert d._pool  # (the head of the requests' own ids took part)


def test_greedy_drafting_in_one_call_refuses_what_the_cache_cannot_hold() -> None:
    draft = model("int8")
    cache = draft.new_cache(1, 16)
    slot = cache.add_sequence()
    draft(torch.tensor([PROMPTS[2]]), None, cache, slots=[slot])  # 12 of 16 positions
    d = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=1, max_len=16, draft_head=40)
    with pytest.raises(InputError, match="cannot hold 5 more"):
        draft.draft(cache, [[3, 4]], [slot], [4], d._head_native, d._head_ids)
    assert int(cache.lengths[slot]) == 12
    drafted, appended, _ = draft.draft(cache, [[3, 4]], [slot], [3], d._head_native, d._head_ids)
    assert len(drafted[0]) == 3 and appended == [4] and int(cache.lengths[slot]) == 16


def test_sampled_drafting_in_one_call_refuses_bad_uniforms_and_rules() -> None:
    """``draw`` must give one uniform in [0, 1) for each row it is asked about, and the rules must
    be in range; a sampled call with a second head needs the merged order."""
    draft = model("bf16")
    d = make_drafter("model", draft_model=draft, vocab_size=VOCAB, max_batch=1, max_len=64, draft_head=40)
    cache = draft.new_cache(1, 64)
    slot = cache.add_sequence()
    rules = torch.tensor([[0.8, 0, 0.9, 0.0]], dtype=torch.float64)
    heads = (d._head_native, d._head_ids)
    for draw, message in ((lambda i, r: [1.0], r"uniforms in \[0, 1\)"), (lambda i, r: [0.5, 0.5], "one uniform")):
        with pytest.raises(RuntimeError, match=message):
            draft.draft(cache, [[3, 4]], [slot], [3], *heads, sampling=DraftSampling(rules, None, draw))
    bad = torch.tensor([[0.8, 0, 1.5, 0.0]], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="out of range"):
        draft.draft(cache, [[3]], [slot], [2], *heads, sampling=DraftSampling(bad, None, lambda i, r: [0.5]))
    more_ids = torch.tensor([50, 60])
    more = native_projection(restricted_head(draft, more_ids))
    with pytest.raises(RuntimeError, match="merged order"):
        sampling = DraftSampling(rules, None, lambda i, r: [0.5])
        draft.draft(cache, [[3]], [slot], [2], *heads, more=more, more_ids=more_ids, sampling=sampling)
    sampling = DraftSampling(rules, None, lambda i, r: [0.5] * len(r))
    drafted, _, laws = draft.draft(cache, [[3]], [slot], [2], *heads, sampling=sampling)
    assert laws is not None and laws.shape == (1, 2, 40) and len(drafted[0]) == 2
    torch.testing.assert_close(laws.sum(dim=-1), torch.ones(1, 2))


@pytest.mark.parametrize("precision", ["bf16", "int8", "mixed"])
def test_the_one_call_layer_loop_equals_the_python_loop(precision: str) -> None:
    """``Layers.forward`` (every decoder layer in one kernel call) computes the logits and the KV
    cache of the Python layer loop bit for bit: a batch of two, slots out of order, and a pass
    after a prefill (keys and values written where the loop writes them)."""
    m = model(precision)
    assert m._native_layers is not None
    attn = m.model.layers[0].self_attn
    assert (getattr(attn, "qkv_proj", None) is None) == (precision == "mixed")
    native_loop = m._native_layers
    results = []
    for native in (True, False):
        m._native_layers = native_loop if native else None
        cache = m.new_cache(3, 64)
        slots = [cache.add_sequence() for _ in range(3)][::-2]  # rows 2 and 0
        first = m(torch.tensor([PROMPTS[0][:5], PROMPTS[2][:5]]), None, cache, slots=slots)
        second = m(torch.tensor([[11, 12, 13], [14, 15, 16]]), None, cache, slots=slots)
        results.append((first, second, cache.k.clone(), cache.v.clone()))
    m._native_layers = native_loop
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


class _Spy:
    """Stands in for a model's native ``Layers`` and counts its ``chain`` calls."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.chains = inner, 0

    def chain(self, *args: Any) -> Any:
        self.chains += 1
        return self.inner.chain(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _general_path(m: Transformer, general: bool) -> None:
    """Send ``m``'s passes down the general path (the one-call pass declines), or let them take it."""
    if general:
        m._chain_natively = lambda *args: None  # type: ignore[method-assign]
    else:
        vars(m).pop("_chain_natively", None)


def _tree_step(num_new: list[int], t: int, gen: torch.Generator, cache: Any, slots: list[int]) -> tuple[Any, Any]:
    """A random tree of ``num_new[b]`` nodes in each row (padding after): its mask ``[B, T, T]``
    and its positions (length + depth), as the engine's tree verification builds them."""
    parents = torch.full((len(num_new), t), -1, dtype=torch.long)
    for b, n in enumerate(num_new):
        for q in range(1, n):
            parents[b, q] = int(torch.randint(0, q, (1,), generator=gen))
    mask = tree_attention_mask(parents)  # [B, T, T]
    lengths = cache.lengths.index_select(0, torch.tensor(slots))
    return mask, lengths[:, None] + mask.sum(dim=2) - 1


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4-all", "mixed"])
def test_a_pass_in_one_native_call_equals_the_general_pass(precision: str) -> None:
    """A pass in one call (``Layers.chain``: the embedding, every layer and the LM head, RoPE from
    its table; chains, and trees verified in one pass) computes what the general path computes for
    the same pass (the step planned in Python and torch): the same real rows' logits and hidden
    states bit for bit, at every offset or at ``logits_at``; the same keys and values, lengths, step
    starts and host bounds; for three rows of a batch in slots out of order, ragged (one row with
    nothing new), over chains and trees of 1 to 5 tokens; then a rollback to a step's prefix
    behaves alike on both."""
    m = model(precision)
    m._native_layers = spy = _Spy(m._native_layers)
    gen = torch.Generator().manual_seed(3)
    caches = [m.new_cache(4, 96) for _ in range(2)]
    for cache in caches:
        for _ in range(4):
            cache.add_sequence()
    slots = [3, 0, 2]
    for native, cache in zip((True, False), caches, strict=True):
        _general_path(m, not native)
        m(torch.tensor([PROMPTS[0] + [1], PROMPTS[3] + [0, 0], PROMPTS[2][:9]]), None, cache, slots=slots,
          num_new=[9, 7, 9])  # fmt: skip
    assert spy.chains == 1
    for step in range(12):
        t = 1 + step % 5
        new = torch.randint(0, VOCAB, (3, t), generator=gen)
        num_new = [t, max(1, t - 1), max(0, t - 3)]
        at = None if step % 2 == 0 else torch.randint(0, t, (3, 2), generator=gen)
        tree = step >= 6
        if tree:
            mask, positions = _tree_step(num_new, t, gen, caches[0], slots)
        outs = []
        for native, cache in zip((True, False), caches, strict=True):
            _general_path(m, not native)
            extra: dict[str, Any] = {"attn_mask": mask} if tree else {}
            outs.append(m.forward_with_hidden(new, positions if tree else None, cache, slots=slots, num_new=num_new,
                                              logits_at=at, **extra))  # fmt: skip
        _general_path(m, False)
        real = torch.tensor([[q < n for q in range(t)] for n in num_new])  # [3, T]
        seen = real if at is None else real.gather(1, at)  # rows whose logits are real
        assert torch.equal(outs[0].hidden[real], outs[1].hidden[real]), step
        assert torch.equal(outs[0].logits[seen], outs[1].logits[seen]), step
        a, b = caches
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.step_start, b.step_start)
        assert a._bound == b._bound and a._start_bound == b._start_bound
        for s in slots:
            n = int(a.lengths[s])
            assert torch.equal(a.k[:, s, :, :n], b.k[:, s, :, :n]) and torch.equal(a.v[:, s, :, :n], b.v[:, s, :, :n])
    assert spy.chains == 13
    for cache in caches:
        cache.keep_step_prefix([1, 1, 0], slots)
    assert torch.equal(caches[0].lengths, caches[1].lengths)


@pytest.mark.parametrize("precision", ["bf16", "int4-all"])
def test_a_tree_grown_level_by_level_in_one_native_call_a_level_equals_the_general_path(precision: str) -> None:
    """A tree drafter's levels (each under a window over the earlier, cached levels: ``W > T``)
    in one call a level give every node the general path's logits, bit for bit."""
    m = model(precision)
    m._native_layers = spy = _Spy(m._native_layers)
    parents, nodes = [-1, -1, 0, 0, 1, 2, 2, 4, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    native = feed_tree_by_levels(m, parents, nodes, PROMPTS[0])
    assert spy.chains == 5  # the prompt and four levels
    _general_path(m, True)
    assert torch.equal(native, feed_tree_by_levels(m, parents, nodes, PROMPTS[0]))
    assert spy.chains == 5


def test_a_chain_pass_in_one_call_refuses_what_the_general_pass_refuses() -> None:
    """Where the host bounds say the tokens might not fit, the general path looks at the truth
    and raises; a token outside the vocabulary is an IndexError on both paths, bad counts an
    InputError; nothing of a refused native pass is committed, host bounds included. The native
    call's own checks: RoPE's tables, logits_at, distinct slots, room in the cache, positions,
    the step's mask."""
    m = model("int8")
    m._native_layers = spy = _Spy(m._native_layers)
    cache = m.new_cache(1, 16)
    m(torch.tensor([PROMPTS[2]]), None, cache)  # 12 of 16 positions
    with pytest.raises(InputError, match="overflow"):
        m(torch.tensor([[1, 2, 3, 4, 5]]), None, cache)
    with pytest.raises(IndexError):
        m(torch.tensor([[1, VOCAB]]), None, cache)
    with pytest.raises(InputError, match="num_new"):
        m(torch.tensor([[1, 2]]), None, cache, num_new=[3])
    assert int(cache.lengths[0]) == 12 and cache._bound[0] == 12
    logits = m(torch.tensor([[1, 2, 3, 4]]), None, cache)
    assert logits.shape == (1, 4, VOCAB) and int(cache.lengths[0]) == 16 and spy.chains == 3
    ops = spy.inner
    args = dict(counts=torch.tensor([1]), slots=torch.tensor([0]), lengths=cache.lengths, step_start=cache.step_start,
                bounds=torch.tensor([4]), k_cache=cache.k, v_cache=cache.v, embed=m.model.embed_tokens.weight,
                first_norm=m.model.layers[0].input_layernorm.weight, head=m._native_head)  # fmt: skip
    cos, sin = m.rope.table(16, m.dtype)
    cache.truncate([4])
    with pytest.raises(RuntimeError, match="cover"):
        ops.chain(torch.tensor([[5]]), **args, cos=cos[:8], sin=sin[:8])
    with pytest.raises(IndexError, match="logits_at"):
        ops.chain(torch.tensor([[5]]), **args, cos=cos, sin=sin, logits_at=torch.tensor([[1]]))
    with pytest.raises(RuntimeError, match="distinct"):
        ops.chain(torch.tensor([[5], [6]]), **{**args, "counts": torch.tensor([1, 1]), "slots": torch.tensor([0, 0]),
                  "bounds": torch.tensor([4, 4])}, cos=cos, sin=sin)  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot hold"):
        ops.chain(torch.tensor([[5]]), **{**args, "bounds": torch.tensor([16])}, cos=cos, sin=sin)
    with pytest.raises(RuntimeError, match="outside RoPE"):
        ops.chain(torch.tensor([[5]]), **args, cos=cos, sin=sin, positions=torch.tensor([[cos.shape[0]]]))
    with pytest.raises(RuntimeError, match="within must be"):
        ops.chain(torch.tensor([[5]]), **args, cos=cos, sin=sin, within=torch.ones((1, 2, 1), dtype=torch.bool))
    assert int(cache.lengths[0]) == 4
    _general_path(m, True)
    with pytest.raises(IndexError):  # (the general path's refusal)
        m(torch.tensor([[1, VOCAB]]), None, cache)
