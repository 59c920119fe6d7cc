"""Long prompts. The prefill path on verispec's CPU kernels (``forward(prefill=True)``: torch's
flash attention on every tier, int8 and Q4_K projections on bf16 tiles on the amx tier) computes what the
decoding path computes up to rounding; the engine feeds a prompt's long pieces through it one
prompt a pass and short ones as before, so plain and speculative decoding see the same prompt
state, greedy speculative output still equals greedy plain output token for token, and a
prompt's output does not depend on the prompts it was batched with. The draft model reads a long
prompt from its context window, as if the prompt began there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration.test_batch_invariance import VOCAB, model
from tests.kernels import require_kernels
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.models.transformer import PREFILL_MIN_TOKENS

LONG = [(7 * i * i + 3 * i + 1) % (VOCAB - 2) + 1 for i in range(PREFILL_MIN_TOKENS + 60)]
SHORT = [1, 2, 3, 4, 5, 1, 2, 3]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> object:
    return require_kernels()


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4-all"])
def test_the_prefill_path_computes_what_decoding_computes(precision: str) -> None:
    """Logits, keys and values of a long prompt fed with prefill=True equal those of prefill=False
    up to rounding, and the same call gives the same bits twice."""
    m = model(precision)
    ids = torch.tensor([LONG])
    runs = []
    for prefill in (False, True, True):
        cache = m.new_cache(1, 256)
        logits = m(ids, None, cache, prefill=prefill)[0]  # [T, V]
        runs.append((logits, cache.k[:, 0, :, : len(LONG)].float(), cache.v[:, 0, :, : len(LONG)].float()))
    (decoded, k0, v0), (prefilled, k1, v1), again = runs
    assert all(torch.equal(a, b) for a, b in zip(again, runs[1], strict=True))
    assert not torch.equal(prefilled, decoded)  # (another path: other bits)
    assert (prefilled - decoded).abs().max() <= 0.05 * decoded.abs().max()
    assert (prefilled.argmax(-1) == decoded.argmax(-1)).float().mean() >= 0.9
    for a, b in ((k1, k0), (v1, v0)):
        assert (a - b).abs().max() <= 0.05 * b.abs().max()


class Recording:
    """A target that notes each pass's rows, widths and prefill flag."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.passes: list[tuple[int, int, bool]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, tokens: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        self.passes.append((tokens.shape[0], tokens.shape[1], bool(kw.get("prefill", False))))
        return self.inner.forward(tokens, *args, **kw)  # type: ignore[no-any-return]


def test_the_engine_feeds_long_pieces_one_prompt_a_pass() -> None:
    """Pieces of PREFILL_MIN_TOKENS or more go alone with prefill=True; the short ones together
    without (a prompt's last piece may be short: 156 tokens in chunks of 128 leave 28)."""
    target = Recording(model("int4-all"))
    config = EngineConfig(max_batch=4, max_len=256, prefill_chunk=128)
    engine = Engine(target, None, make_drafter("none", vocab_size=VOCAB), config)
    engine.generate([LONG, SHORT, LONG[:100]], SamplingParams(temperature=0, max_tokens=2))
    prompt_passes = target.passes[:4]
    assert sorted(prompt_passes) == sorted([(1, 128, True), (1, 100, True), (1, 8, False), (1, 28, False)])
    assert all(not prefill for _, _, prefill in target.passes[4:])


