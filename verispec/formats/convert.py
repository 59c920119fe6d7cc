"""The files of a prepared model folder: written once, atomically, and read back fast.

A prepared folder (see :mod:`verispec.formats.registry`) holds, beside the verified ``model.gguf``:

- ``bf16.safetensors``: every tensor of the GGUF model dequantised once (bit-exact, see
  :mod:`verispec.formats.dequant`) and rounded to bf16, under its Hugging Face name. The file is
  written tensor by tensor (the header first, from the tensor shapes), so converting never holds
  more than one dequantised tensor in memory. Tensors the runtime reads in fp32 whatever the model
  dtype (``model.rope_freqs``) stay F32. Reading maps the file copy-on-write
  (:func:`load_safetensors`): loading costs a header parse, pages come in on first use and are
  shared with the page cache.
- ``config.json``: ``{"format": ..., "model_config": ModelConfig.to_dict(), "tokenizer_vocab_size": N}``.
- ``tokenizer.json`` + ``tokenizer_config.json`` (special tokens, chat template) +
  ``generation_config.json`` (stop ids): what :meth:`Tokenizer.from_hf_folder` reads;
  :func:`verify_tokenizer` checks the reload is identical before the folder is marked prepared.

Safetensors layout (the ``safetensors`` package's format): ``u64 n`` little-endian, ``n`` bytes of
JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
padded with spaces to a multiple of 8), then the data, tensors back to back without holes.

Every file goes through :func:`verispec.formats.files.atomic_path`: written to a hidden temporary
file in the same folder, flushed to disk, then renamed over the final name, so a reader never sees
half a file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

from verispec.errors import ModelLoadError
from verispec.formats.files import ProgressFn, atomic_path, write_json
from verispec.formats.gguf import GGUFModel
from verispec.formats.tokenizer import Tokenizer
from verispec.kernels.hugepages import HUGE_PAGE, advise_huge_pages
from verispec.models.transformer import ROPE_FREQS_KEY

CONFIG_FORMAT = "verispec.ModelConfig/1"
#: Tensors stored in fp32 whatever the weights' dtype: the runtime reads them in fp32.
FP32_TENSORS = frozenset({ROPE_FREQS_KEY})
_ALIGN = 8
# safetensors dtype name -> (numpy dtype of the raw elements, torch dtype they are viewed as)
_DTYPES: dict[str, tuple[type[np.generic], torch.dtype]] = {
    "BF16": (np.int16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "F64": (np.float64, torch.float64),
    "I64": (np.int64, torch.int64),
    "I32": (np.int32, torch.int32),
    "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8),
}
_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int8: "I8", torch.uint8: "U8"}

#: Strings the saved tokenizer must encode exactly as the original (plus the chat rendering).
TOKENIZER_SAMPLES = (
    "",
    " ",
    "\n\n",
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "   leading and trailing   \t\ttabs",
    "1234567890 3.14159 I'm, you're, they'll",
    "héllo wörld café 日本語のテキスト Привет мир 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<tool_call>{}</tool_call> <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|> <|im_start|",
    "e\u0301 vs \u00e9 zero\u200bwidth",
)


def safetensors_bytes(model: GGUFModel, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of data :func:`write_safetensors` writes for ``model`` (the header excluded)."""
    return sum(
        math.prod(model.tensor_info(n).shape) * (4 if n in FP32_TENSORS else dtype.itemsize) for n in model.tensor_names
    )


