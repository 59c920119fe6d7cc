"""The same guarantees on a CUDA GPU: runtime, sampling, rules, engine, certification, CLI.

Skipped where torch sees no GPU (CPU is the default everywhere; CUDA is optional). Run on a GPU
machine with ``pytest tests/integration/test_cuda.py -p no:xdist``. Each test compares the GPU
against the CPU (fp32 runtime, same weights) or against the slow reference on the GPU itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.unit.test_verify import N_CASES, _random_case, assert_same, clone_gens
from tests.unit.tiny_gguf import TinySpec, write_tiny
from verispec.certify.core import DEFAULT_ALPHA, EngineCase, certify_engine_case
from verispec.certify.tiny import tiny_config, tiny_pair
from verispec.config import EngineConfig, SamplingParams
from verispec.drafters.registry import make_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.models.transformer import Transformer, random_state_dict
from verispec.sampling import make_generator, sample, to_probs
from verispec.verify import Draft, RejectionRule
from verispec.verify.broken import AlwaysAcceptRule
from verispec.verify.reference import reference_rejection

# VERISPEC_TEST_GPU=cpu dry-runs this module's logic on the CPU.
CUDA = os.environ.get("VERISPEC_TEST_GPU", "cuda")
pytestmark = pytest.mark.skipif(CUDA == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 1, 2, 3, 4, 5, 6], [7], [2, 2, 2, 2, 2]]


def models(vocab: int = 97, dtype: torch.dtype = torch.float32) -> tuple[Transformer, Transformer]:
    config = tiny_config(vocab, hidden=64)
    state = random_state_dict(config, seed=3, std=0.2)
    return Transformer(config, state, dtype=torch.float32), Transformer(config, state, dtype=dtype, device=CUDA)


def test_ragged_forward_verify_and_rollback_match_the_cpu() -> None:
    cpu, gpu = models()
    lens = [3, 9, 6]
    batch = torch.full((3, 9), -1)
    g = torch.Generator().manual_seed(0)
    for i, n in enumerate(lens):
        batch[i, :n] = torch.randint(0, 97, (n,), generator=g)
    step = torch.randint(0, 97, (3, 5), generator=g)
    out = {}
    for name, model in (("cpu", cpu), ("gpu", gpu)):
        cache = model.new_cache(3, 64)
        dev = model.device
        pre = model(batch.to(dev), None, cache, num_new=lens, logits_at=(torch.tensor(lens)[:, None] - 1).to(dev))
        ver = model(step.to(dev), None, cache, num_new=torch.tensor([5, 2, 4]).to(dev))  # ragged verification
        cache.truncate(torch.tensor([lens[0] + 1, lens[1] + 2, lens[2]]).to(dev))  # keep 1, 2, 0 of them
        after = model(step[:, :1].to(dev), None, cache)
        out[name] = [t.cpu() for t in (pre, ver, after)]
    for a, b in zip(out["cpu"], out["gpu"], strict=True):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=0)


def test_bf16_on_cuda_is_close_to_fp32() -> None:
    cpu, gpu = models(dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = cpu(ids, None, cpu.new_cache(2, 32))
    got = gpu(ids.to(CUDA), None, gpu.new_cache(2, 32))
    assert got.dtype == torch.float32 and got.device.type == torch.device(CUDA).type
    assert (got.cpu() - ref).abs().max() < 0.1 * ref.abs().max()


def test_to_probs_on_cuda_equals_cpu_and_sampling_is_seeded() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn((6, 300), generator=g) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, logit_bias={3: 2.0}),
    ]
    ref = to_probs(logits, params)
    got = to_probs(logits.to(CUDA), params)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-6, rtol=1e-5)
    draws = [sample(got, [make_generator(s, CUDA) for s in range(6)]).cpu() for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # same seeds, same tokens
    assert (ref.gather(1, draws[0][:, None]) > 0).all()  # never a token outside the law's support


def _to_cuda(draft: Draft, target: torch.Tensor, gens: list) -> tuple[Draft, torch.Tensor, list]:
    probs = None if draft.probs is None else draft.probs.to(CUDA)
    moved: dict[int, torch.Generator] = {}
    cuda_gens = []
    for gen in gens:
        if gen is None:
            cuda_gens.append(None)
            continue
        if id(gen) not in moved:  # rows sharing one generator keep sharing it
            seed = int(torch.randint(0, 2**31, (1,), generator=gen))
            moved[id(gen)] = make_generator(seed, CUDA)
        cuda_gens.append(moved[id(gen)])
    return Draft(draft.token_ids.to(CUDA), draft.num_tokens.to(CUDA), probs), target.to(CUDA), cuda_gens


def test_rejection_rule_on_cuda_equals_the_reference() -> None:
    for case in range(N_CASES // 3):
        draft, target, gens = _to_cuda(*_random_case(case))
        fast = RejectionRule().verify(draft, target, clone_gens(gens))
        ref = reference_rejection(draft, target, clone_gens(gens))
        assert_same(fast, ref, f"case {case}")
        assert fast.output_ids.device.type == torch.device(CUDA).type


def _engine(drafter: str, device: str, k: int | None = 3) -> Engine:
    target, draft = tiny_pair(8, device=device)
    d = make_drafter(drafter, draft_model=draft, vocab_size=8, max_batch=8, max_len=300)
    return Engine(target, None, d, EngineConfig(max_batch=8, max_len=256, num_draft_tokens=k))


@pytest.mark.parametrize("drafter", ["none", "model", "ngram", "composite"])
def test_greedy_speculation_on_cuda_equals_plain_decoding_on_the_cpu(drafter: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=20)
    plain = [o.token_ids for o in _engine("none", "cpu").generate(PROMPTS, params)]
    outs = _engine(drafter, CUDA).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    if drafter != "none":
        assert sum(o.stats.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("drafter", ["model", "composite"])
def test_seed_gives_the_same_output_batched_or_alone_on_cuda(drafter: str) -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=12) for s in (1, 2, 3, 4)]
    batched = _engine(drafter, CUDA).generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, batched, strict=True):
        assert _engine(drafter, CUDA).generate([prompt], [p])[0].token_ids == out.token_ids


def test_engine_on_cuda_is_certified_and_a_broken_rule_is_caught() -> None:
    case = EngineCase("model", 2, SamplingParams(temperature=0.9, top_p=0.9), 4)
    prompt = (3, 0, 0, 1, 0, 0, 2, 0, 0)
    gof, acceptance = certify_engine_case(case, num_sequences=6_000, seed=1, prompt=prompt, device=CUDA)
    assert gof.p_value >= DEFAULT_ALPHA and acceptance > 0
    broken, _ = certify_engine_case(
        EngineCase("model", 2, SamplingParams(temperature=1.0), 4), num_sequences=6_000, seed=1, prompt=prompt,
        broken_rule=AlwaysAcceptRule(), device=CUDA,
    )  # fmt: skip
    assert broken.p_value < DEFAULT_ALPHA


def test_cli_generate_on_cuda_equals_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verispec.cli import main

    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    write_tiny(target, TinySpec(seed=1))
    write_tiny(draft, TinySpec(seed=2))
    runs = {}
    for device in ("cpu", CUDA):
        args = ["generate", "hello world", "--target", str(target), "--draft", str(draft), "--k", "3",
                "--max-tokens", "12", "--dtype", "fp32", "--device", device, "--json"]  # fmt: skip
        assert main(args) == 0
        runs[device] = json.loads(capsys.readouterr().out)
    assert runs[CUDA]["token_ids"] == runs["cpu"]["token_ids"]
    assert runs[CUDA]["spec"]["acceptance_rate"] >= 0


def test_quantized_precisions_are_refused_on_cuda_with_the_remedy() -> None:
    from verispec.formats.loader import check_precision

    with pytest.raises(ConfigError, match=r"CPU only.*--dtype bf16"):
        check_precision("int4", CUDA)
