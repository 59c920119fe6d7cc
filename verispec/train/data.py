"""Self-distillation data: the target's own generations and its hidden states over them.

Medusa-2 (Cai et al. 2024, §3.3) and EAGLE (Li et al. 2024) found that heads trained on the
target's *own* outputs, not on a dataset's text, match it best. For each prompt the engine
generates an answer (with speculation where a drafter is given: the output law is the target's
either way, and the sampling settings are recorded), then one teacher-forced pass over prompt +
answer records the target's last hidden state (after its final norm) at every position: what a
head sees at decode time, since on verispec's kernels a verification pass computes each token's
hidden state exactly as that prefill does. Medusa heads learn from the answer's positions; the
EAGLE head also reads the prompt's, as its layer attends to the whole context.

Layout of the output folder: ``shard-NNNNN.safetensors`` files, each holding for its sequences
``tokens.I`` (``[L]`` int32: prompt + answer) and ``hidden.I`` (``[L - S, C]`` bf16: the hidden
states at positions ``S .. L - 1``; ``S = 0``, or ``P - 1`` in folders made before the prompt's
states were kept, ``P`` the prompt's length), and ``manifest.json`` (written last, atomically):
the target and its fingerprint, the sampling settings, and per sequence its prompt index, shard,
prompt length, ``hidden_start`` S and split. The split is by
prompt (a hash of its text: about one prompt in ten is held out), never by position. A run
resumes where an interrupted one stopped: prompts already in a shard are skipped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verispec.config import SamplingParams
from verispec.drafters.heads import target_fingerprint
from verispec.engine.engine import Engine
from verispec.errors import ConfigError, ModelLoadError
from verispec.formats.files import atomic_path, read_json, write_json
from verispec.models.protocol import LanguageModel

MANIFEST = "manifest.json"
FORMAT = "verispec-train-data/1"
SHARD_SEQUENCES = 16

Progress = Callable[[int, int], None]


def held_out(prompt: str, every: int = 10) -> bool:
    """Whether a prompt belongs to the held-out split (by its text's hash: stable across runs)."""
    return int(hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest(), 16) % every == 0


@dataclass
class DataManifest:
    """What a data folder holds (``manifest.json``)."""

    target: str
    fingerprint: str
    hidden_size: int
    sampling: dict[str, Any]
    max_tokens: int
    sequences: list[dict[str, Any]] = field(default_factory=list)  # prompt, shard, key, prompt_len, split
    format: str = FORMAT

    @classmethod
    def read(cls, folder: Path) -> DataManifest:
        try:
            data = read_json(folder / MANIFEST)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}")
            return cls(**data)
        except (OSError, ValueError, TypeError, ModelLoadError) as exc:
            raise ConfigError(
                f"{folder} holds no training data verispec can read ({exc}); make it with verispec train data"
            ) from exc

    def write(self, folder: Path) -> None:
        write_json(folder / MANIFEST, asdict(self))