def write_safetensors(
    model: GGUFModel,
    path: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    metadata: Mapping[str, str] | None = None,
    progress: ProgressFn | None = None,
) -> int:
    """Dequantise every tensor of ``model`` to ``dtype`` and write them to a safetensors file at
    ``path`` (atomically), one tensor in memory at a time. Returns the file size in bytes.
    ``progress("convert", bytes_written, total)`` follows the data."""
    if dtype not in _NAMES:
        raise ValueError(f"unsupported safetensors dtype {dtype}")
    # F32 tensors first: every tensor then starts at a multiple of its element size.
    names = sorted(model.tensor_names, key=lambda n: n not in FP32_TENSORS)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in names:
        torch_dtype = torch.float32 if name in FP32_TENSORS else dtype
        shape = model.tensor_info(name).shape
        size = math.prod(shape) * torch_dtype.itemsize
        header[name] = {
            "dtype": _NAMES[torch_dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    total = offset
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        out = AlignedWriter(f)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        written = 0
        for name in names:
            entry = header[name]
            tensor = model.load(name, torch.float32 if entry["dtype"] == "F32" else dtype)
            assert list(tensor.shape) == entry["shape"], name
            data = tensor.contiguous().view(-1)
            if tensor.dtype == torch.bfloat16:
                data = data.view(torch.int16)  # numpy has no bf16; the bytes are what matter
            out.write(data.numpy().data.cast("B"))
            written += entry["data_offsets"][1] - entry["data_offsets"][0]
            if progress is not None:
                progress("convert", written, total)
        out.close()
        f.flush()
        size, expected = f.tell(), 8 + len(raw) + total
        if size != expected:  # pragma: no cover - a short write raises before this
            raise ModelLoadError(f"{path}: wrote {size} bytes, expected {expected}")
    return size


def write_tensors(
    path: Path,
    entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, Tensor]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file at ``path`` (atomically) whose tensors are announced up front by
    ``entries`` (name, dtype, shape) and produced one at a time, in that order, by ``tensors``; so
    the whole file never has to be in memory. The header is padded so that the data starts at a
    multiple of 64 bytes (tensors whose sizes are multiples of 64 stay cache-line aligned).
    Returns the file size in bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 64)
    produced = iter(tensors)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        out = AlignedWriter(f)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for name, dtype, shape in entries:
            got_name, tensor = next(produced)
            if got_name != name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{path}: expected {name} {dtype} {shape}, got {got_name} {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")  # fmt: skip
            data = tensor.detach().contiguous().view(-1)
            if data.dtype == torch.bfloat16:
                data = data.view(torch.int16)  # numpy has no bf16; the bytes are what matter
            out.write(data.numpy().data.cast("B"))
        out.close()
        f.flush()
        size = f.tell()
    return size


class AlignedWriter:
    """Passes bytes on to the binary file ``f`` (written from its start) in writes that begin and
    end on multiples of ``HUGE_PAGE`` (2 MiB), the last excepted: a filesystem that keeps
    large folios in the page cache then holds the new file in 2 MiB folios, which a mapping of it
    reads through huge pages (``advise_huge_pages``); unaligned writes leave small ones behind
    until the pages are evicted. At most 2 MiB is held back, copied; longer runs go out as they are."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.pending = f, bytearray()

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.pending:
            take = min(HUGE_PAGE - len(self.pending), len(view))
            self.pending += view[:take]
            view = view[take:]
            if len(self.pending) < HUGE_PAGE:
                return
            self.f.write(self.pending)
            self.pending = bytearray()
        whole = len(view) - len(view) % HUGE_PAGE
        if whole:
            self.f.write(view[:whole])
        self.pending += view[whole:]

    def close(self) -> None:
        """Write what is held back (the file's unaligned end)."""
        self.f.write(self.pending)
        self.pending = bytearray()


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file, or ``None`` when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if n < 1 << 26 else None
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, memory-mapped copy-on-write (nothing is read until
    used; writing to a tensor never changes the file; it asks for huge pages), as views of one
    storage where their offsets allow (tensors that lie back to back can then be viewed as one).
    Raises :class:`ModelLoadError` for a file that is truncated or not safetensors."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        advise_huge_pages(mm)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        raise ModelLoadError(f"{path}: cannot be read ({exc}); re-run `verispec models prepare --force`") from exc
    fix = "the file is damaged: prepare the model again (`verispec models prepare NAME --force`)"
    if len(mm) < 8:
        raise ModelLoadError(f"{path}: {len(mm)} bytes is too short for a safetensors file; {fix}")
    (n,) = struct.unpack_from("<Q", mm, 0)
    if 8 + n > len(mm):
        raise ModelLoadError(f"{path}: header of {n} bytes runs past the end of the file; {fix}")
    try:
        header = json.loads(mm[8 : 8 + n])
    except ValueError as exc:
        raise ModelLoadError(f"{path}: malformed safetensors header ({exc}); {fix}") from exc
    base = 8 + n
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # [file bytes]: the tensors below are views of it
    out: dict[str, Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: tensor {name!r} has a malformed or unsupported entry {entry!r}") from exc
        count = math.prod(shape)
        if end - begin != count * torch_dtype.itemsize or base + end > len(mm):
            raise ModelLoadError(f"{path}: tensor {name} ({begin}..{end}) does not fit the file; {fix}")
        if (base + begin) % torch_dtype.itemsize == 0:  # one storage: adjacent tensors can be viewed as one
            out[name] = whole[base + begin : base + end].view(torch_dtype).reshape(shape)
        else:  # (safetensors does not promise aligned offsets)
            array = np.frombuffer(mm, dtype=np_dtype, count=count, offset=base + begin)
            out[name] = torch.from_numpy(array).view(torch_dtype).reshape(shape)
    return out


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Write ``tokenizer`` as a Hugging Face tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``) that :meth:`Tokenizer.from_hf_folder` reads back identically."""
    with atomic_path(folder / "tokenizer.json") as tmp:
        tokenizer.backend.save(str(tmp))

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(tokenizer.eos_token_id),
            "pad_token": text(tokenizer.pad_token_id),
            "chat_template": tokenizer.chat_template,
        },
    )
    write_json(
        folder / "generation_config.json",
        {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": list(tokenizer.eos_token_ids),
            "pad_token_id": tokenizer.pad_token_id,
        },
    )


def _added(tokenizer: Tokenizer) -> dict[int, tuple[str, bool]]:
    return {i: (t.content, bool(t.special)) for i, t in tokenizer.backend.get_added_tokens_decoder().items()}


def verify_tokenizer(original: Tokenizer, reloaded: Tokenizer, samples: Sequence[str] = TOKENIZER_SAMPLES) -> None:
    """Raise :class:`ModelLoadError` unless ``reloaded`` behaves as ``original``: same vocabulary,
    added tokens, special ids, stop ids, chat template, and the same ids for every sample (and the
    chat rendering of a short conversation)."""
    checks: list[tuple[str, object, object]] = [
        (
            "special token ids (bos, eos, pad)",
            (original.bos_token_id, original.eos_token_id, original.pad_token_id),
            (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.pad_token_id),
        ),
        ("stop ids", original.eos_token_ids, reloaded.eos_token_ids),
        ("chat template", original.chat_template, reloaded.chat_template),
        ("vocabulary size", original.vocab_size, reloaded.vocab_size),
        ("added tokens", _added(original), _added(reloaded)),
    ]
    texts = list(samples)
    if original.chat_template is not None:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write fib."}]
        texts.append(original.apply_chat_template(messages))
    for text in texts:
        checks.append((f"ids of {text[:40]!r}", original.encode(text), reloaded.encode(text)))
    for what, before, after in checks:
        if before != after:
            raise ModelLoadError(
                f"the saved tokenizer does not reload identically: {what} changed "
                f"({str(before)[:200]} -> {str(after)[:200]}); this is a verispec bug, please report it"
            )
    if original.backend.get_vocab(with_added_tokens=True) != reloaded.backend.get_vocab(with_added_tokens=True):
        raise ModelLoadError(
            "the saved tokenizer does not reload identically: the vocabulary changed; "
            "this is a verispec bug, please report it"
        )
