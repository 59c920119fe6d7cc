"""The GGUF container: header, metadata key/values and tensor directory, read without copying data.

GGUF (ggml's format, versions 2 and 3; spec: ``docs/gguf.md`` in the ggml repository) is, all
little-endian::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] (fastest-varying first),
                    u32 ggml_type, u64 offset (relative to the data section))
    padding to ``general.alignment`` (default 32) | data section

where a string is ``u64 length`` + UTF-8 bytes and an array value is ``u32 element_type``,
``u64 count``, elements. This module parses that header with :mod:`struct` and bulk numpy reads
and maps the data section once (``numpy.memmap``, read-only), so opening a 1 GB file costs well
under a second; the ``gguf`` package's ``GGUFReader`` gives the same fields (the tests compare
the two) but builds one numpy view per array element, which takes 11-14 s on a Qwen2.5 file with
its 150k-token vocabulary. Type names (``Q4_K``, ...) and block sizes come from the ``gguf``
package's constants.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: Sane bounds checked before anything is allocated: a crafted header may claim any count.
MAX_STRING_ARRAY = 1 << 24  # strings of one array (vocabularies hold ~150k)
MAX_ALIGNMENT = 1 << 16
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, rank, type, offset

#: GGUF value types -> (struct code, numpy dtype) for scalars; 8 = string, 9 = array.
_SCALARS: dict[int, tuple[str, np.dtype[Any]]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7

#: A decoded metadata value: scalars become int / float / bool / str; arrays of strings become
#: ``list[str]``; numeric arrays stay numpy arrays (1-D).
MetadataValue = int | float | bool | str | list[str] | np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFTensorEntry:
    """One tensor of the directory. ``shape`` is in PyTorch order (slowest-varying first), i.e.
    GGUF's ``dims`` reversed: a linear layer's weight is ``(out_features, in_features)``."""

    name: str
    type_name: str  # GGML type, e.g. "Q4_K", "F32"; "TYPE<n>" for ids the gguf package does not know
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads from a byte buffer; running past the end = truncation."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path, strings: bool = True) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.strings = strings  # False: arrays of strings are stepped over (value None), not decoded

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self._truncated(what, n)

    def _truncated(self, what: str, n: int) -> ModelLoadError:
        return ModelLoadError(
            f"{self.path}: truncated or corrupt GGUF header (reading {what} at byte {self.pos} "
            f"needs {n} bytes, the file has {len(self.buf)}). Re-download or re-join the file."
        )

    def scalar(self, code: str, what: str) -> Any:
        size = struct.calcsize(code)
        self._need(size, what)
        (value,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self._need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: {what} is not valid UTF-8 ({exc}); the file is corrupt") from exc

    def string_array(self, count: int, what: str) -> list[str] | None:
        # Each string takes at least its 8-byte length: a count the rest of the file cannot hold is
        # refused before a single string is built.
        if count > MAX_STRING_ARRAY or count * 8 > len(self.buf) - self.pos:
            raise ModelLoadError(
                f"{self.path}: {what} claims {count} strings, more than the file can hold; the file is corrupt"
            )
        # The hot loop of opening a model file (150k-token vocabularies): keep it tight.
        buf, pos, unpack, size = self.buf, self.pos, struct.unpack_from, len(self.buf)
        out: list[str] = []
        append = out.append
        done = 0
        try:
            if self.strings:
                for _ in range(count):
                    (n,) = unpack("<Q", buf, pos)
                    pos += 8
                    if pos + n > size:
                        break
                    append(bytes(buf[pos : pos + n]).decode("utf-8"))
                    pos += n
            else:  # only the lengths, to find where the array ends
                for done in range(count):  # noqa: B007 (done counts the strings stepped over)
                    (n,) = unpack("<Q", buf, pos)
                    if pos + 8 + n > size:
                        break
                    pos += 8 + n
                else:
                    done = count
        except struct.error:
            pass  # ran off the end: reported below
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: {what}[{len(out)}] is not valid UTF-8 ({exc})") from exc
        self.pos = pos
        if self.strings:
            done = len(out)
        if done != count:
            raise self._truncated(f"{what}[{done}]", 8)
        return out if self.strings else None

    def value(self, vtype: int, what: str) -> MetadataValue | None:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if etype == _STRING:
                return self.string_array(count, what)
            if etype not in _SCALARS:
                raise ModelLoadError(f"{self.path}: {what} is an array of unknown GGUF type {etype}")
            dtype = _SCALARS[etype][1]
            self._need(count * dtype.itemsize, what)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        if vtype not in _SCALARS:
            raise ModelLoadError(f"{self.path}: {what} has unknown GGUF value type {vtype}; the file is corrupt")
        value = self.scalar(_SCALARS[vtype][0], what)
        return bool(value) if vtype == _BOOL else value


def _type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"TYPE{type_id}"


class GGUFFile:
    """A GGUF file opened for reading: ``metadata`` (key -> value), ``tensors`` (name -> entry),
    and :meth:`data` to view a tensor's bytes without copying them. ``strings=False`` steps over
    the arrays of strings (a tokenizer's vocabulary and merges: most of the time of opening a
    file) and leaves them out of ``metadata``, for readers of the tensor directory only.

    Raises :class:`ModelLoadError` for a missing, non-GGUF, truncated or corrupt file and
    :class:`UnsupportedModelError` for a GGUF version or byte order it does not read.
    """

    def __init__(self, path: str | os.PathLike[str], *, strings: bool = True) -> None:
        self.path = Path(path)
        self._strings = strings
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such GGUF file. Check the path (or prepare the model files).")
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise ModelLoadError(f"{self.path}: {size} bytes is too short for a GGUF file")
            header = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.metadata, self.tensors, self.version, self.data_offset = self._parse(header, size)
        finally:
            header.close()
        self.file_size = size
        self._map: np.memmap[Any, np.dtype[np.uint8]] | None = None

    def _parse(
        self, buf: mmap.mmap, size: int
    ) -> tuple[dict[str, MetadataValue], dict[str, GGUFTensorEntry], int, int]:
        cur = _Cursor(buf, self.path, self._strings)
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.scalar("<I", "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            if swapped in SUPPORTED_VERSIONS:
                raise UnsupportedModelError(
                    f"{self.path}: big-endian GGUF files are not supported; convert the model on a "
                    f"little-endian machine (llama.cpp's convert_hf_to_gguf.py without --bigendian)"
                )
            raise UnsupportedModelError(
                f"{self.path}: GGUF version {version} is not supported (supported: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}); re-convert it with a current llama.cpp"
            )
        n_tensors = cur.scalar("<Q", "tensor count")
        n_kv = cur.scalar("<Q", "metadata count")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > size - cur.pos:
            raise ModelLoadError(
                f"{self.path}: the header claims {n_kv} metadata entries and {n_tensors} tensors, more than "
                f"its {size} bytes can hold; the file is corrupt or truncated"
            )
        metadata: dict[str, MetadataValue] = {}
        keys: set[str] = set()
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"type of {key}")
            if key in keys:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} appears twice; the file is corrupt")
            keys.add(key)
            value = cur.value(vtype, key)
            if value is not None:
                metadata[key] = value
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= MAX_ALIGNMENT
            or alignment & (alignment - 1)
        ):  # fmt: skip
            raise ModelLoadError(f"{self.path}: general.alignment = {alignment!r} is not a power of two up to 65536")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.scalar("<I", f"rank of {name}")
            if n_dims > 8:
                raise ModelLoadError(f"{self.path}: tensor {name} claims {n_dims} dimensions; the file is corrupt")
            dims = [cur.scalar("<Q", f"shape of {name}") for _ in range(n_dims)]
            if 0 in dims:
                raise ModelLoadError(f"{self.path}: tensor {name} has an empty dimension {dims}; the file is corrupt")
            type_id = cur.scalar("<I", f"type of {name}")
            offset = cur.scalar("<Q", f"offset of {name}")
            infos.append((name, dims, type_id, offset))
        data_offset = (cur.pos + alignment - 1) // alignment * alignment
        tensors: dict[str, GGUFTensorEntry] = {}
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise ModelLoadError(f"{self.path}: tensor {name} appears twice; the file is corrupt")
            type_name = _type_name(type_id)
            numel = math.prod(dims)  # exact: Python integers do not overflow where int64 would
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError) as exc:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name} has GGML type id {type_id}, unknown to the installed "
                    f"gguf package; upgrade it (pip install -U gguf) or use another quantisation"
                ) from exc
            if dims and dims[0] % block:
                raise ModelLoadError(f"{self.path}: tensor {name} row of {dims[0]} is not whole {type_name} blocks")
            nbytes = numel // block * type_size
            start = data_offset + offset
            if offset % alignment:
                raise ModelLoadError(f"{self.path}: tensor {name} starts at an unaligned offset; the file is corrupt")
            if start + nbytes > size:
                raise ModelLoadError(
                    f"{self.path}: truncated file: tensor {name} ends at byte {start + nbytes} but the "
                    f"file has {size} bytes. Re-download or re-join the file (check its size and sha256)."
                )
            tensors[name] = GGUFTensorEntry(name, type_name, tuple(reversed(dims)), start, nbytes)
        return metadata, tensors, version, data_offset

    def data(self, name: str) -> np.ndarray:
        """The stored bytes of tensor ``name``: a read-only uint8 view of the file, ``[rows, row_bytes]``
        (1-D ``[nbytes]`` for a 1-D tensor)."""
        entry = self.tensors[name]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        flat = self._map[entry.offset : entry.offset + entry.nbytes]
        if len(entry.shape) <= 1:
            return flat
        rows = int(np.prod(entry.shape[:-1]))
        return flat.reshape(rows, entry.nbytes // rows)

    def get(self, key: str, default: MetadataValue | None = None) -> MetadataValue | None:
        """``metadata[key]``, or ``default`` when the file does not have the key."""
        return self.metadata.get(key, default)
