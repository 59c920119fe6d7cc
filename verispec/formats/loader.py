"""Load a model for the engine, whatever form it comes in: ``load_model(spec)`` -> :class:`LoadedModel`.

``spec`` is one of:

- a registry name (:mod:`verispec.formats.registry`, e.g. ``qwen2.5-coder-1.5b-instruct``) of a
  prepared model: bf16 maps ``bf16.safetensors`` (seconds; pages come in on first use, shared with
  the page cache), fp32 dequantises ``model.gguf`` (exact values, slower), int4 / int8 map the
  packed projections cached in ``int4.safetensors`` / ``int8.safetensors`` (packed from
  ``model.gguf`` on first use, see :mod:`verispec.formats.packing`) and take the rest from
  ``bf16.safetensors``; the config and tokenizer come from the folder's JSON files. A registered
  model that is not prepared raises :class:`ModelLoadError` telling the user to run
  ``verispec models prepare NAME``;
- a path to a prepared folder (one holding ``prepared.json``), loaded the same way;
- a path to a ``.gguf`` file, dequantised directly to the requested dtype (int4 / int8: its
  projections packed at load time, nothing cached);
- a path to a Hugging Face folder (``config.json``, ``*.safetensors``, ``tokenizer.json``), read by
  :func:`verispec.formats.hf.load_hf_folder` and :meth:`Tokenizer.from_hf_folder` (int8 quantises
  its weights at load time; int4 needs GGUF Q4_K weights and is refused).

Precisions (``dtype``): "fp32" (the exact reference), "bf16", and the weight-only quantised "int8"
and "int4" (activations quantised to int8 per block of 64 inputs, exact int32 sums; the CPU only,
on verispec's kernels of this CPU's tier, :mod:`verispec.kernels.dispatch`; else :class:`ConfigError`).
On a CPU whose tier is a vector one a bf16 model's projections run on the kernels
(:func:`bf16_kernel_usable`) in their layout: a prepared model's packed once into
``bf16-packed.safetensors`` and mapped from it afterwards, others repacked at load time (about a
second per GB); and bf16 / int8 / int4 models
attend through the row-by-row kernel (:class:`Transformer` built with ``cpu_kernels=True``: batch-invariant, so
greedy speculation equals greedy plain decoding in these precisions too); elsewhere bf16 runs on
torch's kernels.

A registry name wins over a folder of the same name in the current directory; write ``./NAME``
for the folder. :func:`load_pair` loads a target and its draft and checks that their vocabularies
pair (:func:`verispec.formats.vocab.check_compatible`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verispec.errors import ConfigError, ModelLoadError, VerispecError
from verispec.formats.files import ProgressFn, read_json
from verispec.formats.registry import (
    CONFIG_FILE,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    GGUF_FILE,
    MARKER_FILE,
    MODELS,
    WEIGHTS_FILE,
    get_entry,
    model_dir,
    read_marker,
)
from verispec.formats.tokenizer import Tokenizer
from verispec.formats.vocab import SharedVocab, check_compatible
from verispec.models.config import ModelConfig
from verispec.models.transformer import ROPE_FREQS_KEY, Transformer
from verispec.names import QUANTIZED, Precision

logger = logging.getLogger(__name__)

DTypeName = Precision
# What each source loader returns: config, runtime, tokenizer, file read, tokenizer vocabulary size.
_Loaded = tuple[ModelConfig, Transformer, Tokenizer, Path, int]
#: Activation dtype of each precision (int4 / int8 quantise the projections' weights only).
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "int8": torch.bfloat16,
    "int4": torch.bfloat16,
    "int4-all": torch.bfloat16,
}

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DTYPES",
    "LoadedModel",
    "ProgressFn",
    "SharedVocab",
    "check_compatible",
    "load_model",
    "load_pair",
]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: the runtime, its tokenizer and where they came from.

    ``vocab_size`` is the number of ids the tokenizer really defines; ``logits_width``
    (``config.vocab_size``) the number of logits columns the model returns, which may be larger
    (padded embeddings). See :mod:`verispec.formats.vocab` for how the engine reconciles them.
    """

    name: str  # registry name, or the file / folder name
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    source: Path  # the weights file (or folder) actually read
    dtype: torch.dtype  # of the activations (and of the weights unless quantised)
    load_seconds: float
    vocab_size: int  # ids the tokenizer defines (padding placeholders excluded), <= logits_width
    precision: str  # "fp32", "bf16", "int8", "int4" or "int4-all" (see verispec.models.quantized)

    @property
    def logits_width(self) -> int:
        """Columns of the logits the model returns (rows of its LM head)."""
        return self.config.vocab_size


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def check_precision(dtype: str, device: str) -> None:
    """Raise :class:`ConfigError` (with the remedy) unless ``dtype`` can run on ``device`` here;
    for int4 / int8 this builds the CPU kernels on first use (about a minute, once)."""
    _torch_dtype(dtype)
    if dtype in QUANTIZED:
        if device != "cpu":
            raise ConfigError(f"dtype {dtype} runs on the CPU only; use --device cpu, or --dtype bf16 on {device}")
        from verispec.kernels import load

        load()


