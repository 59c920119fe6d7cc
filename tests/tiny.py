"""Tiny models and tokenizers built in code, for tests (nothing is ever downloaded)."""

from __future__ import annotations

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from verispec.certify.tiny import tiny_config, tiny_pair
from verispec.formats.tokenizer import Tokenizer

__all__ = ["byte_tokenizer", "tiny_config", "tiny_pair"]


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with 256 byte tokens and no merges, plus <eos> = 256."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token_id=backend.token_to_id("<eos>"))
