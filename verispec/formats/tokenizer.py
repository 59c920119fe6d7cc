"""Tokenizers from GGUF metadata or a Hugging Face folder, and chat templates.

A GGUF file carries its tokenizer as metadata (llama.cpp's keys): ``tokenizer.ggml.model``
(``gpt2`` = byte-level BPE, as Qwen2 and Llama 3 use), ``tokens`` (the vocabulary, spelled in
GPT-2's byte-to-unicode alphabet), ``merges`` (``"a b"`` pairs, best first), ``token_type``
(1 normal, 3 control, 4 user-defined, 5 unused), ``pre`` (which pre-tokenizer regex the merges
were learned with), the special token ids and ``tokenizer.chat_template`` (Jinja). We rebuild the
equivalent ``tokenizers.Tokenizer``:

- model: BPE over the vocabulary and merges, no unknown token, no byte fallback;
- pre-tokenizer: the ``pre`` regex split ("isolated"), then byte-level mapping without a prefix
  space; decoder: byte-level;
- control tokens become special added tokens (matched whole, dropped by
  ``decode(skip_special_tokens=True)``), user-defined ones plain added tokens (matched whole);
- ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` become a template post-processor.

This is what transformers' own GGUF conversion builds (``AutoTokenizer.from_pretrained(...,
gguf_file=...)``) and the tests check encode/decode equality with it. Note that it has no Unicode
normaliser, like llama.cpp, while Qwen2's original ``tokenizer.json`` applies NFC first: text
that is not in NFC (e.g. "e" + combining acute instead of "é") tokenizes differently than with
the original Hugging Face tokenizer. Pass ``nfc=True`` to :meth:`Tokenizer.from_gguf` to add it.

Chat templates render the way transformers renders them (sandboxed Jinja, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps non-ASCII, ``raise_exception``), in a
child process with time, memory and output limits (:mod:`verispec.formats.chat_template`): a
template comes with a model file and is code written by someone else.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from verispec.errors import InputError, ModelLoadError, UnsupportedModelError
from verispec.formats.chat_template import RENDERER
from verispec.formats.gguf_file import GGUFFile

#: Qwen2 / Qwen2.5 pre-tokenizer split (Qwen's tokenizer.json; llama.cpp pre = "qwen2").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Llama 3 pre-tokenizer split (Meta's tokenizer.json; llama.cpp pre = "llama-bpe"): digits in 1-3s.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: llama.cpp ``tokenizer.ggml.pre`` -> split regex; ``None`` = GPT-2's own byte-level regex.
PRE_TOKENIZERS: dict[str, str | None] = {
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "gpt-2": None,
}
_CONTROL, _USER_DEFINED = 3, 4
#: Texts of control tokens that end a generation, as llama.cpp and the models' generation configs
#: treat them (Qwen2.5 stops at <|im_end|> and <|endoftext|>).
END_OF_GENERATION_TEXTS = (
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 maps to itself)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _spelled(token: str, alphabet: set[str], table: dict[int, str]) -> str:
    """A vocabulary entry in the byte alphabet (GGUF byte-level tokens already are; respell the rest)."""
    if set(token) <= alphabet:
        return token
    return "".join(table[b] for b in token.encode("utf-8"))


def _metadata_ids(file: GGUFFile, *keys: str) -> list[int]:
    out = []
    for key in keys:
        value = file.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            out.append(value)
    return out


def build_gguf_backend(file: GGUFFile, *, nfc: bool = False) -> BackendTokenizer:
    """The ``tokenizers.Tokenizer`` a GGUF file's ``tokenizer.ggml.*`` metadata describes."""
    name = file.path.name
    model = file.get("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError(f"{name}: the file has no tokenizer (no tokenizer.ggml.model); load one from elsewhere")
    if model != "gpt2":
        raise UnsupportedModelError(
            f"{name}: tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE, "
            f"as Qwen2 and Llama 3 use)"
        )
    pre = file.get("tokenizer.ggml.pre", "gpt-2")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"{name}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens, merges = file.get("tokenizer.ggml.tokens"), file.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise ModelLoadError(f"{name}: tokenizer.ggml.tokens / merges are missing; the GGUF has no BPE tokenizer")
    types = file.get("tokenizer.ggml.token_type")
    token_types = [int(t) for t in types] if isinstance(types, np.ndarray) else []
    table = _byte_alphabet()
    alphabet = set(table.values())
    vocab = {_spelled(token, alphabet, table): i for i, token in enumerate(tokens)}
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ModelLoadError(f"{name}: tokenizer.ggml.merges entry {merge!r} is not a 'left right' pair")
        pairs.append((left, right))
    backend = BackendTokenizer(
        BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    if nfc:
        backend.normalizer = normalizers.NFC()
    split = PRE_TOKENIZERS[pre]
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would
    # grow the vocabulary past the embedding matrix, so it stays an ordinary vocabulary entry.
    backend.add_special_tokens(
        [
            AddedToken(tok, normalized=False, special=True)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == _CONTROL and set(tok) <= alphabet
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tok, normalized=False, special=False)
            for tok, kind in zip(tokens, token_types, strict=False)
            if kind == _USER_DEFINED and tok in vocab
        ]
    )
    bos, eos = _metadata_ids(file, "bos_token_id"), _metadata_ids(file, "eos_token_id")
    add_bos = file.get("tokenizer.ggml.add_bos_token") is True and bool(bos)
    add_eos = file.get("tokenizer.ggml.add_eos_token") is True and bool(eos)
    if add_bos or add_eos:
        ids = (bos[:1] if add_bos else []) + (eos[:1] if add_eos else [])
        before = [tokens[i] for i in bos[:1]] if add_bos else []
        after = [tokens[i] for i in eos[:1]] if add_eos else []
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*before, "$A:0", *after]),
            pair=" ".join([*before, "$A:0", *after, *before, "$B:1", *after]),
            special_tokens=[(tokens[i], i) for i in ids],
        )
    return backend


