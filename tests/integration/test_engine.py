"""The engine end to end on tiny transformers built in code: exactness, batching, stopping."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.tiny import byte_tokenizer, tiny_config, tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.base import BatchView
from verispec.drafters.registry import make_drafter
from verispec.drafters.retrieval import Datastore
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.errors import ConfigError, InputError
from verispec.models.transformer import Transformer, random_state_dict
from verispec.sampling import make_generator
from verispec.verify.tree import depths

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [7], [2, 2, 2, 2, 2]]


def engine(drafter: str, vocab: int = 8, k: int | None = 3, max_batch: int = 8, **kw) -> Engine:
    target, draft = tiny_pair(vocab)
    config = EngineConfig(max_batch=max_batch, max_len=256, num_draft_tokens=k, **kw)
    d = make_drafter(drafter, draft_model=draft, vocab_size=vocab, max_batch=max_batch, max_len=300)
    return Engine(target, None, d, config)


def plain_greedy(target: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by hand: full forward over the growing sequence, argmax (no cache reuse)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        cache = target.new_cache(1, 512)
        logits = target.forward(torch.tensor([seq]), None, cache)[0, -1]
        token = int(logits.argmax())
        out.append(token)
        seq.append(token)
    return out


@pytest.mark.parametrize("drafter", ["none", "model", "ngram", "composite", "suffix"])
def test_greedy_speculative_equals_plain_greedy(drafter: str) -> None:
    target, _ = tiny_pair(8)
    e = engine(drafter)
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20), (drafter, prompt)
        assert out.finish_reason == "length"
        assert out.lossless
    if drafter != "none":
        assert sum(o.stats.num_draft_tokens for o in outs) > 0
        assert sum(o.stats.num_accepted_tokens for o in outs) > 0


def test_greedy_steps_are_judged_from_the_modes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of greedy rows with no bias or penalty is judged from the target's modes, no laws
    built (``Engine._judge_greedy``), and decodes plain greedy's tokens; a sampled row in the
    batch, or a logit bias, sends the step to the laws and the rule."""
    target, _ = tiny_pair(8)
    e = engine("model")
    used: list[bool] = []
    judge = e._judge_greedy

    def spy(*args: object) -> object:
        out = judge(*args)  # type: ignore[arg-type]
        used.append(out is not None)
        return out

    monkeypatch.setattr(e, "_judge_greedy", spy)
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    assert used and all(used)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20)
    for other in (SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0, logit_bias={3: 0.5})):
        used.clear()  # (the other request outlives the greedy one: every step has it)
        e.generate(
            PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=6), dataclasses.replace(other, max_tokens=10)]
        )
        assert used and not any(used)


@pytest.mark.parametrize("children", ["fixed", "sampled", "distinct"])
def test_greedy_tree_speculation_equals_plain_greedy(children: str) -> None:
    """fp32 on torch's kernels: each tree node is scored on its own path (tree mask, depth
    positions), and the accepted path's KV is compacted into place."""
    target, draft = tiny_pair(8)
    d = make_drafter(
        "tree", draft_model=draft, vocab_size=8, max_len=300, tree=TreeShape(4, 2, 2, 12), tree_children=children
    )
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=4, max_draft_tokens=12))
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20), (children, prompt)
    assert sum(o.stats.num_draft_tokens for o in outs) > sum(o.stats.num_accepted_tokens for o in outs) > 0


def test_a_tree_drafter_proposes_trees_of_its_shape() -> None:
    target, draft = tiny_pair(8)
    d = make_drafter("tree", draft_model=draft, vocab_size=8, max_len=300, tree=TreeShape(3, 2, 2, 9))
    seen: list[object] = []
    propose = d.propose

    def spy(batch, max_tokens):  # type: ignore[no-untyped-def]
        draft_ = propose(batch, max_tokens)
        seen.append(draft_)
        return draft_

    d.propose = spy  # type: ignore[method-assign]
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3, max_draft_tokens=9))
    e.generate([PROMPTS[1]], SamplingParams(temperature=0.8, seed=1, max_tokens=12))
    for draft_ in seen:
        assert draft_.is_tree and draft_.children == "fixed"
        n = int(draft_.num_tokens[0])
        assert 1 <= n <= 9  # (fewer near the end of the request: its remaining tokens bound the tree)
        assert max(depths(draft_.parents, draft_.num_tokens)[0].tolist()) <= 3
    assert seen[0].parents[0, :2].tolist() == [-1, -1]  # the root grows two children


