"""Medusa heads: draft tokens from the target's own last hidden state (Cai et al. 2024, "Medusa:
Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", ICML 2024).

Head ``k`` (``k = 1 .. K``) is one residual block over the target's last hidden state ``h`` (after
its final norm) at the position that produced the last committed token, followed by the target's
own, frozen LM head: ``logits_k = LMHead(h + SiLU(W_k h + b_k))`` predicts the token ``k`` places
after that committed one. The blocks start at zero (each head then predicts what the LM head
does) and are trained by ``verispec train medusa`` (:mod:`verispec.train.medusa`) on the
target's own generations. Drafting costs no second model and no second pass: the verification
pass that commits tokens also yields the hidden state that drafts the next step
(:class:`~verispec.drafters.base.TargetHiddenDrafter`), and the K heads share one pass of the
LM head over K rows.

A chain takes every head's likeliest token; a tree takes, at depth ``d``, head ``d``'s candidates
in rank order as a static shape says (Medusa's "choices": rank paths,
:class:`~verispec.drafters.tree.TreeShape`). Either way the candidates are deterministic, so the
draft is point masses (``"fixed"`` children): verified by the rejection rule's point-mass case or
recursive point-mass acceptance, lossless at every temperature.

Files: the heads' weights in safetensors (``blocks.{k}.weight`` ``[C, C]``, ``blocks.{k}.bias``
``[C]``), with a manifest in the file's metadata naming the target and a fingerprint of its
weights, so heads never load on a model they were not trained for.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafters.base import BatchView
from verispec.drafters.model import restricted_head
from verispec.drafters.trie import tree_draft
from verispec.errors import ConfigError, InputError, ModelLoadError
from verispec.models.protocol import LanguageModel
from verispec.verify.base import Draft

#: The manifest format of a heads file.
FORMAT = "verispec-medusa/1"
#: The largest heads file read (a 7B's 5 heads of 4096 x 4096 fp32 are ~340 MB).
MAX_HEADS_BYTES = 4 << 30


def target_fingerprint(model: LanguageModel) -> str:
    """What heads are tied to: the target's shape and a sample of its token embedding (dense in
    every precision, so heads trained on one precision of a model load on its others)."""
    c = model.config
    parts = [c.architecture, c.num_layers, c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads]
    digest = hashlib.sha256("|".join(map(str, parts)).encode())
    weight = model.embed_weight
    if weight is not None:
        digest.update(
            weight[:: max(1, weight.shape[0] // 64)].detach().to(torch.bfloat16).float().cpu().numpy().tobytes()
        )
    return digest.hexdigest()[:32]


class MedusaHeads(nn.Module):
    """K residual blocks over a hidden state: ``[..., C] -> [K, ..., C]`` (the LM head is the
    target's, applied by the caller)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        if hidden_size < 1 or not 1 <= num_heads <= 16:
            raise ConfigError(f"Medusa heads need a hidden size >= 1 and 1..16 heads, got {hidden_size}, {num_heads}")
        blocks = [nn.Linear(hidden_size, hidden_size) for _ in range(num_heads)]
        for block in blocks:  # each head starts as the LM head itself (Medusa's initialisation)
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        self.blocks = nn.ModuleList(blocks)
        self.hidden_size = hidden_size

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, h: Tensor) -> Tensor:  # [..., C] -> [K, ..., C]
        dtype = next(self.parameters()).dtype
        x = h.to(dtype)
        return torch.stack([x + F.silu(block(x)) for block in self.blocks])


@dataclass(frozen=True)
class HeadsManifest:
    """What a heads file says about itself."""

    num_heads: int
    hidden_size: int
    target: str  # the target's name when trained
    fingerprint: str  # :func:`target_fingerprint` of that target
    head_size: int  # vocabulary ids the heads were trained to score (the first N)
    info: dict[str, Any]  # training figures (steps, loss, accuracy per head, data), for `models list`


