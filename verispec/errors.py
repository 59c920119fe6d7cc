"""Typed errors of verispec.

Every error a user can cause is a :class:`VerispecError`; its message says what went wrong *and*
what to do about it. Errors caused by bad values are also :class:`ValueError`, so generic callers
that catch ``ValueError`` keep working. The CLI turns any of them into one line on stderr and exit
status 2; the server turns them into a 4xx answer with an OpenAI-style error body.
"""

from __future__ import annotations


class VerispecError(Exception):
    """Base class of every error verispec raises on purpose."""


class ConfigError(VerispecError, ValueError):
    """An invalid setting or parameter (sampling parameters, draft length, rule options, ...).

    ``param`` names the offending parameter when one is to blame (the server reports it in the
    error body's ``param`` field)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputError(VerispecError, ValueError):
    """Invalid data handed to a library function: NaN logits, tensors whose shapes or vocabulary
    sizes do not match, probability rows that do not sum to 1, token ids out of range."""


class ModelLoadError(VerispecError):
    """A model file (GGUF, safetensors, tokenizer) could not be read: missing, truncated, not the
    format it claims, or missing metadata the runtime needs. The message names the file and the
    fix (re-download or re-join the file, convert it with a current llama.cpp, ...)."""


class UnsupportedModelError(ModelLoadError):
    """A well-formed model file that uses something verispec does not implement: an architecture,
    a quantisation type, a tokenizer model or pre-tokenizer. The message names what was found and
    lists what is supported."""


class IncompatibleModelsError(VerispecError, ValueError):
    """A draft model cannot propose tokens for a target model: their tokenizers differ (vocabulary
    size, the text of some token id, or the special tokens). The message names both sizes and the
    first differing token id with both texts; pick a draft from the target's model family."""