STATIC = "[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]"  # Medusa-style rank paths


@pytest.mark.parametrize("children", ["fixed", "sampled"])
def test_a_static_tree_drafter_proposes_its_topology(children: str) -> None:
    target, draft = tiny_pair(8)
    shape = TreeShape.parse(STATIC)
    assert (shape.depth, shape.max_nodes, shape.parents) == (3, 7, (-1, -1, -1, 0, 0, 1, 3))
    d = make_drafter("tree", draft_model=draft, vocab_size=8, max_len=300, tree=shape, tree_children=children)
    seen: list[object] = []
    propose = d.propose

    def spy(batch, max_tokens):  # type: ignore[no-untyped-def]
        draft_ = propose(batch, max_tokens)
        seen.append(draft_)
        return draft_

    d.propose = spy  # type: ignore[method-assign]
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3, max_draft_tokens=7))
    outs = e.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=3, max_tokens=40))
    full = [d_ for d_ in seen if int(d_.num_tokens[0]) == 7]
    assert full, "no step drafted the whole shape"
    for draft_ in full:
        assert draft_.parents[0].tolist() == list(shape.parents)
        if children == "fixed":  # top-k: a node's children are its parent's likeliest, distinct tokens
            assert len(set(draft_.token_ids[0, :3].tolist())) == 3
    if children == "fixed":
        assert all(o.stats.num_draft_tokens for o in outs)


def test_greedy_static_tree_speculation_equals_plain_greedy() -> None:
    target, draft = tiny_pair(8)
    d = make_drafter("tree", draft_model=draft, vocab_size=8, max_len=300, tree=TreeShape.parse(STATIC))
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3, max_draft_tokens=7))
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20), prompt


@pytest.mark.parametrize(
    "text",
    ["[[1]]", "[[0], [0]]", "[]", "[[0], [0, 0], [0, 1, 2]]", "{}", "[[0.5]]", "[[true]]", "[[0]", "4,2", "x,y,z"],
)
def test_bad_tree_shapes_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        TreeShape.parse(text)


def test_a_tree_file_is_read_and_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = tmp_path / "tree.json"
    good.write_text(STATIC)
    assert TreeShape.parse(str(good)).parents == (-1, -1, -1, 0, 0, 1, 3)
    big = tmp_path / "big.json"
    big.write_text("[" + ",".join(["[0]"] * 400_000) + "]")
    with pytest.raises(ConfigError, match="larger than"):
        TreeShape.parse(str(big))
    with pytest.raises(ConfigError, match="cannot read"):
        TreeShape.parse(str(tmp_path / "missing.json"))
    many = tmp_path / "many.json"
    many.write_text(str([[i] for i in range(2000)]))
    with pytest.raises(ConfigError, match="at most"):
        TreeShape.parse(str(many))


def test_greedy_retrieval_speculation_equals_plain_greedy() -> None:
    """A datastore holding the target's own greedy continuations: long accepted paths, same output."""
    target, _ = tiny_pair(8)
    docs = [list(p) + plain_greedy(target, p, 24) for p in PROMPTS[:2]] + [[1, 2, 3, 5, 5, 5], [7, 0, 1]]
    d = make_drafter("retrieval", vocab_size=8, datastore=Datastore.build(docs))
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=4, max_draft_tokens=16))
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20), prompt
    assert outs[0].stats.mean_acceptance_length > 3  # its continuation is in the datastore
    with pytest.raises(ConfigError, match="datastore"):
        make_drafter("retrieval", vocab_size=8)


