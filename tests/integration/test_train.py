"""Self-distillation data and Medusa heads on tiny transformers built in code: the data is the
target's own output and hidden states (resumable, split by prompt), heads train in seconds and
learn, files refuse the wrong target, and the Medusa drafter's output equals plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.heads import MedusaDrafter, MedusaHeads, load_heads, save_heads, target_fingerprint
from verispec.drafters.registry import make_drafter
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.errors import ConfigError, ModelLoadError
from verispec.train.data import DataManifest, held_out, load_split, make_data, teacher_forced_hidden
from verispec.train.medusa import MedusaConfig, positions, train_medusa

VOCAB = 16


def prompts(n: int) -> tuple[list[list[int]], list[str]]:
    gen = torch.Generator().manual_seed(7)
    ids = [
        torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]
    return ids, [f"prompt {i}: {p}" for i, p in enumerate(ids)]


def plain_engine(target):  # type: ignore[no-untyped-def]
    return Engine(target, None, None, EngineConfig(max_len=256, num_draft_tokens=0))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    target, _ = tiny_pair(VOCAB)
    out = tmp_path_factory.mktemp("data")
    ids, texts = prompts(40)
    make_data(plain_engine(target), target, "tiny", ids, texts, out, SamplingParams(temperature=0, max_tokens=24))
    return out, target


def test_the_data_is_the_targets_own_output_and_hidden_states(data) -> None:  # type: ignore[no-untyped-def]
    folder, target = data
    manifest = DataManifest.read(folder)
    assert manifest.fingerprint == target_fingerprint(target) and len(manifest.sequences) == 40
    ids, texts = prompts(40)
    assert {s["split"] for s in manifest.sequences} == {"train", "heldout"}
    for s in manifest.sequences:  # held out by the prompt's text, never by position
        assert (s["split"] == "heldout") == held_out(texts[s["prompt"]])
    _, train = load_split(folder, "train")
    tokens, p, hidden = train.tokens[0], train.prompt_lens[0], train.hidden[0]
    first = next(s for s in manifest.sequences if s["split"] == "train")
    assert tokens[:p].tolist() == ids[first["prompt"]]
    out = plain_engine(target).generate([ids[first["prompt"]]], SamplingParams(temperature=0, max_tokens=24))[0]
    assert tokens[p:].tolist() == out.token_ids  # the target's own greedy answer
    assert torch.equal(hidden, teacher_forced_hidden(target, tokens.tolist(), 0))
    assert hidden.shape == (len(tokens), target.config.hidden_size) and train.hidden_starts[0] == 0
    assert torch.equal(train.answer_hidden(0), hidden[p - 1 :])


def test_making_data_resumes_and_refuses_another_target(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, target = data
    engine = plain_engine(target)
    calls: list[int] = []
    generate = engine.generate
    engine.generate = lambda *a, **k: (calls.append(1), generate(*a, **k))[1]  # type: ignore[method-assign]
    ids, texts = prompts(42)
    make_data(engine, target, "tiny", ids, texts, folder, SamplingParams(temperature=0, max_tokens=24))
    assert len(calls) == 2  # only the two new prompts
    assert len(DataManifest.read(folder).sequences) == 42
    other, _ = tiny_pair(VOCAB, seed=3)
    with pytest.raises(ConfigError, match="another target"):
        make_data(plain_engine(other), other, "other", ids, texts, folder, SamplingParams(temperature=0, max_tokens=24))
    with pytest.raises(ConfigError, match="no training data"):
        DataManifest.read(tmp_path)


def test_labels_are_the_tokens_each_head_predicts() -> None:
    from verispec.train.data import Sequences

    tokens = torch.tensor([5, 6, 7, 8, 9, 10])  # prompt 5 6 7, answer 8 9 10
    hidden = torch.arange(4 * 2, dtype=torch.float32).view(4, 2)  # positions 2 .. 5
    h, y = positions(Sequences([tokens], [3], [hidden], [2]), num_heads=2, head_size=10)
    # position 2 (after 7): head 1 -> the token at 4 (9), head 2 -> at 5 (10: outside the 10 ids scored)
    assert y.tolist() == [[9, -100], [-100, -100], [-100, -100]] and torch.equal(h, hidden[:3])
    y2 = positions(Sequences([tokens], [3], [hidden], [2]), num_heads=2, head_size=16)[1]
    assert y2.tolist() == [[9, 10], [10, -100], [-100, -100]]
    whole = torch.cat([torch.zeros(2, 2), hidden])  # a folder that keeps the prompt's states too (positions 0 ..)
    h0, y0 = positions(Sequences([tokens], [3], [whole], [0]), num_heads=2, head_size=10)
    assert torch.equal(h0, h) and torch.equal(y0, y)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder, target = data
    out = tmp_path_factory.mktemp("heads") / "heads.safetensors"
    manifest = train_medusa(
        folder, target, out, MedusaConfig(num_heads=2, head_size=VOCAB, epochs=40, lr=1e-2, batch=64)
    )
    return out, target, manifest


def test_heads_learn_and_report_held_out_figures(trained) -> None:  # type: ignore[no-untyped-def]
    out, target, manifest = trained
    held = manifest.info["heldout"]
    assert held["positions"] > 0 and len(held["accuracy"]) == 2
    untrained = MedusaHeads(target.config.hidden_size, 2)  # starts as the LM head: predicts the next token
    _, heads_data = load_split(Path(manifest.info["data"]), "heldout")
    lm = target.lm_weight[:VOCAB].float()
    from verispec.train.medusa import evaluate

    h, y = positions(heads_data, 2, VOCAB)
    before = evaluate(untrained, lm, h, y)
    assert held["accuracy"][0] > before["accuracy"][0]  # it learnt what the LM head alone does not know
    assert held["chain_al"] > before["chain_al"]
    heads, _ = load_heads(out, target)
    _, train = load_split(Path(manifest.info["data"]), "train")
    fitted = evaluate(heads, lm, *positions(train, 2, VOCAB))
    assert fitted["accuracy"][0] > evaluate(untrained, lm, *positions(train, 2, VOCAB))["accuracy"][0] + 0.15


def test_heads_files_round_trip_and_refuse_the_wrong_target(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out, target, _manifest = trained
    heads, read = load_heads(out, target)
    assert read.num_heads == 2 and read.fingerprint == target_fingerprint(target) and read.info["steps"] > 0
    other, _ = tiny_pair(VOCAB, seed=3)
    with pytest.raises(ConfigError, match="trained for"):
        load_heads(out, other)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError):
        load_heads(bad)
    save_heads(heads, read, tmp_path / "copy.safetensors")
    again, _ = load_heads(tmp_path / "copy.safetensors", target)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), again.state_dict().values(), strict=True))


def test_training_resumes_from_its_checkpoint(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, target = data
    out = tmp_path / "h.safetensors"
    first = train_medusa(folder, target, out, MedusaConfig(num_heads=2, head_size=VOCAB, epochs=1, batch=64))
    again = train_medusa(folder, target, out, MedusaConfig(num_heads=2, head_size=VOCAB, epochs=2, batch=64))
    assert again.info["steps"] == 2 * first.info["steps"]  # the second run did the second epoch only
    assert (tmp_path / "h.safetensors.optimizer.safetensors").is_file()


def test_medusa_trees_planned_per_step_equal_plain_greedy(trained) -> None:  # type: ignore[no-untyped-def]
    from verispec.engine.calibrate import CostTable
    from verispec.engine.policy import TreePolicy

    out, target, _ = trained
    heads, _ = load_heads(out, target)
    d = make_drafter("medusa", vocab_size=VOCAB, target_model=target, heads=heads, tree=TreeShape(2, 2, 2, 8))
    flat = CostTable({(1, w): 0.1 for w in (1, 2, 3, 5, 9)}, context=64, key="test")
    policy = TreePolicy(8, 2, costs=flat)
    e = Engine(target, None, d, EngineConfig(max_len=256, max_draft_tokens=8), policy=policy)
    ids, _ = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=30)
    outs = e.generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_engine(target).generate(ids, params)]
    assert sum(policy.rank_reached) > 0 and any(len(o.stats.rank_reached) > 1 for o in outs)  # trees, not chains


@pytest.mark.parametrize("tree", [None, "[[0],[1],[0,0],[1,0],[0,1]]"])
def test_medusa_greedy_equals_plain_greedy(trained, tree: str | None) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    heads, _ = load_heads(out, target)
    shape = TreeShape.parse(tree) if tree else None
    d = make_drafter("medusa", vocab_size=VOCAB, target_model=target, heads=heads, tree=shape)
    assert isinstance(d, MedusaDrafter)
    ids, _ = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=30)
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=2 if tree is None else shape.depth))
    outs = e.generate(ids, params)
    plain = plain_engine(target).generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    if tree is not None:
        assert all(o.stats.rank_reached for o in outs if o.stats.num_drafts)


def test_the_drafter_gets_the_hidden_states_of_its_committed_tokens(trained) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    heads, _ = load_heads(out, target)
    d = make_drafter("medusa", vocab_size=VOCAB, target_model=target, heads=heads)
    prompt = prompts(1)[0][0]
    length = [len(prompt)]
    seen: list[tuple[int, torch.Tensor]] = []
    observe, observe_hidden = d.observe, d.observe_hidden

    def spy_observe(request_id: str, accepted_ids) -> None:  # type: ignore[no-untyped-def]
        length[0] += len(accepted_ids)  # (called before observe_hidden, with the step's committed tokens)
        observe(request_id, accepted_ids)

    def spy_hidden(request_id: str, hidden: torch.Tensor) -> None:
        seen.append((length[0], hidden.clone()))
        observe_hidden(request_id, hidden)

    d.observe, d.observe_hidden = spy_observe, spy_hidden  # type: ignore[method-assign]
    e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=2))
    full = prompt + e.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].token_ids
    cache = target.new_cache(1, len(full) + 1)
    reference = target.forward_with_hidden(torch.tensor([full]), None, cache).hidden[0]  # [L, C] fp32
    assert len(seen) > 3 and seen[0][0] == len(prompt) + 1
    assert seen[0][1].shape[0] == len(prompt)  # after the prefill: every prompt position
    done = 0
    for committed, hidden in seen:  # the states at the positions before each committed token, in order
        assert done + hidden.shape[0] == committed - 1
        torch.testing.assert_close(hidden.float(), reference[done : committed - 1], atol=1e-4, rtol=1e-4)
        done = committed - 1


def test_medusa_options_are_checked() -> None:
    target, _ = tiny_pair(VOCAB)
    with pytest.raises(ConfigError, match="needs heads"):
        make_drafter("medusa", vocab_size=VOCAB, target_model=target)
    with pytest.raises(ConfigError, match="hidden size"):
        make_drafter("medusa", vocab_size=VOCAB, target_model=target, heads=MedusaHeads(64, 2))
    with pytest.raises(ConfigError):
        MedusaConfig(num_heads=0)