#: Set to "0" to keep bf16 CPU projections on torch's matmul instead of verispec's kernels.
BF16_KERNEL_ENV = "VERISPEC_BF16_KERNEL"


def bf16_kernel_usable() -> bool:
    """Whether bf16 CPU projections go through :class:`verispec.kernels.Bf16Linear` here: the
    kernels build for this CPU's tier (:mod:`verispec.kernels.dispatch`), that tier is a vector one
    (amx, avx512, avx2, neon) or was asked for with ``$VERISPEC_ISA``, and ``$VERISPEC_BF16_KERNEL`` is
    not "0". Otherwise bf16 runs on torch's matmul (any CPU), with a warning when the kernels failed
    to build; a ``$VERISPEC_ISA`` that names no tier, or one this CPU cannot run, is a
    :class:`ConfigError`."""
    from verispec import kernels
    from verispec.kernels import dispatch

    if os.environ.get(BF16_KERNEL_ENV, "1") == "0":
        return False
    tier = dispatch.selected()  # a $VERISPEC_ISA this CPU cannot run is the user's error, not a fallback
    if tier.name == "portable" and not os.environ.get(dispatch.ISA_ENV):
        return False  # plain C++ is exact but slower than torch's vectorised matmul
    try:
        kernels.load()
    except ConfigError as exc:
        logger.warning("bf16 runs on torch's matmul: %s", exc)
        return False
    return True


def default_draft_dtype(dtype: DTypeName, device: str) -> DTypeName:
    """The draft model's precision when none is asked for: "int8" on a CPU where the kernels run
    and the target is not the fp32 reference (the draft's speed is all that matters there: its
    precision never changes the output's law, only how often its tokens are accepted), else
    ``dtype``."""
    if dtype == "fp32" or device != "cpu" or not bf16_kernel_usable():
        return dtype
    return "int8"


def _stage(progress: ProgressFn | None) -> Callable[[str, int, int], None] | None:
    """GGUFModel.state_dict's per-tensor callback, reported as the "load" stage."""
    if progress is None:
        return None
    return lambda _name, done, total: progress("load", done, total)