def test_restricted_draft_head_greedy_equals_plain() -> None:
    target, draft = tiny_pair(8)
    d = make_drafter("model", draft_model=draft, vocab_size=8, max_len=300, draft_head=4, keep_ids=(7,))
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3))
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 20)
    drafted = {t for o in outs for t in o.token_ids}
    assert drafted  # the target still emits tokens outside the draft head (through the residual)
    with pytest.raises(ConfigError, match="head size"):
        make_drafter("model", draft_model=draft, vocab_size=8, draft_head=0)

    class Headless:  # a model that exposes neither its LM head module nor its rows
        lm_head = lm_weight = None

        def __getattr__(self, name: str) -> object:
            return getattr(draft, name)

    with pytest.raises(ConfigError, match="cannot be restricted"):
        make_drafter("model", draft_model=Headless(), vocab_size=8, draft_head=4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=50, min_p=0.1),  # (top_k past the head's ids: all of them)
    ],
    ids=["greedy", "temperature", "top-k-top-p", "min-p"],
)
def test_a_restricted_head_builds_its_laws_on_its_ids_as_on_the_whole_row(params: SamplingParams) -> None:
    """Without penalties or biases the draft's laws are built on the head's ids alone; a zero bias
    forces the whole-row path, which must give the same tokens and the same laws (greedy rows
    without a bias carry none: their drafts are the point masses at the tokens)."""
    _, draft = tiny_pair(16)
    whole_row = dataclasses.replace(params, logit_bias={0: 0.0})  # (+0.0: the same logits)
    drafts = []
    for p in (params, whole_row):
        d = make_drafter(
            "model", draft_model=draft, vocab_size=16, max_batch=2, max_len=64, draft_head=6, keep_ids=(11,)
        )
        for rid, prompt in (("a", [3, 1, 4, 1, 5]), ("b", [2, 7])):
            d.begin(rid, prompt)
        gens = [None, None] if params.greedy else [make_generator(7), make_generator(8)]
        drafts.append(d.propose(BatchView(["a", "b"], [p, p], gens), [4, 2]))
    narrow, whole = drafts
    assert torch.equal(narrow.token_ids, whole.token_ids) and torch.equal(narrow.num_tokens, whole.num_tokens)
    laws = narrow.probs
    if params.greedy:
        assert laws is None
        laws = torch.zeros_like(whole.probs)
        for row, count in enumerate(narrow.num_tokens.tolist()):
            laws[row, torch.arange(count), narrow.token_ids[row, :count]] = 1.0
    torch.testing.assert_close(laws, whole.probs, rtol=0, atol=1e-6)
    for row, own in ((0, []), (1, [7])):  # the head's ids and the ids of the row's own context (7: b's)
        outside = torch.ones(16, dtype=torch.bool)
        outside[[0, 1, 2, 3, 4, 5, 11, *own]] = False
        assert laws[row][..., outside].abs().sum() == 0  # no mass elsewhere: a's law has none at b's 7
    assert laws[1, 2:].abs().sum() == 0  # the row drafting 2 tokens has no law past them


@pytest.mark.parametrize("name", ["model", "composite"])
def test_greedy_drafts_carry_no_laws_unless_a_row_samples(name: str) -> None:
    """A batch whose drafting rows are all greedy drafts the mode of each row's logits and builds
    no laws (Draft.probs None: point masses); a sampled row brings the laws back, the greedy row's
    a point mass at its token."""
    _, draft = tiny_pair(16)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    for params, gens in (([greedy, greedy], [None, None]), ([greedy, sampled], [None, make_generator(3)])):
        d = make_drafter(name, draft_model=draft, vocab_size=16, max_batch=2, max_len=64)
        d.begin("a", [3, 1, 4, 1, 5])
        d.begin("b", [2, 7])
        out = d.propose(BatchView(["a", "b"], params, gens), [3, 3])
        assert out.num_tokens.tolist() == [3, 3]
        if params[1].greedy:
            assert out.probs is None
        else:
            assert out.probs is not None
            expected = torch.zeros(3, 16)
            expected[torch.arange(3), out.token_ids[0]] = 1.0
            assert torch.equal(out.probs[0], expected)


def test_a_restricted_head_scores_the_requests_own_ids_outside_it() -> None:
    """An id outside the head that a request's context holds is in that request's draft law with
    the whole head's score, and in no other request's; without context ids the law stays on the
    head."""
    _, draft = tiny_pair(16)
    prompts = {"a": [3, 1, 4, 1, 5], "b": [2, 9, 12]}
    head = [0, 1, 2, 3, 4, 5]
    for context_ids in (True, False):
        d = make_drafter("model", draft_model=draft, vocab_size=16, max_batch=2, max_len=64, draft_head=6)
        d.context_ids = context_ids
        for rid, prompt in prompts.items():
            d.begin(rid, prompt)
        params = SamplingParams(temperature=1.0)
        out = d.propose(BatchView(["a", "b"], [params, params], [make_generator(1), make_generator(2)]), [1, 1])
        for row, (rid, prompt) in enumerate(prompts.items()):
            full = draft(torch.tensor([prompt]), None, draft.new_cache(1, 8))[0, -1].float()  # [V]
            allowed = head + ([t for t in prompt if t >= 6] if context_ids else [])
            expected = torch.full((16,), float("-inf"))
            expected[allowed] = full[allowed]
            torch.testing.assert_close(out.probs[row, 0], torch.softmax(expected, dim=0), rtol=0, atol=1e-6)
    assert d._pool == ()  # (the last drafter had context ids off)


