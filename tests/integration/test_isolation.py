"""One request never fails another: a request whose draft or target law cannot be built (numerics
gone wrong for its rows alone) ends alone, or drafts nothing, while the rest of the batch goes on
with exactly the outputs it gives alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration.test_engine import PROMPTS, plain_greedy
from tests.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine


class NaNForOneSlot:
    """A model whose logits turn NaN for one cache slot once ``slot`` is set."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.slot: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward(self, tokens: torch.Tensor, hidden: Any, cache: Any, **kw: Any) -> torch.Tensor:
        logits = self.model.forward(tokens, hidden, cache, **kw)
        slots = kw.get("slots")
        if self.slot is not None and slots is not None and self.slot in slots:
            logits = logits.clone()
            logits[list(slots).index(self.slot)] = float("nan")
        return logits


def build(target: Any, draft: Any, k: int | None = 3) -> Engine:
    drafter = make_drafter("model", draft_model=draft, vocab_size=8, max_batch=8, max_len=300)
    return Engine(target, None, drafter, EngineConfig(max_batch=8, max_len=256, num_draft_tokens=k))


def run(engine: Engine, params: list[SamplingParams], arm: Any) -> dict[str, Any]:
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    finals = {o.request_id: o for o in engine.step() if o.finished}
    engine.step()
    arm(engine, ids[2])  # mid-stream: request 2 has committed tokens already
    finals |= {o.request_id: o for o in engine.run() if o.finished}
    return {"ids": ids, "finals": finals}


@pytest.mark.parametrize("k", [3, None])
def test_a_draft_without_a_law_costs_its_request_the_draft_not_the_batch(k: int | None) -> None:
    target, draft = tiny_pair(8)
    poisoned = NaNForOneSlot(draft)
    e = build(target, poisoned, k)

    def arm(engine: Engine, rid: str) -> None:
        poisoned.slot = engine.drafter._state[rid].slot  # type: ignore[union-attr]

    greedy = SamplingParams(temperature=0, max_tokens=20)
    out = run(e, [greedy] * 4, arm)
    for rid, prompt in zip(out["ids"], PROMPTS, strict=True):
        final = out["finals"][rid]
        assert final.finish_reason == "length" and final.token_ids == plain_greedy(target, prompt, 20)
    if k is not None:  # request 2 stopped drafting once its draft had no law
        drafted = {rid: out["finals"][rid].stats.num_draft_tokens for rid in out["ids"]}
        assert drafted[out["ids"][2]] < min(drafted[r] for r in out["ids"] if r != out["ids"][2])


def test_seeded_neighbours_of_a_draft_without_a_law_sample_what_they_sample_alone() -> None:
    target, draft = tiny_pair(8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=16) for i in range(4)]
    alone = [build(target, draft).generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    poisoned = NaNForOneSlot(draft)

    def arm(engine: Engine, rid: str) -> None:
        poisoned.slot = engine.drafter._state[rid].slot  # type: ignore[union-attr]

    out = run(build(target, poisoned), params, arm)
    for i, rid in enumerate(out["ids"]):
        if i != 2:
            assert out["finals"][rid].token_ids == alone[i]


def test_a_target_law_that_fails_mid_stream_ends_that_request_alone() -> None:
    target, draft = tiny_pair(8)
    poisoned = NaNForOneSlot(target)
    e = build(poisoned, draft)

    def arm(engine: Engine, rid: str) -> None:
        poisoned.slot = next(r.slot for r in engine.running if r.request_id == rid)

    out = run(e, [SamplingParams(temperature=0, max_tokens=20)] * 4, arm)
    bad = out["finals"][out["ids"][2]]
    assert bad.finish_reason == "error" and "NaN" in (bad.error or "") and bad.token_ids  # ended mid-stream
    for i, (rid, prompt) in enumerate(zip(out["ids"], PROMPTS, strict=True)):
        if i != 2:
            assert out["finals"][rid].token_ids == plain_greedy(target, prompt, 20)
    assert e.cache.active_slots == []