def _load_prepared(
    folder: Path, name: str, precision: str, device: str, progress: ProgressFn | None, kernels: bool
) -> _Loaded:
    from verispec.formats.convert import CONFIG_FORMAT, load_safetensors

    dtype = DTYPES[precision]

    data = read_json(folder / CONFIG_FILE)
    if data.get("format") != CONFIG_FORMAT:
        raise ModelLoadError(
            f"{folder / CONFIG_FILE}: written by another verispec version ({data.get('format')!r}); "
            f"run `verispec models prepare {name} --force`"
        )
    try:
        config = ModelConfig.from_dict(data["model_config"])
        vocab_size = int(data["tokenizer_vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{folder / CONFIG_FILE}: malformed ({exc}); run `verispec models prepare {name} --force`"
        ) from exc
    if precision in QUANTIZED or (dtype == torch.bfloat16 and kernels):
        from verispec.formats import packing

        marker = read_json(folder / MARKER_FILE)  # checked by the caller (read_marker): no second digest pass
        dense = load_safetensors(folder / WEIGHTS_FILE)
        # bf16 on the kernels: the kernel's layout cached once (a load then maps it, no repacking)
        weights = packing.WeightSource(state_dict=dense) if precision not in QUANTIZED else None
        packed = packing.load_or_pack(
            folder, folder / GGUF_FILE, str(marker.get("sha256", "")), config, precision, progress, weights
        )
        source = packing.cache_path(folder, precision)
        state = packing.merge(dense, packed)
    elif dtype == torch.bfloat16:
        source = folder / WEIGHTS_FILE
        state = load_safetensors(source)
    else:
        from verispec.formats.gguf import GGUFModel

        source = folder / GGUF_FILE
        state = GGUFModel(source).state_dict(dtype, progress=_stage(progress))
    model = Transformer(config, state, dtype=dtype, device=device, cpu_kernels=kernels)
    return config, model, Tokenizer.from_hf_folder(folder), source, vocab_size


def _load_gguf(path: Path, precision: str, device: str, progress: ProgressFn | None, kernels: bool) -> _Loaded:
    from verispec.formats.gguf import GGUFModel
    from verispec.formats.vocab import gguf_vocab_size

    dtype = DTYPES[precision]
    gguf = GGUFModel(path)
    if precision in QUANTIZED:
        from verispec.formats import packing

        packed = packing.pack(packing.WeightSource(gguf=gguf), gguf.config, precision, progress)
        prefixes = packing.packed_prefixes(packed)
        dense = {
            name: gguf.load(name, torch.float32 if name == ROPE_FREQS_KEY else dtype)
            for name in gguf.tensor_names
            if name.rpartition(".")[0] not in prefixes
        }
        state = dense | packed
    else:
        state = gguf.state_dict(dtype, progress=_stage(progress))
    model = Transformer(gguf.config, state, dtype=dtype, device=device, cpu_kernels=kernels)
    return gguf.config, model, Tokenizer.from_gguf(gguf.file), path, gguf_vocab_size(gguf.file)


def _load_hf(path: Path, precision: str, device: str, kernels: bool) -> _Loaded:
    from verispec.formats.hf import load_hf_folder  # written separately; imported only when needed

    dtype = DTYPES[precision]
    if precision in QUANTIZED:
        from verispec.formats import packing

        config, exact = load_hf_folder(path, torch.float32, device)
        packed = packing.pack(packing.WeightSource(state_dict=exact), config, precision)
        state = packing.merge(exact, packed)
    else:
        config, state = load_hf_folder(path, dtype, device)
    model = Transformer(config, state, dtype=dtype, device=device, cpu_kernels=kernels)
    tokenizer = Tokenizer.from_hf_folder(path)
    return config, model, tokenizer, path, tokenizer.vocab_size


def load_tokenizer(spec: str | os.PathLike[str], home: Path | None = None) -> Tokenizer:
    """The tokenizer of ``spec`` (a registry name of a prepared model, a ``.gguf`` file, a prepared
    or Hugging Face folder), without loading any weights."""
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text in MODELS:
        folder = model_dir(text, home)
        if read_marker(folder, get_entry(text)) is None:
            raise ModelLoadError(f"model {text!r} is not prepared; run `verispec models prepare {text}`")
        return Tokenizer.from_hf_folder(folder)
    if path.is_file():
        return Tokenizer.from_gguf(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return Tokenizer.from_hf_folder(path)
    raise ModelLoadError(
        f"{text!r} names no tokenizer: give a known model ({', '.join(MODELS)}), a .gguf file or a folder "
        "with tokenizer.json"
    )


def peek_config(spec: str | os.PathLike[str], home: Path | None = None) -> ModelConfig | None:
    """The ModelConfig of ``spec`` when it can be read without touching weights (a prepared model's
    or a Hugging Face folder's JSON), else None; a check before loading, not a loader."""
    text = os.fspath(spec)
    path = Path(text).expanduser()
    folder = model_dir(text, home) if text in MODELS else path
    try:
        if (folder / MARKER_FILE).is_file():
            return ModelConfig.from_dict(read_json(folder / CONFIG_FILE)["model_config"])
        if (folder / "config.json").is_file():
            from verispec.formats.hf import read_hf_config

            return read_hf_config(folder)
    except (VerispecError, KeyError, TypeError, ValueError):
        return None  # the loader says what is wrong with it
    return None


def has_q4k_weights(spec: str | os.PathLike[str], home: Path | None = None) -> bool:
    """Whether ``spec`` is (or was prepared from) a GGUF file with Q4_K weights, which the int4
    precision uses exactly; read from the file's header only. False when it cannot tell."""
    text = os.fspath(spec)
    path = Path(text).expanduser()
    gguf = model_dir(text, home) / GGUF_FILE if text in MODELS else path / GGUF_FILE if path.is_dir() else path
    if gguf.suffix != ".gguf" or not gguf.is_file():
        return False
    try:
        from verispec.formats.gguf_file import GGUFFile

        return any(t.type_name == "Q4_K" for t in GGUFFile(gguf, strings=False).tensors.values())
    except VerispecError:
        return False  # the loader says what is wrong with it


def load_model(
    spec: str | os.PathLike[str],
    *,
    dtype: DTypeName = "bf16",
    device: str = "cpu",
    progress: ProgressFn | None = None,
    home: Path | None = None,
) -> LoadedModel:
    """Load ``spec`` (a registry name or a path; see the module docstring) in ``dtype`` ("fp32",
    "bf16", "int8" or "int4") on ``device``. ``progress("load", done, total)`` follows
    dequantisation (GGUF sources), ``progress("pack", done, total)`` the packing of int4 / int8
    projections; ``home`` overrides ``$VERISPEC_HOME`` for registry names.
    Raises :class:`ModelLoadError` (and its subclass :class:`UnsupportedModelError`) with the fix,
    :class:`ConfigError` for a precision this machine cannot run."""
    check_precision(dtype, device)
    torch_dtype = _torch_dtype(dtype)
    start = time.perf_counter()
    # bf16 / int8 / int4 CPU models are built on the kernels where they run (the form never changes after)
    kernels = device == "cpu" and (dtype in QUANTIZED or (dtype == "bf16" and bf16_kernel_usable()))
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if text in MODELS:
        folder = model_dir(text, home)
        if read_marker(folder, get_entry(text)) is None:
            if (folder / MARKER_FILE).exists():
                raise ModelLoadError(
                    f"model {text!r} in {folder} is damaged or from another verispec version (a file differs from "
                    f"what was prepared); run `verispec models prepare {text} --force`"
                )
            raise ModelLoadError(
                f"model {text!r} is not prepared (no complete {folder}); run `verispec models prepare {text}`"
            )
        name = text
        loaded = _load_prepared(folder, text, dtype, device, progress, kernels)
    elif path.is_file():
        name = path.stem
        loaded = _load_gguf(path, dtype, device, progress, kernels)
    elif path.is_dir() and (path / MARKER_FILE).exists():
        name = path.name
        if read_marker(path) is None:
            raise ModelLoadError(
                f"{path} is an incomplete prepared model (interrupted or damaged); prepare it again with "
                f"`verispec models prepare {path.name} --force`"
            )
        loaded = _load_prepared(path, path.name, dtype, device, progress, kernels)
    elif path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        name = path.name
        loaded = _load_hf(path, dtype, device, kernels)
    elif path.is_dir():
        raise ModelLoadError(
            f"{path} is neither a prepared verispec model (prepared.json) nor a Hugging Face model folder "
            f"(config.json, *.safetensors, tokenizer.json); point at a .gguf file or one of those"
        )
    else:
        raise ModelLoadError(
            f"{text!r} is neither a known model ({', '.join(MODELS)}) nor an existing .gguf file or model "
            f"folder; see `verispec models list`"
        )
    config, model, tokenizer, source, vocab_size = loaded
    if vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{source}: the tokenizer defines {vocab_size} ids but the model has only {config.vocab_size} "
            f"embedding rows; the tokenizer does not belong to this model"
        )
    seconds = time.perf_counter() - start
    logger.info("loaded %s from %s as %s in %.2f s", name, source, dtype, seconds)
    return LoadedModel(name, config, model, tokenizer, Path(source), torch_dtype, seconds, vocab_size, dtype)


def load_pair(
    target_spec: str | os.PathLike[str] = DEFAULT_TARGET,
    draft_spec: str | os.PathLike[str] = DEFAULT_DRAFT,
    **kwargs: Any,
) -> tuple[LoadedModel, LoadedModel]:
    """``(target, draft)``, each loaded by :func:`load_model` with the same keyword arguments, and
    checked to pair by :func:`check_compatible` (:class:`IncompatibleModelsError` otherwise). The
    engine should keep ``check_compatible(target, draft).vocab_size`` to restrict both models'
    logits (see :mod:`verispec.formats.vocab`)."""
    target = load_model(target_spec, **kwargs)
    draft = load_model(draft_spec, **kwargs)
    check_compatible(target, draft)
    return target, draft