@pytest.mark.parametrize("drafter", ["model", "composite"])
def test_adaptive_k_greedy_equals_plain(drafter: str) -> None:
    target, _ = tiny_pair(8)
    e = engine(drafter, k=None)
    outs = e.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == plain_greedy(target, prompt, 16)


def test_the_composite_looks_up_on_steps_the_policy_gives_the_model_none() -> None:
    """With K chosen per step and every step scheduled K = 0 (the model's drafts not worth their
    passes), the composite's lookup still drafts where its budget allows: the request's stats count
    those drafts as free, and the greedy output is plain greedy's. A fixed K = 0 drafts nothing."""
    from tests.tiny import ModelOffPolicy

    target, _ = tiny_pair(8)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # a span the lookup has seen, twice
    params = SamplingParams(temperature=0, max_tokens=24)
    e = engine("composite", k=None)
    e.policy = ModelOffPolicy(e.config.max_draft_tokens)
    out = e.generate([prompt], params)[0]
    stats = out.stats
    assert stats.num_free_drafts > 0 and stats.num_free_drafts == stats.num_drafts
    assert list(out.token_ids) == plain_greedy(target, prompt, len(out.token_ids))
    from verispec.bench.local import iter_entries  # the step records say so too (the gate reads them)
    from verispec.bench.stats import acceptance_from_steps

    acc = acceptance_from_steps(iter_entries(list(e.steps)))
    assert acc.num_drafts == stats.num_drafts and acc.free_draft_share == 1.0
    fixed_off = engine("composite", k=0).generate([prompt], params)[0]
    assert fixed_off.stats.num_drafts == 0 and list(fixed_off.token_ids) == list(out.token_ids)


@pytest.mark.parametrize("drafter", ["model", "ngram", "composite", "suffix", "none"])
def test_seed_gives_same_output_batched_or_alone(drafter: str) -> None:
    """With a fixed K, a seeded request's text is the same batched or alone, and after other
    requests ran: here the first request ends early, and the composite's and suffix drafter's
    lookups would otherwise find its output in their corpus (a law-preserving draft that spends
    the randomness differently: it changed 31 of 80 texts over 20 seed sets)."""
    for trial in range(3):
        params = [
            SamplingParams(temperature=0.9, top_p=0.95, seed=s + 10 * trial, max_tokens=3 if s == 1 else 12)
            for s in (1, 2, 3, 4)
        ]
        shared = engine(drafter)
        batched = shared.generate(PROMPTS, params)
        again = shared.generate(PROMPTS[1:], params[1:])  # the first batch's outputs are in its corpus now
        assert [o.token_ids for o in again] == [o.token_ids for o in batched[1:]]
        for prompt, p, out in zip(PROMPTS, params, batched, strict=True):
            alone = engine(drafter).generate([prompt], [p])[0]
            assert alone.token_ids == out.token_ids


def test_requests_join_and_leave_between_steps() -> None:
    e = engine("model", max_batch=2)
    params = SamplingParams(temperature=0, max_tokens=6)
    ids = [e.add_request(p, params) for p in PROMPTS]
    seen_running = set()
    finals = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                finals[out.request_id] = out
        seen_running.add(len(e.running))
        assert len(e.running) <= 2
    assert set(finals) == set(ids)
    target, _ = tiny_pair(8)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        assert finals[rid].token_ids == plain_greedy(target, prompt, 6)
    assert e.cache.active_slots == []


def test_text_streaming_eos_and_stop_strings() -> None:
    tok = byte_tokenizer()
    vocab = 257
    config = tiny_config(vocab)
    target = Transformer(config, random_state_dict(config, seed=3, std=0.35))
    draft = Transformer(config, random_state_dict(config, seed=3, std=0.35))
    d = make_drafter("model", draft_model=draft, vocab_size=vocab, max_len=300)
    e = Engine(target, tok, d, EngineConfig(max_len=256, num_draft_tokens=4))
    full = e.generate(["héllo"], SamplingParams(temperature=0, max_tokens=30))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    # A stop string taken from inside the greedy output truncates the text exactly there.
    stop = full.text[5:7]
    if stop and stop not in full.text[:5]:
        e2 = Engine(
            target,
            tok,
            make_drafter("model", draft_model=draft, vocab_size=vocab, max_len=300),
            EngineConfig(max_len=256, num_draft_tokens=4),
        )
        streamed = ""
        rid = e2.add_request("héllo", SamplingParams(temperature=0, max_tokens=30, stop=(stop,)))
        final = None
        for out in e2.run():
            assert out.request_id == rid
            streamed += out.new_text
            final = out
        assert final is not None and final.finish_reason == "stop"
        assert final.text == full.text[: full.text.index(stop)]
        assert streamed == final.text


