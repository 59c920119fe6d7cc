"""Incremental detokenisation: stream text as tokens are committed, never a broken character.

A byte-level BPE token can end in the middle of a multi-byte UTF-8 character, and a token's text
can depend on its neighbours (leading-space handling, merges of special prefixes). So text is
produced by decoding a short window of recent tokens twice, without and with the new ones, and
emitting the difference, and nothing at all while the window decodes to a trailing U+FFFD (an
incomplete character). The approach of Hugging Face text-generation-inference and vLLM
(``prefix_offset`` / ``read_offset``); reading it, not copying it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    ``prompt_tail`` primes the window with the last prompt tokens so that the first generated
    token is decoded in context (e.g. whether it starts a word). Special tokens are skipped.
    """

    def __init__(self, tokenizer: Decoder, prompt_tail: Sequence[int] = (), window: int = 6) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail[-window:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add committed tokens; return the text they complete (possibly empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # an incomplete character, or nothing printable yet: wait for more tokens
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is left, replacement characters included."""
        full = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