def write_trained(module: nn.Module, format: str, manifest: str, path: str | os.PathLike[str]) -> None:
    """Write a trained drafter's weights (fp32) and its manifest (JSON text) to ``path``
    atomically, as safetensors with ``format`` and the manifest in the metadata."""
    from pathlib import Path

    from safetensors.torch import save_file

    from verispec.formats.files import atomic_path

    tensors = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
    with atomic_path(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": format, "manifest": manifest})


def read_trained(
    path: str | os.PathLike[str],
    format: str,
    what: str,
    build: Callable[[dict[str, Any]], tuple[nn.Module, Any]],
    target: LanguageModel | None = None,
    command: str = "",
) -> tuple[nn.Module, Any]:
    """A trained drafter written by :func:`write_trained`: ``build`` makes the module and the
    manifest (which has ``target`` and ``fingerprint``) from the manifest's fields; the file's
    tensors must be exactly the module's. :class:`ModelLoadError` names the file and says it is not
    ``what`` when it is not; with ``target``, :class:`ConfigError` refuses a file trained for
    another model (``command`` trains one)."""
    from safetensors import SafetensorError, safe_open

    try:
        size = os.path.getsize(path)
        if size > MAX_HEADS_BYTES:
            raise ModelLoadError(f"{str(path)!r} is {size} bytes, more than any heads file; is it the right file?")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != format:
                raise ModelLoadError(f"{str(path)!r} is not {what}")
            module, manifest = build(json.loads(meta["manifest"]))
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (OSError, SafetensorError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {str(path)!r} as {what}: {exc}") from exc
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{str(path)!r} does not hold the weights its manifest describes: {exc}") from exc
    if target is not None and manifest.fingerprint != target_fingerprint(target):
        raise ConfigError(
            f"{str(path)!r} was trained for {manifest.target!r}, not this target; train one for it with {command}"
        )
    return module.eval(), manifest


def save_heads(heads: MedusaHeads, manifest: HeadsManifest, path: str | os.PathLike[str]) -> None:
    """Write ``heads`` and ``manifest`` to ``path`` atomically (safetensors)."""
    write_trained(heads, FORMAT, json.dumps(manifest.__dict__), path)


def load_heads(path: str | os.PathLike[str], target: LanguageModel | None = None) -> tuple[MedusaHeads, HeadsManifest]:
    """Heads and their manifest from ``path``; with ``target``, refuse heads trained for another model."""

    def build(fields: dict[str, Any]) -> tuple[nn.Module, HeadsManifest]:
        manifest = HeadsManifest(**fields)
        return MedusaHeads(int(manifest.hidden_size), int(manifest.num_heads)), manifest

    what = "a verispec Medusa heads file (train one with verispec train medusa)"
    heads, manifest = read_trained(path, FORMAT, what, build, target, "verispec train medusa")
    assert isinstance(heads, MedusaHeads) and isinstance(manifest, HeadsManifest)
    return heads, manifest


class MedusaDrafter:
    """Chains or static trees of the Medusa heads' candidates (see the module docstring)."""

    name: ClassVar[str] = "medusa"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = True
    last_catchup_tokens: int = 0  # no state to catch up: the hidden state comes with each step

    def __init__(
        self,
        target: LanguageModel,
        heads: MedusaHeads,
        *,
        vocab_size: int,
        head_size: int | None = None,
        tree: Sequence[int] | None = None,
    ) -> None:
        if heads.hidden_size != target.config.hidden_size:
            raise ConfigError(
                f"Medusa heads of hidden size {heads.hidden_size} do not fit a target of "
                f"hidden size {target.config.hidden_size}"
            )
        self.heads = heads.to(target.device)
        self.vocab_size = vocab_size
        limit = min(vocab_size, target.config.vocab_size)
        size = limit if head_size is None else max(1, min(head_size, limit))
        self.ids = torch.arange(size, device=target.device)  # [H]: the ids the heads score
        self._head = restricted_head(target, self.ids)
        self._head_dtype = target.dtype  # what the LM head takes
        self._tree = _ranked(tree) if tree is not None else None  # static tree: (parent, rank) per node
        self.depth = heads.num_heads
        self._hidden: dict[str, Tensor | None] = {}

    # ------------------------------------------------------------------------------ lifecycle
    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._hidden:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        self._hidden[request_id] = None

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self._get(request_id)  # the hidden state comes through observe_hidden

    def observe_hidden(self, request_id: str, hidden: Tensor) -> None:
        self._get(request_id)
        self._hidden[request_id] = hidden[-1]  # [C]: what predicts the tokens after the last committed one

    def end(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    def _get(self, request_id: str) -> Tensor | None:
        try:
            return self._hidden[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() first") from None

    # ------------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def candidates(self, hidden: Tensor, width: int) -> Tensor:
        """``hidden`` ``[R, C]`` -> each head's ``width`` likeliest token ids ``[R, K, width]``
        (ids within the scored head; ties to the lower id, as ``topk`` breaks them)."""
        states = self.heads(hidden)  # [K, R, C]
        scores = self._head(states.to(self._head_dtype)).float()  # [K, R, H]
        return self.ids[scores.topk(min(width, scores.shape[-1]), dim=-1).indices].transpose(0, 1)  # [R, K, W]

    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        n = len(batch)
        rows = [b for b in range(n) if max_tokens[b] > 0 and self._get(batch.request_ids[b]) is not None]
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in range(n)]
        # each row's static tree: the policy's plan for it (--tree auto), else the drafter's own (None: a chain)
        planned = batch.shapes or [None] * n
        plans = {b: _ranked(plan) if (plan := planned[b]) else self._tree for b in rows}
        if rows:
            width = 1 + max((rank for plan in plans.values() if plan for _, rank in plan), default=0)
            hidden = torch.stack([self._hidden[batch.request_ids[b]] for b in rows])  # type: ignore[misc]
            cands = self.candidates(hidden, width).tolist()  # host: the draft is built on the host
            for j, b in enumerate(rows):
                room = batch.room[b] if batch.room is not None else max_tokens[b]
                depth = min(self.depth, max_tokens[b])
                trees[b] = self._draft(cands[j], depth, room, plans[b])
        draft = tree_draft(trees)
        if all(plans[b] is None for b in rows):  # chains: no tree to declare
            return Draft(draft.token_ids, draft.num_tokens, None)
        return draft

    def _draft(
        self, cands: list[list[int]], depth: int, room: int, tree: list[tuple[int, int]] | None
    ) -> tuple[list[int], list[int]]:
        """One row's chain (top-1 of heads 1..depth) or static tree, within ``room`` nodes."""
        if tree is None:
            chain = [cands[d][0] for d in range(min(depth, room))]
            return chain, list(range(-1, len(chain) - 1))
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[int, int] = {}  # static node -> draft node
        levels: dict[int, int] = {}
        for node, (parent, rank) in enumerate(tree):
            level = 1 if parent < 0 else levels.get(parent, depth + 1) + 1
            levels[node] = level
            if level > depth or len(tokens) >= room or (parent >= 0 and parent not in index):
                continue
            index[node] = len(tokens)
            tokens.append(cands[level - 1][rank])
            parents.append(index[parent] if parent >= 0 else -1)
        return tokens, parents


def _ranked(parents: Sequence[int]) -> list[tuple[int, int]]:
    """``(parent, rank among its siblings)`` per node of a static tree."""
    from verispec.analysis import tree_paths

    return [(p, path[-1]) for p, path in zip(parents, tree_paths(parents), strict=True)]