def test_eos_ends_the_request_inside_a_block() -> None:
    target, draft = tiny_pair(8)
    greedy = plain_greedy(target, [1, 2, 3], 12)
    eos = greedy[5]
    first = greedy.index(eos)
    d = make_drafter("model", draft_model=draft, vocab_size=8, max_len=300)
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=4), eos_token_ids=[eos])
    out = e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.token_ids == greedy[:first]
    assert out.finish_reason == "stop"


def test_bad_input() -> None:
    e = engine("model")
    with pytest.raises(InputError, match="empty"):
        e.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="context"):
        e.add_request([1, 2], SamplingParams(max_tokens=1000))
    with pytest.raises(InputError, match="vocabulary"):
        e.add_request([1, 99], SamplingParams(max_tokens=5))
    with pytest.raises(ConfigError, match="tokenizer"):
        e.add_request("text", SamplingParams())
    with pytest.raises(ConfigError, match="unknown drafter"):
        make_drafter("nope", vocab_size=8)
    with pytest.raises(ConfigError, match="needs a draft model"):
        make_drafter("model", vocab_size=8)
    with pytest.raises(ConfigError, match=">= 0"):
        EngineConfig(num_draft_tokens=-1)
    e.add_request([1], SamplingParams(max_tokens=5), request_id="x")
    with pytest.raises(InputError, match="unique"):
        e.add_request([1], SamplingParams(max_tokens=5), request_id="x")


def test_a_failing_request_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    e = engine("model")
    ids = [e.add_request(p, SamplingParams(temperature=0, max_tokens=8)) for p in PROMPTS]
    original = type(e.drafter).observe  # type: ignore[union-attr]

    def observe(self, request_id, accepted):  # type: ignore[no-untyped-def]
        if request_id == ids[1]:
            raise RuntimeError("boom")
        return original(self, request_id, accepted)

    monkeypatch.setattr(type(e.drafter), "observe", observe)
    finals = {o.request_id: o for o in e.run() if o.finished}
    assert finals[ids[1]].finish_reason == "error" and "boom" in (finals[ids[1]].error or "")
    target, _ = tiny_pair(8)
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        if rid != ids[1]:
            assert finals[rid].token_ids == plain_greedy(target, prompt, 8)


def test_a_request_whose_law_cannot_be_built_fails_alone() -> None:
    """Every token banned leaves no law (for the draft and the target alike): that row fails, the
    batch goes on."""
    target, _ = tiny_pair(8)
    e = engine("model")
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = SamplingParams(temperature=0.7, max_tokens=8, logit_bias=dict.fromkeys(range(8), float("-inf")))
    ids = [e.add_request(p, bad if i == 2 else good) for i, p in enumerate(PROMPTS)]
    finals = {o.request_id: o for o in e.run() if o.finished}
    assert finals[ids[2]].finish_reason == "error" and "probability 0" in (finals[ids[2]].error or "")
    for i, (rid, prompt) in enumerate(zip(ids, PROMPTS, strict=True)):
        if i != 2:
            assert finals[rid].token_ids == plain_greedy(target, prompt, 8)
    assert e.cache.active_slots == []


def test_the_prefill_is_timed_apart_from_the_decoding_steps() -> None:
    e = engine("none", k=None)
    out = e.generate([PROMPTS[1]], [SamplingParams(temperature=0.0, max_tokens=6)])[0]
    t = out.timings
    assert t["prefill_ms"] > 0 and t["verify_ms_per_step"] is not None
    # the per-step figure is the steps' own passes: the prompt's pass is not spread over them
    first_only = e.generate([PROMPTS[1]], [SamplingParams(temperature=0.0, max_tokens=1)])[0].timings
    assert first_only["prefill_ms"] > 0 and first_only["verify_ms_per_step"] is None
