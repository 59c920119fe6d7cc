"""Retrieval drafting: trees of what followed the current suffix in a datastore of the user's text
or code (REST, He et al. 2024, "REST: Retrieval-Based Speculative Decoding", NAACL 2024), and in
the request's own prompt and output.

The datastore is every text file under a path (a repository, a folder of documents), tokenised
with the target's tokenizer and concatenated, documents separated by a value no token has, with a
suffix array over the tokens (built by libdivsufsort through ``pydivsufsort``: O(N) time, 4 or 8
bytes per token). Each step the drafter takes the longest suffix of the request's tokens, from
``max_n`` tokens down to ``min_n``, that occurs in the datastore: its occurrences are one
contiguous range of the suffix array, found by binary search. The continuations of up to
``max_matches`` occurrences (evenly spaced over the range, so each continuation's share of them
is its share of all of them: the suffix array sorts the occurrences by what follows) are merged
into a trie whose likeliest nodes (at most ``spec_factor`` times the match's length, as
SuffixDecoding sizes its drafts) become a tree of ``"fixed"`` children
(:mod:`verispec.drafters.trie`), verified by recursive point-mass acceptance: the target's law is
kept whatever the datastore holds. The request's own earlier occurrences of the suffix join the
datastore's (up to ``max_matches`` of each), so text the answer copies from its prompt is drafted
too, as prompt lookup would.

A datastore is built once per (files, tokenizer) and cached; :func:`text_files` reads
only regular text files (UTF-8, no NUL byte), skips hidden names and symbolic links, and is
bounded in bytes per file and in all.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
from numpy.typing import NDArray

from verispec.drafters.trie import ContinuationDrafter
from verispec.errors import ConfigError

#: Between documents in the datastore: no token id is negative, so no match crosses it.
SEPARATOR = -1
#: Default bounds of what a datastore reads.
MAX_FILE_BYTES = 4 << 20
MAX_TOTAL_BYTES = 256 << 20
#: Format of the cached datastore files (the tokens and the suffix array).
FORMAT = 1

Encode = Callable[[Sequence[str]], list[list[int]]]


@dataclass(frozen=True)
class DatastoreFiles:
    """The text files a datastore reads, found by :func:`text_files`, and their digest."""

    root: Path
    texts: list[tuple[str, str]]  # (path relative to root, text)
    skipped: int  # files left out: binary, not UTF-8, too large, links, hidden
    digest: str  # sha256 over every (relative path, text)


def text_files(
    path: str | os.PathLike[str], max_file_bytes: int = MAX_FILE_BYTES, max_total_bytes: int = MAX_TOTAL_BYTES
) -> DatastoreFiles:
    """The text files at ``path`` (a file, or every file under a folder, in sorted order)."""
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"--datastore {str(path)!r} does not exist; give a folder of text or code, or a text file")
    texts: list[tuple[str, str]] = []
    skipped = total = 0
    digest = hashlib.sha256()
    for file in _walk(root):
        try:
            if file.is_symlink() or not file.is_file() or file.stat().st_size > max_file_bytes:
                skipped += 1
                continue
            data = file.read_bytes()
        except OSError:
            skipped += 1
            continue
        if b"\0" in data[:8192]:
            skipped += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        total += len(data)
        if total > max_total_bytes:
            raise ConfigError(
                f"--datastore {str(path)!r} holds more than {max_total_bytes >> 20} MiB of text; "
                "point it at a smaller folder"
            )
        name = file.relative_to(root).as_posix() if file != root else file.name
        digest.update(name.encode("utf-8", "surrogatepass") + b"\0" + data + b"\0")
        texts.append((name, text))
    if not texts:
        raise ConfigError(
            f"--datastore {str(path)!r} holds no readable text file (UTF-8, at most {max_file_bytes >> 20} MiB each)"
        )
    return DatastoreFiles(root, texts, skipped, digest.hexdigest())


def _walk(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        yield root
        return
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                yield Path(folder) / name


class Datastore:
    """Token ids of a corpus with their suffix array (see the module docstring)."""

    def __init__(self, tokens: NDArray[np.int32], suffixes: NDArray[np.integer]) -> None:
        if tokens.ndim != 1 or suffixes.shape != tokens.shape:
            raise ConfigError("a datastore needs 1-D tokens and a suffix array of the same length")
        self.tokens = tokens  # [N] int32, documents separated by SEPARATOR
        self.suffixes = suffixes  # [N]: start of the i-th smallest suffix

    @classmethod
    def build(cls, documents: Sequence[Sequence[int]]) -> Datastore:
        """The datastore of these token sequences."""
        try:
            from pydivsufsort import divsufsort
        except ImportError:
            raise ConfigError(
                "the retrieval drafter's index needs pydivsufsort: pip install 'verispec[retrieval]'"
            ) from None

        pieces: list[NDArray[np.int32]] = []
        for doc in documents:
            if len(doc):
                pieces += [np.asarray(doc, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        if tokens.size and int(tokens[tokens != SEPARATOR].min(initial=0)) < 0:
            raise ConfigError("token ids must be >= 0")
        suffixes = divsufsort(tokens) if tokens.size else np.zeros(0, dtype=np.int64)
        return cls(tokens, suffixes)

    @classmethod
    def from_files(
        cls, files: DatastoreFiles, encode: Encode, cache: Path | None = None, tokenizer_id: str = ""
    ) -> Datastore:
        """The datastore of ``files`` tokenised by ``encode``; read from / written to the folder
        ``cache`` (keyed by the files' digest and ``tokenizer_id``) when given."""
        key = hashlib.sha256(f"{FORMAT}\0{tokenizer_id}\0{files.digest}".encode()).hexdigest()[:32]
        file = cache / f"{key}.npz" if cache is not None else None
        if file is not None and file.is_file():
            try:
                with np.load(file, allow_pickle=False) as saved:
                    return cls(saved["tokens"], saved["suffixes"])
            except (OSError, ValueError, KeyError):
                pass  # damaged: build it again
        store = cls.build(encode([text for _, text in files.texts]))
        if file is not None:
            from verispec.formats.files import atomic_path

            file.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(file) as tmp, open(tmp, "wb") as f:
                np.savez(f, tokens=store.tokens, suffixes=store.suffixes)
        return store

    def __len__(self) -> int:
        return int(self.tokens.size)

    def _compare(self, start: int, pattern: Sequence[int]) -> int:
        """-1, 0 or 1 as the suffix at ``start``, cut to ``len(pattern)``, sorts before, equals
        or sorts after ``pattern`` (a shorter suffix sorts first)."""
        got = self.tokens[start : start + len(pattern)].tolist()
        if got == list(pattern):
            return 0
        return -1 if got < list(pattern) else 1

    def occurrences(self, pattern: Sequence[int]) -> tuple[int, int]:
        """The range ``[lo, hi)`` of the suffix array whose suffixes start with ``pattern``."""
        lo, hi = 0, len(self)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if self._compare(int(self.suffixes[mid]), pattern) < 0:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(self)
        while lo < hi:  # first suffix > pattern
            mid = (lo + hi) // 2
            if self._compare(int(self.suffixes[mid]), pattern) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def continuations(self, lo: int, hi: int, length: int, depth: int, limit: int) -> list[list[int]]:
        """The ``depth`` tokens after the ``length``-token match of up to ``limit`` occurrences in
        ``[lo, hi)`` (evenly spaced), each cut at the end of its document."""
        count = hi - lo
        picks = range(lo, hi) if count <= limit else (lo + (i * count) // limit for i in range(limit))
        out = []
        for i in picks:
            start = int(self.suffixes[i]) + length
            seq = self.tokens[start : start + depth].tolist()
            if SEPARATOR in seq:
                seq = seq[: seq.index(SEPARATOR)]
            out.append(seq)
        return out


class RetrievalDrafter(ContinuationDrafter):
    """Trees of what followed the current suffix in a datastore (see the module docstring)."""

    name: ClassVar[str] = "retrieval"

    def __init__(
        self,
        datastore: Datastore,
        *,
        min_n: int = 2,
        max_n: int = 12,
        depth: int = 8,
        max_nodes: int = 16,
        min_share: float = 0.1,
        max_matches: int = 64,
        spec_factor: float = 2.0,
    ) -> None:
        super().__init__(
            min_n=min_n, max_n=max_n, depth=depth, max_nodes=max_nodes, min_share=min_share, max_matches=max_matches,
            spec_factor=spec_factor,
        )  # fmt: skip
        self.datastore = datastore

    def elsewhere(self, suffix: Sequence[int]) -> list[Sequence[int]]:
        """What followed ``suffix`` in the datastore (up to ``max_matches`` occurrences, evenly spaced)."""
        lo, hi = self.datastore.occurrences(list(suffix))
        return list(self.datastore.continuations(lo, hi, len(suffix), self.depth, self.max_matches)) if hi > lo else []
