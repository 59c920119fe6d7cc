"""Draft distillation on tiny transformers built in code: the trainable decoder computes what the
runtime does (the reference for every step that follows), both objectives raise the draft's
acceptance toward the target on the data, the divergences are what they say, and a distilled
folder loads as a draft like any other."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.train.data import load_split, make_data
from verispec.train.distill import DistillConfig, decoder_of, distill, divergence, evaluate

VOCAB = 16


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    target, draft = tiny_pair(VOCAB)
    out = tmp_path_factory.mktemp("data")
    gen = torch.Generator().manual_seed(9)
    ids = [torch.randint(0, VOCAB, (6,), generator=gen).tolist() for _ in range(30)]
    texts = [f"p{i}" for i in range(30)]
    plain = Engine(target, None, None, EngineConfig(max_len=128, num_draft_tokens=0))
    make_data(plain, target, "tiny", ids, texts, out, SamplingParams(temperature=0, max_tokens=20))
    return out, target, draft


def test_the_decoder_computes_what_the_runtime_does(data) -> None:  # type: ignore[no-untyped-def]
    _, _, draft = data
    tokens = torch.tensor([1, 5, 3, 9, 0, 2, 7, 7, 4])
    cache = draft.new_cache(1, 16)
    reference = draft.forward_with_hidden(tokens[None], None, cache)
    decoder = decoder_of(draft)
    hidden = decoder.hidden(tokens)
    torch.testing.assert_close(hidden, reference.hidden[0].float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(decoder.logits(hidden), reference.logits[0], atol=2e-5, rtol=2e-5)


def test_divergences_are_forward_kl_and_total_variation() -> None:
    p = torch.tensor([[2.0, 0.0, -1.0]])
    q = torch.tensor([[0.0, 1.0, 0.5]])
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    assert torch.isclose(divergence("fkl", p, q, 1.0), (lp.exp() * (lp - lq)).sum())
    assert torch.isclose(divergence("tv", p, q, 1.0), 0.5 * (lp.exp() - lq.exp()).abs().sum())
    assert float(divergence("tv", p, p, 0.7)) == 0.0
    # the laws are taken at the temperature
    assert torch.isclose(divergence("tv", p, q, 2.0), divergence("tv", p / 2, q / 2, 1.0))


@pytest.mark.parametrize("objective", ["fkl", "tv"])
def test_distillation_raises_the_drafts_acceptance(data, objective: str) -> None:  # type: ignore[no-untyped-def]
    folder, target, draft = data
    config = DistillConfig(objective=objective, head_size=VOCAB, epochs=8, lr=2e-2, rank=4, batch=64)
    decoder, info = distill(folder, target, draft, config)
    assert info["heldout"]["positions"] > 0 and info["steps"] > 0
    _, train = load_split(folder, "train")
    lm = target.lm_weight.float()
    before = evaluate(decoder_of(draft), lm, train, config)
    after = evaluate(decoder, lm, train, config)
    assert after["acceptance"] > before["acceptance"] + 0.1, (before, after)
    assert after[objective] < before[objective]


def test_distill_options_and_the_wrong_target_are_refused(data) -> None:  # type: ignore[no-untyped-def]
    folder, _, draft = data
    other, _ = tiny_pair(VOCAB, seed=3)
    with pytest.raises(ConfigError, match="was made with"):
        distill(folder, other, draft, DistillConfig(head_size=VOCAB))
    for bad in ({"objective": "rkl"}, {"temperature": 0.0}, {"rank": 0}, {"lr": 2.0}):
        with pytest.raises(ConfigError):
            DistillConfig(**bad)  # type: ignore[arg-type]
