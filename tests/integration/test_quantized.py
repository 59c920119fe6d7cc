"""The int4 / int8 precisions end to end on tiny GGUF models written in the test: which projection
runs on which kernel, exact Q4_K weights, prefill / decode / K-token verification through the
engine (greedy speculative == greedy plain, target and draft in different precisions), the packed
cache of prepared models, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.kernels import q4k_blocks, q6k_blocks, require_kernels
from tests.unit.fake_parts import install_fake_model
from tests.unit.tiny_gguf import TinySpec, gguf_name, write_tiny
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.formats import packing, registry
from verispec.formats.gguf import GGUFModel
from verispec.formats.loader import LoadedModel, load_model
from verispec.models import quantized
from verispec.models.transformer import Transformer

pytest.importorskip("gguf")

HIDDEN, FFN, LAYERS = 256, 512, 2  # Q4_K needs rows of a multiple of 256 inputs
# Projections stored as Q4_K (custom blocks); the others keep TinySpec's types below.
Q4K = [
    f"model.layers.{i}.{p}.weight"
    for i in range(LAYERS)
    for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
] + ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.v_proj.weight", "model.embed_tokens.weight"]
# Stored as Q6_K (custom blocks): int8 in "int4" unless VERISPEC_Q6K=1 reads them natively.
Q6K = ["model.layers.1.mlp.down_proj.weight"]
OTHER_TYPES = {
    "*": "Q8_0",  # the LM head (271 rows: not a multiple of 16) and layer 0's v_proj
    "model.layers.0.self_attn.v_proj.weight": "F16",
}
PROMPTS = [list(range(5, 45)), [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6]]


def spec(seed: int = 0) -> TinySpec:
    shapes = {
        "q_proj": (HIDDEN, HIDDEN), "k_proj": (128, HIDDEN), "v_proj": (128, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
        "gate_proj": (FFN, HIDDEN), "up_proj": (FFN, HIDDEN), "down_proj": (HIDDEN, FFN),
        "embed_tokens": (TinySpec().vocab, HIDDEN),
    }  # fmt: skip
    extra = {}
    for i, name in enumerate(Q4K):
        n, k = shapes[name.split(".")[-2]]
        extra[gguf_name(name)] = (q4k_blocks(n, k, seed=100 * seed + i, d=2.0**-12), "Q4_K")
    for i, name in enumerate(Q6K):
        n, k = shapes[name.split(".")[-2]]
        extra[gguf_name(name)] = (q6k_blocks(n, k, seed=100 * seed + 50 + i, d=2.0**-14), "Q6_K")
    return TinySpec(
        hidden=HIDDEN, heads=4, kv_heads=2, ffn=FFN, layers=LAYERS, types=OTHER_TYPES, seed=seed,
        skip_tensors=tuple(Q4K + Q6K), extra_tensors=extra,
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def kernels() -> object:
    return require_kernels()  # before any test points $VERISPEC_HOME elsewhere


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q4k") / "tiny-q4k.gguf"
    write_tiny(path, spec())
    return path


@pytest.fixture(scope="module")
def models(gguf_path: Path) -> dict[str, LoadedModel]:
    return {p: load_model(gguf_path, dtype=p) for p in ("fp32", "int8", "int4", "int4-all")}  # type: ignore[arg-type]


def source_tensors(prefix: str, tied: bool) -> list[str]:
    """The checkpoint tensors a projection of a loaded model computes (q/k/v and gate/up are fused
    into one projection when their kinds allow, see Transformer's cpu_kernels)."""
    if prefix == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    base, _, name = prefix.rpartition(".")
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(name, [name])
    return [f"{base}.{part}.weight" for part in parts]


def test_each_projection_runs_on_the_kernel_its_storage_type_asks_for(
    gguf_path: Path, models: dict[str, LoadedModel]
) -> None:
    gguf = GGUFModel(gguf_path)
    for precision in ("int4", "int8"):
        model = models[precision].model
        assert model.precision == precision and model.dtype == torch.bfloat16
        for prefix, lin in model.linears().items():
            sources = source_tensors(prefix, gguf.config.tie_word_embeddings)  # a fused projection has several
            for source in sources:
                stored = gguf.tensor_info(source).type_name
                assert lin.kind == ("q4k" if precision == "int4" and stored == "Q4_K" else "int8"), prefix
            exact = torch.cat([gguf.load(source, torch.float32) for source in sources])
            if lin.kind == "q4k":
                assert torch.equal(lin.dequantize(), exact), prefix  # the GGUF's weights, exactly
            else:  # one rounding per output channel
                scale = exact.abs().amax(1, keepdim=True) / 127
                assert ((lin.dequantize() - exact).abs() <= scale * (0.5 + 1e-5)).all(), prefix
    kinds = [
        lin.kind
        for name, lin in models["int4"].model.linears().items()
        for _ in source_tensors(name, gguf.config.tie_word_embeddings)
    ]
    assert kinds.count("q4k") == len(Q4K) - 1 and kinds.count("int8") == LAYERS * 7 + 1 - (len(Q4K) - 1)
    # bytes streamed per token: Q4_K 4.5 bits, int8 8 bits (+ scales) per weight
    assert models["int4"].model.weight_bytes() < models["int8"].model.weight_bytes()


def test_int4_all_runs_every_decoder_projection_on_q4k(gguf_path: Path, models: dict[str, LoadedModel]) -> None:
    gguf = GGUFModel(gguf_path)
    model = models["int4-all"].model
    for prefix, lin in model.linears().items():
        sources = source_tensors(prefix, gguf.config.tie_word_embeddings)
        exact = torch.cat([gguf.load(source, torch.float32) for source in sources])
        if prefix == "lm_head":  # as in int4: the head is cut for drafts, which Q4_K rows cannot be
            assert lin.kind == models["int4"].model.linears()[prefix].kind == "int8"
            continue
        assert lin.kind == "q4k", prefix
        if all(gguf.tensor_info(source).type_name == "Q4_K" for source in sources):
            assert torch.equal(lin.dequantize(), exact), prefix  # stored Q4_K: used as it is
        else:  # requantised: a 4-bit rounding
            assert ((lin.dequantize() - exact).pow(2).mean() / exact.pow(2).mean()).sqrt() < 0.12, prefix
    assert model.weight_bytes() < models["int4"].model.weight_bytes()


def test_quantized_logits_follow_the_fp32_reference(models: dict[str, LoadedModel]) -> None:
    tokens = torch.tensor([PROMPTS[0]])
    ref = models["fp32"].model(tokens, None, models["fp32"].model.new_cache(1, 64))
    for precision in ("int4", "int8"):
        model = models[precision].model
        got = model(tokens, None, model.new_cache(1, 64))  # prefill: 40 rows, three 16-row chunks
        assert got.dtype == torch.float32 and got.shape == ref.shape
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 0.05, (precision, err)  # bf16 activations (+ int8 rounding of some weights)
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.fixture(scope="module")
def disagreeing(models: dict[str, LoadedModel]) -> list[list[int]]:
    """Four prompts on which the int4 and int8 models' greedy continuations differ within 16 tokens
    (on PROMPTS they may agree throughout), so that verifying one by the other rejects drafts
    (unless every first difference falls on a bonus token): the first found among seeded random
    prompts."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=16)
    config = EngineConfig(max_len=128, num_draft_tokens=0)
    engines = [Engine(models[p].model, None, None, config) for p in ("int4", "int8")]
    found: list[list[int]] = []
    for _ in range(60):
        size = int(torch.randint(3, 30, (1,), generator=gen))
        prompt = torch.randint(3, models["int8"].config.vocab_size, (size,), generator=gen).tolist()
        a, b = (e.generate([prompt], params)[0].token_ids for e in engines)
        if list(a) != list(b):
            found.append(prompt)
            if len(found) == 4:
                return found
    raise AssertionError(f"int4 and int8 agree on 60 random prompts ({len(found)} found)")


def recompute_gaps(target: Transformer, prompt: list[int], tokens: list[int]) -> list[float]:
    """For each token of a greedy decode: how far its logit is below the top one when the logits
    come from a full forward over the growing sequence (no cache reuse), relative to max |logit|."""
    seq, gaps = list(prompt), []
    for token in tokens:
        logits = target(torch.tensor([seq]), None, target.new_cache(1, 128))[0, -1].float()
        gaps.append(((logits.max() - logits[token]) / logits.abs().max()).item())
        seq.append(token)
    return gaps


@pytest.mark.parametrize(
    ("target", "draft"), [("int4", "int8"), ("int8", "int4"), ("int4", "fp32"), ("int4", "int4-all")]
)
def test_greedy_speculative_equals_plain_greedy(
    models: dict[str, LoadedModel], disagreeing: list[list[int]], target: str, draft: str
) -> None:
    t, d = models[target].model, models[draft].model
    vocab = t.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = PROMPTS + disagreeing
    plain = Engine(t, None, None, EngineConfig(max_len=128, num_draft_tokens=0)).generate(prompts, params)
    drafter = make_drafter("model", draft_model=d, vocab_size=vocab, max_len=160)
    spec_engine = Engine(t, None, drafter, EngineConfig(max_len=128, num_draft_tokens=4))
    outs = spec_engine.generate(prompts, params)  # batched: verification passes of 5 rows per prompt
    for prompt, p, s in zip(prompts, plain, outs, strict=True):
        assert s.token_ids == p.token_ids, prompt
    # Cached decode == full recompute: on the kernels every row of a pass is computed from that row
    # alone, so a prefill over the whole sequence gives its last token the logits of the decode step.
    assert max(recompute_gaps(t, PROMPTS[1], list(plain[1].token_ids))) == 0
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted or draft == "fp32"  # verification both accepted and rejected


def test_native_q6k_runs_the_files_q6k_blocks_exactly(
    gguf_path: Path, models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With VERISPEC_Q6K=1 a Q6_K tensor runs on the Q6_K kernel with the file's weights exactly,
    in the one native call per layer, and greedy speculative decoding equals plain greedy."""
    monkeypatch.setenv(quantized.Q6K_ENV, "1")
    native = load_model(gguf_path, dtype="int4").model
    gguf = GGUFModel(gguf_path)
    name = Q6K[0].removesuffix(".weight")
    lin, before = native.linears()[name], models["int4"].model.linears()[name]
    assert lin.kind == "q6k" and before.kind == "int8"
    assert torch.equal(lin.dequantize(), gguf.load(Q6K[0], torch.float32))
    assert native._native_layers is not None and native.weight_bytes() < models["int4"].model.weight_bytes()
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = Engine(native, None, None, EngineConfig(max_len=128, num_draft_tokens=0)).generate(PROMPTS, params)
    drafter = make_drafter("model", draft_model=models["int8"].model, vocab_size=native.config.vocab_size, max_len=160)
    outs = Engine(native, None, drafter, EngineConfig(max_len=128, num_draft_tokens=4)).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert max(recompute_gaps(native, PROMPTS[1], list(plain[1].token_ids))) == 0


def test_prepared_models_cache_the_packed_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_path: Path
) -> None:
    fake = install_fake_model(tmp_path, monkeypatch, spec=spec())
    registry.prepare(fake.name)
    stages: list[tuple[str, int, int]] = []
    first = load_model(fake.name, dtype="int4", progress=lambda *a: stages.append(a))
    cache = fake.folder / "int4.safetensors"
    assert first.source == cache and first.precision == "int4" and stages[-1][0] == "pack"
    stamp = cache.stat().st_mtime_ns
    again = load_model(fake.name, dtype="int4")
    assert cache.stat().st_mtime_ns == stamp  # read, not rebuilt
    direct = load_model(gguf_path, dtype="int4")  # the same file packed at load time
    tokens = torch.tensor([PROMPTS[2]])
    logits = [m.model(tokens, None, m.model.new_cache(1, 32)) for m in (first, again, direct)]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert registry.read_marker(fake.folder) is not None  # the cache file does not unprepare the model
    # a cache made from another file (or by another packing format) is rebuilt
    from verispec.formats.convert import load_safetensors, write_tensors

    tensors = load_safetensors(cache)
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    write_tensors(cache, entries, tensors.items(), metadata={"packing": quantized.PACK_FORMAT, "source_sha256": "0"})
    load_model(fake.name, dtype="int4")
    assert packing.cache_path(fake.folder, "int4").stat().st_mtime_ns != stamp
    from verispec.formats.convert import read_metadata

    assert read_metadata(cache) == {"format": "pt", **_wanted(fake.entry.sha256)}
    # native Q6_K is a different cache: switching VERISPEC_Q6K rebuilds it, both ways
    monkeypatch.setenv(quantized.Q6K_ENV, "1")
    native = load_model(fake.name, dtype="int4")
    assert read_metadata(cache) == {"format": "pt", **_wanted(fake.entry.sha256), "q6k": "native"}
    assert "q6k" in {lin.kind for lin in native.model.linears().values()}
    monkeypatch.delenv(quantized.Q6K_ENV)
    load_model(fake.name, dtype="int4")
    assert read_metadata(cache) == {"format": "pt", **_wanted(fake.entry.sha256)}