@pytest.mark.parametrize("precision", ["bf16", "int4-all"])
@pytest.mark.parametrize(("drafter", "k"), [("model", 4), ("ngram", 4), ("composite", None)])
def test_greedy_speculation_equals_greedy_plain_after_long_prompts(precision: str, drafter: str, k: int | None) -> None:
    """Both feed the prompts alike (the draft's catch-up over a long prompt takes its prefill path
    too, which changes drafts, never the output)."""
    target, draft = model(precision), model("int8", seed=1, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [LONG, SHORT, LONG[20:]]

    def run(name: str, k: int | None) -> list[list[int]]:
        d = make_drafter(name, draft_model=draft, vocab_size=VOCAB, max_batch=4, max_len=256)
        e = Engine(target, None, d, EngineConfig(max_batch=4, max_len=256, num_draft_tokens=k, prefill_chunk=128))
        return [o.token_ids for o in e.generate(prompts, params)]

    assert run(drafter, k) == run("none", 0)


def test_a_long_prompt_gives_the_same_output_alone_and_in_a_batch() -> None:
    target = model("int4-all")
    params = SamplingParams(temperature=0, max_tokens=12)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        e = Engine(target, None, make_drafter("none", vocab_size=VOCAB), EngineConfig(max_batch=4, max_len=256))
        return [o.token_ids for o in e.generate(prompts, params)]

    alone = run([LONG])[0]
    assert run([SHORT, LONG, LONG[30:]])[1] == alone


def test_the_draft_reads_a_long_prompt_from_its_window() -> None:
    """A prompt longer than the draft's context window is drafted from as if it began at the
    window: the same drafts, step after step, as a draft given only the window for its prompt."""
    from verispec.drafters.base import BatchView
    from verispec.drafters.model import ModelDrafter

    draft = model("int8", seed=1, noise=0.3)
    params = [SamplingParams(temperature=0)]
    windowed = ModelDrafter(draft, vocab_size=VOCAB, max_batch=2, max_len=128, context_window=16)
    whole = ModelDrafter(draft, vocab_size=VOCAB, max_batch=2, max_len=128, context_window=None)
    context_a, context_b = list(LONG[:60]), list(LONG[44:60])
    windowed.begin("a", context_a)
    whole.begin("b", context_b)
    for accepted in (2, 0, 4):
        drafts = [
            d.propose(BatchView([rid], params, [None]), [4]).token_ids[0].tolist()
            for d, rid in ((windowed, "a"), (whole, "b"))
        ]
        assert drafts[0] == drafts[1]
        committed = [*drafts[0][:accepted], (drafts[0][accepted] + 1) % VOCAB if accepted < 4 else 7]
        for d, rid, context in ((windowed, "a", context_a), (whole, "b", context_b)):
            context.extend(committed)
            d.observe(rid, committed)
    assert windowed.cache.lengths[windowed._get("a").slot] == whole.cache.lengths[whole._get("b").slot]
    with pytest.raises(ConfigError, match="at least 1 token"):
        ModelDrafter(draft, vocab_size=VOCAB, context_window=0)


@pytest.mark.parametrize("drafter", ["model", "tree"])
def test_greedy_speculation_equals_greedy_plain_with_a_windowed_draft(drafter: str) -> None:
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.tree import TreeDrafter

    target, draft = model("int4-all"), model("int8", seed=1, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [LONG[:70], SHORT, LONG[10:90]]
    kinds = {"model": ModelDrafter, "tree": TreeDrafter}
    d = kinds[drafter](draft, vocab_size=VOCAB, max_batch=4, max_len=256, context_window=24)
    spec = Engine(target, None, d, EngineConfig(max_batch=4, max_len=256, num_draft_tokens=4))
    plain = Engine(target, None, make_drafter("none", vocab_size=VOCAB), EngineConfig(max_batch=4, max_len=256))
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]


@pytest.mark.parametrize("drafter", ["model", "tree", "composite"])
def test_the_window_reaches_every_drafter_with_a_draft_model(drafter: str) -> None:
    """``make_drafter(draft_window=...)`` (``--draft-window``; 0 there is None here: the whole
    prompt) sets the draft model's window; by default it is DRAFT_CONTEXT_WINDOW."""
    from verispec.config import DRAFT_CONTEXT_WINDOW

    draft = model("int8", seed=1)
    for window in (DRAFT_CONTEXT_WINDOW, 64, None):
        extra = {} if window == DRAFT_CONTEXT_WINDOW else {"draft_window": window}
        d = make_drafter(drafter, draft_model=draft, vocab_size=VOCAB, max_batch=2, max_len=128, **extra)
        inner = d.model if drafter == "composite" else d  # type: ignore[attr-defined]
        assert inner.context_window == window, (drafter, window)  # type: ignore[attr-defined]


@pytest.mark.parametrize("drafter", ["model", "tree"])
def test_a_long_catch_up_goes_in_chunks_with_the_same_drafts(drafter: str) -> None:
    """A catch-up longer than ``catch_up_chunk`` is fed a chunk of one request a pass, without
    logits, and the rest with the step's batched pass; below PREFILL_MIN_TOKENS both take the
    decoding path, whose rows do not depend on the pass's width, so the drafts are those of one
    pass over the whole prompt, bit for bit."""
    from verispec.drafters.base import BatchView
    from verispec.drafters.model import ModelDrafter
    from verispec.drafters.tree import TreeDrafter

    kinds = {"model": ModelDrafter, "tree": TreeDrafter}
    draft = Recording(model("int8", seed=1, noise=0.3))
    prompt = LONG[: PREFILL_MIN_TOKENS - 6]  # (90 tokens: one pass of the whole stays on the decoding path)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    drafts = []
    for chunk in (32, 512):
        d = kinds[drafter](draft, vocab_size=VOCAB, max_batch=2, max_len=256, context_window=None)
        d.catch_up_chunk = chunk
        d.begin("long", prompt)
        d.begin("short", SHORT)
        draft.passes.clear()
        out = d.propose(BatchView(["long", "short"], params, [None, None]), [3, 3])
        drafts.append(out.token_ids.tolist())
        if chunk == 32:  # 90 = 32 + 32 + 26: two chunks alone, then the batched pass
            assert draft.passes[:3] == [(1, 32, False), (1, 32, False), (2, 26, False)]
        assert d.last_catchup_tokens >= len(prompt)  # (the whole catch-up, its chunks included)
    assert drafts[0] == drafts[1]


def test_greedy_speculation_equals_greedy_plain_with_a_chunked_catch_up() -> None:
    from verispec.drafters.model import ModelDrafter

    target, draft = model("int4-all"), model("int8", seed=1, noise=0.3)
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = [LONG, SHORT, LONG[10:]]
    d = ModelDrafter(draft, vocab_size=VOCAB, max_batch=4, max_len=256, context_window=None)
    d.catch_up_chunk = 100  # (156 = 100 on the prefill path + 56 with the batch)
    spec = Engine(target, None, d, EngineConfig(max_batch=4, max_len=256, num_draft_tokens=4))
    plain = Engine(target, None, make_drafter("none", vocab_size=VOCAB), EngineConfig(max_batch=4, max_len=256))
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in plain.generate(prompts, params)
    ]
