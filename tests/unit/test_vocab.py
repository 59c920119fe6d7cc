"""check_compatible (tokenizers differing in one token, in size, in special tokens; padded
embeddings), gguf_vocab_size, and the logits restriction that puts both laws on one support."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("gguf")
from tests.unit.tiny_gguf import TinySpec, tokenizer_tokens, write_tiny
from verispec.config import SamplingParams
from verispec.errors import IncompatibleModelsError, InputError
from verispec.formats.convert import save_tokenizer
from verispec.formats.gguf_file import GGUFFile
from verispec.formats.tokenizer import Tokenizer
from verispec.formats.vocab import SharedVocab, check_compatible, gguf_vocab_size, mask_logits, restrict_logits
from verispec.sampling import to_probs


@dataclass(frozen=True)
class Model:
    """The part of a LoadedModel check_compatible reads."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    logits_width: int


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "tiny.gguf"
    write_tiny(path, TinySpec())
    return path


@pytest.fixture(scope="module")
def tok(tiny: Path) -> Tokenizer:
    return Tokenizer.from_gguf(tiny)


def edited(tok: Tokenizer, folder: Path, edit: Callable[[dict[str, Any]], None]) -> Tokenizer:
    """``tok`` saved as tokenizer.json, the JSON edited in place, and reloaded."""
    folder.mkdir()
    save_tokenizer(tok, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return Tokenizer.from_hf_folder(folder)


def model(name: str, tok: Tokenizer, vocab: int, width: int | None = None) -> Model:
    return Model(name, tok, vocab, width if width is not None else vocab)


def test_gguf_vocab_size_drops_trailing_unused_placeholders(tiny: Path, tok: Tokenizer) -> None:
    tokens, types = tokenizer_tokens()
    assert tokens[-1] == "[PAD0]" and types[-1] == 5
    assert gguf_vocab_size(GGUFFile(tiny)) == len(tokens) - 1 == tok.vocab_size - 1


def test_identical_tokenizers_pair_even_with_different_padding(tok: Tokenizer) -> None:
    n = tok.vocab_size - 1
    shared = check_compatible(model("target", tok, n, 320), model("draft", tok, n, 300))
    assert shared == SharedVocab(vocab_size=n, target_width=320, draft_width=300)
    # Restricted logits of both models have the same width, and the laws the same support.
    target_logits, draft_logits = torch.randn(2, 3, 320), torch.randn(2, 3, 300)
    t = restrict_logits(target_logits, shared.vocab_size)
    d = restrict_logits(draft_logits, shared.vocab_size)
    assert t.shape[-1] == d.shape[-1] == n
    assert t.data_ptr() == target_logits.data_ptr()  # a view, no copy
    params = [SamplingParams(temperature=0.7)] * 6
    probs = to_probs(t.reshape(6, n), params)
    assert probs.shape == (6, n) and torch.allclose(probs.sum(-1), torch.ones(6))


def test_one_differing_token_is_named(tok: Tokenizer, tmp_path: Path) -> None:
    victim = tok.token_to_id("in")
    assert victim is not None

    def rename(data: dict[str, Any]) -> None:
        vocab = data["model"]["vocab"]
        vocab["iN"] = vocab.pop("in")
        data["model"]["merges"] = [m for m in data["model"]["merges"] if m not in (["i", "n"], "i n")]

    other = edited(tok, tmp_path / "other", rename)
    assert other.id_to_token(victim) == "iN"
    n = tok.vocab_size - 1
    with pytest.raises(IncompatibleModelsError) as info:
        check_compatible(model("big", tok, n), model("small", other, n))
    message = str(info.value)
    assert f"target {n} tokens, draft {n} tokens" in message
    assert f"first differing token id {victim}: target 'in', draft 'iN'" in message
    assert "'big'" in message and "'small'" in message


def test_different_sizes_are_refused_naming_both(tok: Tokenizer) -> None:
    n = tok.vocab_size - 1
    with pytest.raises(IncompatibleModelsError) as info:
        check_compatible(model("t", tok, n), model("d", tok, n - 3))
    message = str(info.value)
    assert f"target {n} tokens, draft {n - 3} tokens" in message
    assert f"first differing token id {n - 3}: target '{tok.id_to_token(n - 3)}', draft None" in message


def test_different_special_tokens(tok: Tokenizer, tmp_path: Path) -> None:
    n = tok.vocab_size - 1

    def with_eos(eos: int) -> Tokenizer:
        return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)

    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert im_start is not None and im_end is not None
    with pytest.raises(IncompatibleModelsError, match=r"EOS id 268 \(target\) vs 267 \(draft\)"):
        check_compatible(model("t", with_eos(im_end), n), model("d", with_eos(im_start), n))

    def demote(data: dict[str, Any]) -> None:
        for added in data["added_tokens"]:
            if added["content"] == "<|im_start|>":
                added["special"] = False

    other = edited(tok, tmp_path / "demoted", demote)
    with pytest.raises(IncompatibleModelsError, match=f"special .control. tokens: first at id {im_start}"):
        check_compatible(model("t", tok, n), model("d", other, n))


def test_tokenizer_larger_than_logits(tok: Tokenizer) -> None:
    n = tok.vocab_size - 1
    with pytest.raises(IncompatibleModelsError, match=f"defines {n} ids but the model returns only {n - 1}"):
        check_compatible(model("t", tok, n, n - 1), model("d", tok, n))


def test_restrict_and_mask() -> None:
    logits = torch.randn(2, 5, 10)
    assert restrict_logits(logits, 10) is logits
    assert torch.equal(restrict_logits(logits, 7), logits[..., :7])
    masked = mask_logits(logits, 7)
    assert masked.shape == logits.shape and torch.isneginf(masked[..., 7:]).all()
    assert torch.equal(masked[..., :7], logits[..., :7]) and not torch.isneginf(logits).any()
    probs = masked.softmax(-1)
    assert (probs[..., 7:] == 0).all()
    assert torch.allclose(probs[..., :7], restrict_logits(logits, 7).softmax(-1))
    for bad in (0, 11):
        with pytest.raises(InputError, match="cannot restrict 10 logits columns"):
            restrict_logits(logits, bad)