def test_fused_projections_of_a_cached_model_are_views_of_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_path: Path
) -> None:
    from verispec.kernels.hugepages import HUGE_PAGES_ENV

    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)  # (a copy onto huge pages would be no view; serve sets it)
    from verispec.formats.loader import bf16_kernel_usable

    fake = install_fake_model(tmp_path, monkeypatch, spec=spec())
    registry.prepare(fake.name)
    for precision in ("int4", "int8", "bf16") if bf16_kernel_usable() else ("int4", "int8"):
        loaded = load_model(fake.name, dtype=precision)  # type: ignore[arg-type]
        direct = load_model(gguf_path, dtype=precision)  # type: ignore[arg-type]  # packed at load, in memory
        stamp = packing.cache_path(fake.folder, precision).stat().st_mtime_ns
        assert load_model(fake.name, dtype=precision).source == packing.cache_path(fake.folder, precision)  # type: ignore[arg-type]
        assert packing.cache_path(fake.folder, precision).stat().st_mtime_ns == stamp  # read, not rebuilt
        size = packing.cache_path(fake.folder, precision).stat().st_size
        for model, from_file in ((loaded.model, True), (direct.model, False)):
            fused = [m for n, m in model.named_modules() if n.endswith(("qkv_proj", "gate_up_proj"))]
            assert len(fused) >= LAYERS + 1  # gate / up in each layer, q / k / v where their kinds agree
            for module in fused:
                codes = max(module.buffers(), key=lambda b: b.numel())
                assert (codes.untyped_storage().nbytes() == size) == from_file  # the mapping, or a copy
        tokens = torch.tensor([PROMPTS[0]])
        logits = [m.model(tokens, None, m.model.new_cache(1, 64)) for m in (loaded, direct)]
        assert torch.equal(logits[0], logits[1])


