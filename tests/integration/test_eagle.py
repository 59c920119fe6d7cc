"""The EAGLE head on tiny transformers built in code: it trains in seconds and learns, its drafts
equal the training unroll it was taught on (the fast path against the reference), greedy
speculative output (chains and dynamic trees) equals plain greedy, files refuse the wrong target,
data without the prompt's features is refused with what to do, training resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.base import BatchView
from verispec.drafters.eagle import EagleDrafter, EagleHead, EagleShape, load_eagle, save_eagle
from verispec.drafters.registry import make_drafter
from verispec.drafters.tree import TreeShape
from verispec.engine import Engine
from verispec.errors import ConfigError, ModelLoadError
from verispec.train.data import DataManifest, load_split, make_data, teacher_forced_hidden
from verispec.train.eagle import EagleConfig, evaluate, pack, summarise, train_eagle, unroll

VOCAB = 16


def prompts(n: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(n)
    ]


def plain_engine(target):  # type: ignore[no-untyped-def]
    return Engine(target, None, None, EngineConfig(max_len=256, num_draft_tokens=0))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    target, _ = tiny_pair(VOCAB)
    out = tmp_path_factory.mktemp("data")
    ids = prompts(40)
    texts = [f"prompt {i}: {p}" for i, p in enumerate(ids)]
    make_data(plain_engine(target), target, "tiny", ids, texts, out, SamplingParams(temperature=0, max_tokens=24))
    return out, target


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    folder, target = data
    out = tmp_path_factory.mktemp("eagle") / "eagle.safetensors"
    manifest = train_eagle(folder, target, out, EagleConfig(head_size=VOCAB, epochs=30, lr=3e-3, batch=256))
    return out, target, manifest


def test_the_head_learns_and_reports_held_out_figures(trained) -> None:  # type: ignore[no-untyped-def]
    out, target, manifest = trained
    held = manifest.info["heldout"]
    assert held["positions"] > 0 and len(held["accuracy"]) == 6
    folder = Path(manifest.info["data"])
    _, train = load_split(folder, "train")
    rows = pack(train, list(range(8)))
    embeds = target.embed_weight.index_select(0, rows.next_ids).float()
    lm = target.lm_weight[:VOCAB].float()
    head, _ = load_eagle(out, target)
    torch.manual_seed(0)
    fresh = EagleHead(EagleShape.for_target(target)).eval()
    fitted, before = summarise(evaluate(head, rows, embeds, lm)), summarise(evaluate(fresh, rows, embeds, lm))
    assert fitted["accuracy"][0] > before["accuracy"][0] + 0.3 and fitted["chain_al"] > before["chain_al"] + 0.5


def test_drafts_equal_the_training_unroll(trained) -> None:  # type: ignore[no-untyped-def]
    """The drafter (cache, catch-up, autoregressive chain) computes what the training passes do."""
    out, target, _ = trained
    head, _ = load_eagle(out, target)
    d = EagleDrafter(target, head, vocab_size=VOCAB, head_size=VOCAB)
    prompt = prompts(1, seed=11)[0] + [3, 5, 1, 2]
    committed = [*prompt, 7]
    hidden = teacher_forced_hidden(target, committed, 0).float()  # [L, C]
    d.begin("r", prompt)
    d.observe("r", [7])
    d.observe_hidden("r", hidden[:-1])  # positions 0 .. L - 2 gave the tokens 1 .. L - 1
    draft = d.propose(BatchView(["r"], [SamplingParams(temperature=0)], [None], [3]), [3])
    chain = draft.token_ids[0, :3].tolist()
    # the reference: the training unroll over the committed tokens followed by the drafted ones
    from verispec.train.data import Sequences

    tokens = torch.tensor(committed + chain)
    features = torch.cat([hidden, torch.zeros(len(chain), hidden.shape[1])])  # (drafted positions: unread)
    rows = pack(Sequences([tokens], [len(prompt)], [features.to(torch.bfloat16)], [0]), [0])
    rows.features = torch.cat([hidden, torch.zeros(len(chain), hidden.shape[1])])[:-1]  # fp32, as the drafter reads
    embeds = target.embed_weight.index_select(0, rows.next_ids).float()
    lm = target.lm_weight[:VOCAB].float()
    passes = unroll(head, rows, embeds, 3)
    root = len(committed) - 2  # the pair (f_{n-1}, x_n)
    expected = [int((passes[j][0][root + j] @ lm.T).argmax()) for j in range(3)]
    assert chain == expected


@pytest.mark.parametrize("tree", [None, "3,2,2,6", "4,3,2"])
def test_eagle_greedy_equals_plain_greedy(trained, tree: str | None) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    head, _ = load_eagle(out, target)
    shape = TreeShape.parse(tree) if tree else None
    d = make_drafter("eagle", vocab_size=VOCAB, target_model=target, heads=head, tree=shape)
    ids = prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=30)
    k = 3 if shape is None else shape.depth
    config = EngineConfig(max_len=256, num_draft_tokens=k, max_draft_tokens=max(8, shape.max_nodes if shape else 0))
    outs = Engine(target, None, d, config).generate(ids, params)
    plain = plain_engine(target).generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    torch.manual_seed(0)
    fresh = make_drafter("eagle", vocab_size=VOCAB, target_model=target, heads=EagleHead(head.shape), tree=shape)
    untrained = Engine(target, None, fresh, config).generate(ids, params)
    assert [o.token_ids for o in untrained] == [o.token_ids for o in plain]

    def accepted(outs) -> float:  # type: ignore[no-untyped-def]
        return sum(o.stats.num_accepted_tokens for o in outs) / max(1, sum(o.stats.num_drafts for o in outs))

    assert accepted(outs) > accepted(untrained) + 0.2  # the trained head drafts what the target says
    if shape is not None:
        assert any(len(o.stats.rank_reached) > 1 for o in outs)  # trees, not chains


def test_eagle_sampled_output_is_seeded_and_batch_invariant(trained) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    head, _ = load_eagle(out, target)
    ids = prompts(3, seed=5)
    params = [SamplingParams(temperature=0.8, max_tokens=20, seed=i) for i in range(3)]

    def run(batch: list[list[int]], p: list[SamplingParams]) -> list[list[int]]:
        d = make_drafter("eagle", vocab_size=VOCAB, target_model=target, heads=head, tree=TreeShape(3, 2, 2, 6))
        e = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3, max_draft_tokens=8))
        return [o.token_ids for o in e.generate(batch, p)]

    together = run(ids, params)
    alone = [run([ids[i]], [params[i]])[0] for i in range(3)]
    assert together == alone


def test_eagle_files_round_trip_and_refuse_the_wrong_target(trained, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    head, read = load_eagle(out, target)
    assert read.info["steps"] > 0 and read.head_size == VOCAB
    other, _ = tiny_pair(VOCAB, seed=3)
    with pytest.raises(ConfigError, match="trained for"):
        load_eagle(out, other)
    from verispec.drafters.heads import load_heads

    with pytest.raises(ModelLoadError, match="not a verispec Medusa"):
        load_heads(out)  # an EAGLE file is not Medusa heads
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        load_eagle(bad)
    save_eagle(head, read, tmp_path / "copy.safetensors")
    again, _ = load_eagle(tmp_path / "copy.safetensors", target)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values(), strict=True))


def test_training_resumes_and_refuses_data_without_the_prompts_features(data, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, target = data
    out = tmp_path / "e.safetensors"
    first = train_eagle(folder, target, out, EagleConfig(head_size=VOCAB, epochs=1, batch=256))
    again = train_eagle(folder, target, out, EagleConfig(head_size=VOCAB, epochs=2, batch=256))
    assert again.info["steps"] == 2 * first.info["steps"]  # the second run did the second epoch only
    # a folder made before the prompt's hidden states were kept
    import shutil

    old = tmp_path / "old"
    shutil.copytree(folder, old)
    manifest = DataManifest.read(old)
    for entry in manifest.sequences:
        entry["hidden_start"] = entry["prompt_len"] - 1
    manifest.write(old)
    with pytest.raises(ConfigError, match="make the data again"):
        train_eagle(old, target, tmp_path / "x.safetensors", EagleConfig(head_size=VOCAB, epochs=1))


def test_eagle_options_are_checked(trained) -> None:  # type: ignore[no-untyped-def]
    out, target, _ = trained
    head, _ = load_eagle(out, target)
    with pytest.raises(ConfigError, match="needs a head"):
        make_drafter("eagle", vocab_size=VOCAB, target_model=target)
    with pytest.raises(ConfigError, match="dynamically"):
        make_drafter("eagle", vocab_size=VOCAB, target_model=target, heads=head, tree=TreeShape.fixed([-1, 0]))
    with pytest.raises(ConfigError, match="hidden size"):
        EagleDrafter(target, EagleHead(EagleShape(64, 2, 1, 32, 64)), vocab_size=VOCAB)
    with pytest.raises(ConfigError):
        EagleConfig(unroll=0)
    from verispec.pipeline import tree_shape

    with pytest.raises(ConfigError, match="dynamically"):
        tree_shape("eagle", "auto", None, "rejection")


def test_the_head_on_the_cpu_kernels_drafts_for_a_kernel_target(trained) -> None:  # type: ignore[no-untyped-def]
    """On a target on verispec's kernels the head runs its projections in int8 (W8A8): close to the
    fp32 head, and greedy output still equals plain decoding."""
    from verispec.formats.loader import bf16_kernel_usable

    if not bf16_kernel_usable():
        pytest.skip("verispec's vector kernels do not run on this CPU")
    out, target, _ = trained
    head, _ = load_eagle(out, target)
    x, e = torch.randn(5, target.config.hidden_size), torch.randn(5, target.config.hidden_size)
    quantised = EagleHead(head.shape)
    quantised.load_state_dict(head.state_dict())
    quantised.on_kernels()
    torch.testing.assert_close(quantised.fuse(x, e), head.fuse(x, e), atol=0.05, rtol=0.05)
    d = make_drafter("eagle", vocab_size=VOCAB, target_model=target, heads=head)
    d.head = quantised  # type: ignore[attr-defined]  (what a kernel target gets; this tiny one has no kernels)
    ids = prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=20)
    outs = Engine(target, None, d, EngineConfig(max_len=256, num_draft_tokens=3)).generate(ids, params)
    plain = plain_engine(target).generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