def teacher_forced_hidden(model: LanguageModel, tokens: Sequence[int], start: int) -> Tensor:
    """The target's last hidden states ``[L - start, C]`` at positions ``start .. L - 1`` of one
    pass over ``tokens``."""
    cache = model.new_cache(1, len(tokens) + 1)
    ids = torch.tensor([list(tokens)], dtype=torch.long, device=model.device)
    none = torch.empty((1, 0), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        hidden = model.forward_with_hidden(ids, None, cache, logits_at=none).hidden[0]  # [L, C]
    return hidden[start:].to(torch.bfloat16).cpu().clone()


def make_data(
    engine: Engine,
    model: LanguageModel,
    name: str,
    prompts: Sequence[Sequence[int]],
    texts: Sequence[str],
    out: Path,
    params: SamplingParams,
    progress: Progress | None = None,
) -> DataManifest:
    """Generate for every prompt (token ids, with ``texts`` their text for the split) and store
    the answers and hidden states in ``out`` (see the module docstring); resumes a folder that
    holds part of the same run."""
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = target_fingerprint(model)
    sampling = json.loads(json.dumps({k: v for k, v in asdict(params).items() if k not in ("seed", "stop")}))
    if (out / MANIFEST).is_file():
        manifest = DataManifest.read(out)
        if manifest.fingerprint != fingerprint or manifest.sampling != sampling:
            raise ConfigError(f"{out} holds data of another target or other sampling settings; use a new folder")
    else:
        manifest = DataManifest(name, fingerprint, model.config.hidden_size, sampling, params.max_tokens)
    done = {s["prompt"] for s in manifest.sequences}
    todo = [i for i in range(len(prompts)) if i not in done]
    shard_index = 1 + max((int(s["shard"].split("-")[1].split(".")[0]) for s in manifest.sequences), default=-1)
    if progress is not None:
        progress(len(done), len(prompts))
    for start in range(0, len(todo), SHARD_SEQUENCES):
        batch = todo[start : start + SHARD_SEQUENCES]
        tensors: dict[str, Tensor] = {}
        entries: list[dict[str, Any]] = []
        shard = f"shard-{shard_index:05d}.safetensors"
        for i in batch:
            seed = None if params.seed is None else params.seed + i
            out_ids = engine.generate([list(prompts[i])], replace(params, seed=seed))[0]
            tokens = list(prompts[i]) + list(out_ids.token_ids)
            key = str(len(entries))
            tensors[f"tokens.{key}"] = torch.tensor(tokens, dtype=torch.int32)
            tensors[f"hidden.{key}"] = teacher_forced_hidden(model, tokens, 0)
            split = "heldout" if held_out(texts[i]) else "train"
            entry = {"prompt": i, "shard": shard, "key": key, "prompt_len": len(prompts[i]), "hidden_start": 0}
            entries.append({**entry, "split": split})
            if progress is not None:
                progress(len(done) + start + len(entries), len(prompts))
        from safetensors.torch import save_file

        with atomic_path(out / shard) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT})
        manifest.sequences += entries
        manifest.write(out)  # after the shard: a manifest never names a shard that is not whole
        shard_index += 1
    return manifest


@dataclass
class Sequences:
    """Training sequences loaded from a data folder: per sequence its tokens, prompt length and
    the hidden states at positions ``hidden_start ..`` (0, or ``prompt_len - 1`` in older folders)."""

    tokens: list[Tensor]
    prompt_lens: list[int]
    hidden: list[Tensor]
    hidden_starts: list[int] = field(default_factory=list)

    def answer_hidden(self, i: int) -> Tensor:
        """Sequence ``i``'s hidden states at positions ``prompt_len - 1 ..`` (those whose next
        token belongs to the answer)."""
        return self.hidden[i][self.prompt_lens[i] - 1 - self.hidden_starts[i] :]


def load_split(folder: Path, split: str) -> tuple[DataManifest, Sequences]:
    """The sequences of one split (``train`` or ``heldout``) of a data folder."""
    from safetensors import safe_open

    manifest = DataManifest.read(folder)
    seqs = Sequences([], [], [], [])
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for entry in manifest.sequences:
        if entry["split"] == split:
            by_shard.setdefault(entry["shard"], []).append(entry)
    for shard, entries in sorted(by_shard.items()):
        path = folder / shard
        if path.name != shard or not path.is_file():  # (a manifest names files inside the folder only)
            raise ConfigError(f"{folder}: the manifest names {shard!r}, which is missing; make the data again")
        with safe_open(str(path), framework="pt") as f:
            for e in entries:
                seqs.tokens.append(f.get_tensor(f"tokens.{e['key']}").long())
                seqs.prompt_lens.append(int(e["prompt_len"]))
                seqs.hidden.append(f.get_tensor(f"hidden.{e['key']}"))
                seqs.hidden_starts.append(int(e.get("hidden_start", e["prompt_len"] - 1)))
    return manifest, seqs


def describe(folder: Path) -> str:
    """One line about a data folder, for the CLI."""
    m = DataManifest.read(folder)
    splits: dict[str, int] = {}
    for s in m.sequences:
        splits[s["split"]] = splits.get(s["split"], 0) + 1
    return f"{len(m.sequences)} sequences of {m.target} ({json.dumps(splits)}), sampling {json.dumps(m.sampling)}"