def test_packing_on_a_full_disk_says_so_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    from verispec.errors import ModelLoadError

    fake = install_fake_model(tmp_path, monkeypatch, spec=spec())
    registry.prepare(fake.name)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, 1 << 30, 1 << 10))
    with pytest.raises(ModelLoadError, match=r"not enough disk space.*packed for the kernels"):
        load_model(fake.name, dtype="int8")
    assert not packing.cache_path(fake.folder, "int8").exists()
    assert not [p for p in fake.folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def _wanted(sha: str) -> dict[str, str]:
    return {"packing": quantized.PACK_FORMAT, "precision": "int4", "source_sha256": sha}


def test_int4_needs_q4k_weights() -> None:
    from tests.tiny import tiny_config
    from verispec.models.transformer import random_state_dict

    config = tiny_config(vocab=16, hidden=64)
    source = packing.WeightSource(state_dict=random_state_dict(config))
    with pytest.raises(ConfigError, match=r"no.*Q4_K|has none.*use int8 or bf16"):
        packing.plan(source, config, "int4")
    assert set(packing.plan(source, config, "int8").values()) == {"int8"}


def test_cli_generate_in_mixed_precisions(gguf_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verispec.cli import main

    common = ["generate", "def f(x):", "--target", str(gguf_path), "--max-tokens", "10", "--json"]
    assert main([*common, "--draft", str(gguf_path), "--dtype", "int4", "--draft-dtype", "int8", "--k", "3"]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main([*common, "--drafter", "none", "--dtype", "int4"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == spec_out["token_ids"]
    with pytest.raises(SystemExit) as exc:
        main([*common, "--dtype", "int2"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