#: Tokenizers built from tokenizer.json contents, by SHA-256 (the last few kept).
_BACKENDS: dict[str, BackendTokenizer] = {}
_BACKENDS_KEPT = 4


def _backend_of(data: bytes) -> BackendTokenizer:
    """The tokenizer a ``tokenizer.json`` holds, built once per content and shared (a target and
    its draft usually carry the same file: building a 150k-token one takes ~0.35 s; a backend is
    never changed after it is built, and the vocabulary check of a pair sees it is the same one)."""
    digest = hashlib.sha256(data).hexdigest()
    backend = _BACKENDS.pop(digest, None)
    if backend is None:
        backend = BackendTokenizer.from_str(data.decode("utf-8"))
    _BACKENDS[digest] = backend  # (re-inserted: the most recent last)
    while len(_BACKENDS) > _BACKENDS_KEPT:
        del _BACKENDS[next(iter(_BACKENDS))]
    return backend


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and its end-of-generation ids.

    Build it with :meth:`from_gguf` or :meth:`from_hf_folder`; ``backend`` is the underlying
    ``tokenizers.Tokenizer`` (``backend.save(path)`` writes a Hugging Face ``tokenizer.json``).
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        stops = ([eos_token_id] if eos_token_id is not None else []) + list(eos_token_ids)
        #: Every id that ends a generation (EOS first), without duplicates.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | GGUFFile, *, nfc: bool = False) -> Tokenizer:
        """The tokenizer stored in a GGUF file (a path or an opened :class:`GGUFFile`)."""
        file = source if isinstance(source, GGUFFile) else GGUFFile(source)
        backend = build_gguf_backend(file, nfc=nfc)
        tokens = file.get("tokenizer.ggml.tokens")
        assert isinstance(tokens, list)
        stops = _metadata_ids(file, "eot_token_id", "eom_token_id")
        stops += [i for t in END_OF_GENERATION_TEXTS if (i := backend.token_to_id(t)) is not None]
        template = file.get("tokenizer.chat_template")
        ids = {
            k: (v[0] if (v := _metadata_ids(file, k)) else None)
            for k in ("bos_token_id", "eos_token_id", "padding_token_id")
        }
        return cls(
            backend,
            bos_token_id=ids["bos_token_id"],
            eos_token_id=ids["eos_token_id"],
            pad_token_id=ids["padding_token_id"],
            eos_token_ids=stops,
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face model folder's tokenizer: ``tokenizer.json``, with special tokens and the
        chat template from ``tokenizer_config.json`` (or ``chat_template.jinja`` /
        ``chat_template.json``) and stop ids from ``generation_config.json`` when present."""
        root = Path(folder)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{root}: no tokenizer.json; a Hugging Face 'fast' tokenizer file is required")
        try:
            backend = _backend_of(path.read_bytes())
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot be read ({exc})") from exc
        except Exception as exc:  # the Rust side raises a plain Exception for a malformed file
            raise ModelLoadError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        template = _hf_chat_template(root, config)
        eos = token_id("eos_token")
        gen_eos = generation.get("eos_token_id")
        stops = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or () if isinstance(i, int)]
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_id=eos if eos is not None else (stops[0] if stops else None),
            pad_token_id=token_id("pad_token"),
            eos_token_ids=stops,
            chat_template=template,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token texts in it (``<|im_start|>``) become their ids;
        ``add_special_tokens`` adds the BOS/EOS the model's tokenizer asks for (none for Qwen2).
        Runs through ``encode_batch``, which releases the GIL (``encode`` holds it: a long text
        would stall every other thread, a server's event loop included)."""
        return list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [list(e.ids) for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; invalid UTF-8 (a multi-byte character cut in the middle) becomes U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        value = self.backend.token_to_id(token)
        return None if value is None else int(value)

    def id_to_token(self, token_id: int) -> str | None:
        value = self.backend.id_to_token(token_id)
        return None if value is None else str(value)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``), rendered
        with the model's chat template as transformers does, in a child process with time, memory
        and output limits (:mod:`verispec.formats.chat_template`); encode it with
        ``add_special_tokens=False``. ``extra`` goes to the template as variables (JSON data).
        Raises :class:`~verispec.formats.chat_template.ChatTemplateError` when it fails."""
        if self.chat_template is None:
            raise InputError("this tokenizer has no chat template; format the prompt yourself")
        specials = {
            name: self.id_to_token(i)
            for name, i in (
                ("bos_token", self.bos_token_id),
                ("eos_token", self.eos_token_id),
                ("pad_token", self.pad_token_id),
            )
            if i is not None
        }
        plain = json.loads(json.dumps(list(messages)))  # plain JSON data; the caller's stay untouched
        plain_tools = json.loads(json.dumps(list(tools))) if tools is not None else None
        variables = {"messages": plain, "tools": plain_tools, "add_generation_prompt": add_generation_prompt}
        return RENDERER.render(self.chat_template, variables | specials | extra)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: unreadable JSON ({exc})") from exc
    return value if isinstance(value, dict) else {}


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template", _read_json(root / "chat_template.json").get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
