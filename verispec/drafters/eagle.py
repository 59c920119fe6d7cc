"""The EAGLE head: one decoder layer that drafts by predicting the target's own features (Li et al.
2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024; dynamic
trees from "EAGLE-2", EMNLP 2024; training-time test from "EAGLE-3", 2025).

The target's last hidden state ``f_t`` (after its final norm) at position ``t`` gives the token
``x_{t+1}`` through the LM head. The head reads the pair ``(f_t, e(x_{t+1}))``, ``e`` the
target's token embedding, fuses it (``fc``: ``[2C] -> [C]``), and runs one Llama-style decoder
layer over the sequence of such pairs (its own RoPE attention and KV cache), predicting the next
feature ``f^_{t+1}``; the target's frozen LM head on ``f^_{t+1}`` gives the draft's law of
``x_{t+2}``. Drafting is autoregressive over its own features: the next input is
``(f^_{t+1}, e(drafted token))``. The pairs of committed tokens always use the target's true
features, which the verification pass computes anyway
(:class:`~verispec.drafters.base.TargetHiddenDrafter`): after a step the head's cache takes the
accepted path's true pairs (one call of the layer) and drops the drafted ones.

A chain takes the likeliest token at every level. A tree (``--tree DEPTH,EXPAND,BRANCH[,NODES]``)
grows as EAGLE-2 does: the ``EXPAND`` nodes of a level with the highest path log-probability each
get their ``BRANCH`` likeliest children, for ``DEPTH`` levels; then the ``NODES`` likeliest nodes
of all are kept (a node's score never exceeds its parent's, so they form a tree). Every candidate
is a deterministic top-k choice: point masses (``"fixed"`` children), verified by the point-mass
rules, lossless at every temperature.

The head is trained by ``verispec train eagle`` (:mod:`verispec.train.eagle`). Its file:
safetensors (``fc.*``, the layer's ``q/k/v/o``, ``gate/up/down`` and two norms) with a manifest
in the metadata (the head's shape, the target's name and fingerprint, the ids it scores).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.drafters.base import BatchView
from verispec.drafters.heads import read_trained, write_trained
from verispec.drafters.model import restricted_head
from verispec.drafters.tree import TreeShape
from verispec.drafters.trie import tree_draft
from verispec.errors import ConfigError, InputError
from verispec.models.protocol import LanguageModel
from verispec.verify.base import Draft

#: The manifest format of an EAGLE head file.
FORMAT = "verispec-eagle/1"


@dataclass(frozen=True)
class EagleShape:
    """The head's hyperparameters (attention follows the target's: heads, KV heads, head size)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size)
        if any(not isinstance(v, int) or v < 1 for v in sizes) or self.num_heads % self.num_kv_heads:
            raise ConfigError(f"an EAGLE head needs positive sizes and heads divisible by KV heads, got {sizes}")
        if self.head_dim % 2 or not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("an EAGLE head needs an even head size and a positive RoPE base and norm epsilon")

    @staticmethod
    def for_target(target: LanguageModel, intermediate_size: int | None = None) -> EagleShape:
        """The target's attention shape, and an MLP ``intermediate_size`` wide (default 2 x hidden:
        narrower than a target layer's, as a CPU pays for every weight read at each draft level)."""
        c = target.config
        return EagleShape(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, intermediate_size or 2 * c.hidden_size,
            float(c.rope_theta), float(c.rms_norm_eps),
        )  # fmt: skip


class EagleHead(nn.Module):
    """``fc`` over ``[e(x_{t+1}), f_t]``, then one decoder layer (RMSNorm, RoPE attention with
    grouped KV heads, RMSNorm, SwiGLU MLP, both residual): the predicted feature ``f^_{t+1}``."""

    inv_freq: Tensor  # [D / 2]: RoPE's frequencies

    def __init__(self, shape: EagleShape) -> None:
        super().__init__()
        c, h, kv, d = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.shape = shape
        self.fc = nn.Linear(2 * c, c)
        self.attn_norm = nn.RMSNorm(c, eps=shape.rms_norm_eps)
        self.q = nn.Linear(c, h * d)
        self.k = nn.Linear(c, kv * d)
        self.v = nn.Linear(c, kv * d)
        self.o = nn.Linear(h * d, c, bias=False)
        self.mlp_norm = nn.RMSNorm(c, eps=shape.rms_norm_eps)
        self.gate = nn.Linear(c, shape.intermediate_size, bias=False)
        self.up = nn.Linear(c, shape.intermediate_size, bias=False)
        self.down = nn.Linear(shape.intermediate_size, c, bias=False)
        inv_freq = shape.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D / 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def start_as_identity(self) -> EagleHead:
        """Start training from the head that predicts ``f^_{t+1} = f_t``: ``fc`` passes the feature
        through and both residual branches output zero (so at first the head drafts what the LM
        head says after ``x_t``, as Medusa's heads start; training learns the step ahead)."""
        c = self.shape.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, c:] = torch.eye(c)
        self.fc.bias.zero_()
        self.o.weight.zero_()
        self.down.weight.zero_()
        return self

    def on_kernels(self) -> EagleHead:
        """The head for decoding on verispec's CPU kernels: every projection weight-only int8
        (:class:`~verispec.kernels.linear.Int8Linear`, W8A8), read at about a quarter of fp32's
        bytes; activations stay fp32. A draft's numbers may differ slightly from the fp32 head's;
        its candidates remain point masses, so the output law is untouched."""
        from verispec.kernels.linear import Int8Linear

        for name in ("fc", "q", "k", "v", "o", "gate", "up", "down"):
            linear = getattr(self, name)
            setattr(self, name, Int8Linear.from_weight(linear.weight.detach().float(), _bias(linear)))
        return self

    def fuse(self, features: Tensor, embeds: Tensor) -> Tensor:
        """``[T, C]`` features and embeddings -> the layer's input ``[T, C]``."""
        fused: Tensor = self.fc(torch.cat([embeds, features], dim=-1))
        return fused

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[T, H, D]``, keys and values ``[T, Hkv, D]`` of the fused input ``x`` ``[T, C]``
        at ``positions`` ``[T]`` (RoPE applied to queries and keys)."""
        s = self.shape
        h = self.attn_norm(x)
        q = self.q(h).view(-1, s.num_heads, s.head_dim)
        k = self.k(h).view(-1, s.num_kv_heads, s.head_dim)
        v = self.v(h).view(-1, s.num_kv_heads, s.head_dim)
        angles = positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]  # [T, D / 2]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].to(x.dtype)  # [T, 1, D]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].to(x.dtype)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(self, x: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """The layer's output ``[T, C]`` for input ``x`` with queries ``q`` ``[T, H, D]`` over
        ``keys``/``values`` ``[S, Hkv, D]``, ``mask`` ``[T, S]`` (True: may attend)."""
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        v = values.repeat_interleave(group, dim=1).transpose(0, 1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask[None])  # [H, T, D]
        x = x + self.o(att.transpose(0, 1).reshape(x.shape[0], -1))
        h = self.mlp_norm(x)
        out: Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return out

    def forward(
        self, features: Tensor, embeds: Tensor, positions: Tensor, past_k: Tensor, past_v: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One call: new pairs ``[T, C]`` at ``positions`` after a cache ``past_k/v`` ``[L, Hkv, D]``;
        ``mask`` ``[T, L + T]``. Returns the predicted features ``[T, C]`` and the new keys and
        values ``[T, Hkv, D]``."""
        x = self.fuse(features, embeds)
        q, k, v = self.keys_values(x, positions)
        out = self.finish(x, q, torch.cat([past_k, k]), torch.cat([past_v, v]), mask)
        return out, k, v


def _bias(linear: nn.Module) -> Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.detach().float()


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class EagleManifest:
    """What an EAGLE head file says about itself."""

    shape: dict[str, Any]  # EagleShape's fields
    target: str
    fingerprint: str
    head_size: int  # vocabulary ids the head was trained to score (the first N)
    info: dict[str, Any] = field(default_factory=dict)  # training figures, for `models list`


def save_eagle(head: EagleHead, manifest: EagleManifest, path: str | os.PathLike[str]) -> None:
    """Write ``head`` and ``manifest`` to ``path`` atomically (safetensors)."""
    write_trained(head, FORMAT, json.dumps(asdict(manifest)), path)


def load_eagle(path: str | os.PathLike[str], target: LanguageModel | None = None) -> tuple[EagleHead, EagleManifest]:
    """A head and its manifest from ``path``; with ``target``, refuse a head trained for another model."""

    def build(fields: dict[str, Any]) -> tuple[nn.Module, EagleManifest]:
        manifest = EagleManifest(**fields)
        return EagleHead(EagleShape(**manifest.shape)), manifest

    what = "an EAGLE head (train one with verispec train eagle)"
    head, manifest = read_trained(path, FORMAT, what, build, target, "verispec train eagle")
    assert isinstance(head, EagleHead) and isinstance(manifest, EagleManifest)
    return head, manifest


@dataclass
class _Request:
    tokens: list[int]  # prompt + committed tokens
    pending: list[Tensor] = field(default_factory=list)  # target features not yet in the cache, [N, C] each
    keys: Tensor | None = None  # [L, Hkv, D]: the head's cache over the true pairs 0 .. L - 1
    values: Tensor | None = None
    root: Tensor | None = None  # [C]: the predicted feature after the last true pair


class EagleDrafter:
    """Chains or EAGLE-2 dynamic trees of the head's candidates (see the module docstring)."""

    name: ClassVar[str] = "eagle"
    proposes: ClassVar[bool] = True
    uses_target_hidden: ClassVar[bool] = True
    last_catchup_tokens: int = 0

    def __init__(
        self,
        target: LanguageModel,
        head: EagleHead,
        *,
        vocab_size: int,
        head_size: int | None = None,
        tree: TreeShape | None = None,
        max_len: int = 1 << 16,
    ) -> None:
        if head.shape.hidden_size != target.config.hidden_size:
            raise ConfigError(
                f"an EAGLE head of hidden size {head.shape.hidden_size} does not fit a target of "
                f"hidden size {target.config.hidden_size}"
            )
        if tree is not None and tree.parents is not None:
            raise ConfigError("EAGLE trees grow dynamically: give --tree DEPTH,EXPAND,BRANCH[,NODES] (e.g. 5,2,2,8)")
        embed = target.embed_weight
        if embed is None:
            raise ConfigError(f"{type(target).__name__} does not expose its token embedding; the EAGLE head needs it")
        self.device = target.device
        kernels = bool(getattr(target, "cpu_kernels", False)) and head.shape.hidden_size % 32 == 0
        self.head = copy.deepcopy(head).on_kernels() if kernels else head.to(self.device)  # (the caller's stays fp32)
        self.dtype = torch.float32 if kernels else next(head.parameters()).dtype
        self.embed = embed
        self.vocab_size = vocab_size
        limit = min(vocab_size, target.config.vocab_size)
        size = limit if head_size is None else max(1, min(head_size, limit))
        self.ids = torch.arange(size, device=self.device)  # [H]: the ids the head scores
        self._lm = restricted_head(target, self.ids)
        self._lm_dtype = target.dtype
        self.tree = tree
        self.depth = tree.depth if tree is not None else 8
        self.max_len = max_len
        self._requests: dict[str, _Request] = {}

    # ------------------------------------------------------------------------------ lifecycle
    def begin(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._requests:
            raise InputError(f"request {request_id!r} is already running; request ids must be unique")
        self._requests[request_id] = _Request(list(prompt_ids))

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        self._get(request_id).tokens += list(accepted_ids)

    def observe_hidden(self, request_id: str, hidden: Tensor) -> None:
        self._get(request_id).pending.append(hidden)

    def end(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise InputError(f"unknown request {request_id!r}: call begin() first") from None

    # ------------------------------------------------------------------------------- the head
    def _embed(self, ids: Sequence[int]) -> Tensor:  # -> [T, C]
        return self.embed.index_select(0, torch.tensor(list(ids), device=self.embed.device)).to(self.device, self.dtype)

    def _log_probs(self, features: Tensor) -> Tensor:
        """``[T, C]`` predicted features -> the draft's log-probabilities ``[T, H]`` over the scored ids."""
        return torch.log_softmax(self._lm(features.to(self._lm_dtype)).float(), dim=-1)

    def _catch_up(self, req: _Request) -> int:
        """Feed the true pairs committed since the last step (one call); returns how many."""
        if not req.pending:
            return 0
        features = torch.cat(req.pending).to(self.device, self.dtype)  # [N, C]
        req.pending = []
        start = 0 if req.keys is None else req.keys.shape[0]
        n = features.shape[0]
        if start + n != len(req.tokens) - 1:
            raise InputError(f"the EAGLE drafter got {start + n} hidden states for {len(req.tokens)} tokens")
        s = self.head.shape
        empty = features.new_zeros((0, s.num_kv_heads, s.head_dim))
        past_k = req.keys if req.keys is not None else empty
        past_v = req.values if req.values is not None else empty
        positions = torch.arange(start, start + n, device=self.device)
        mask = torch.ones((n, start + n), dtype=torch.bool, device=self.device).tril(start)  # causal
        embeds = self._embed(req.tokens[start + 1 : start + 1 + n])  # x_{t+1} of each pair t
        out, k, v = self.head(features, embeds, positions, past_k, past_v, mask)
        req.keys, req.values, req.root = torch.cat([past_k, k]), torch.cat([past_v, v]), out[-1]
        return n

    # ------------------------------------------------------------------------------- drafting
    @torch.inference_mode()
    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in range(len(batch))]
        caught = 0
        for b, request_id in enumerate(batch.request_ids):
            req = self._get(request_id)
            fed = self._catch_up(req)
            caught += fed if req.keys is not None and fed == req.keys.shape[0] else 0  # (a prompt's catch-up)
            if max_tokens[b] <= 0 or req.root is None or len(req.tokens) + 1 >= self.max_len:
                continue
            room = batch.room[b] if batch.room is not None else max_tokens[b]
            depth = min(self.depth, max_tokens[b], room)
            trees[b] = self._chain(req, depth) if self.tree is None else self._tree(req, depth, room, self.tree)
        self.last_catchup_tokens = caught
        draft = tree_draft(trees)
        return draft if self.tree is not None else Draft(draft.token_ids, draft.num_tokens, None)

    def _chain(self, req: _Request, depth: int) -> tuple[list[int], list[int]]:
        assert req.root is not None and req.keys is not None and req.values is not None
        keys, values = req.keys, req.values
        feature, tokens = req.root[None], []  # [1, C]
        for d in range(depth):
            token = int(self.ids[self._log_probs(feature)[0].argmax()])
            tokens.append(token)
            if d + 1 == depth:
                break
            at = keys.shape[0]
            mask = torch.ones((1, at + 1), dtype=torch.bool, device=self.device)
            feature, k, v = self.head(
                feature, self._embed([token]), torch.tensor([at], device=self.device), keys, values, mask
            )  # fmt: skip
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
        return tokens, list(range(-1, len(tokens) - 1))

    def _tree(self, req: _Request, depth: int, room: int, shape: TreeShape) -> tuple[list[int], list[int]]:
        """EAGLE-2: grow ``shape.expand`` nodes a level by path log-probability, ``shape.branch``
        children each, then keep the ``min(room, shape.max_nodes)`` best nodes."""
        assert req.root is not None and req.keys is not None and req.values is not None
        base = req.keys.shape[0]  # the cache's true pairs; tree entries follow
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        inputs: list[Tensor] = []  # per node: the feature its pair reads (its parent's prediction)
        entry: dict[int, int] = {}  # node -> its row among the tree's cached entries
        keys, values = req.keys, req.values
        log_p = self._log_probs(req.root[None])[0]
        top = log_p.topk(min(shape.branch, log_p.numel()))
        for lp, i in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            tokens.append(int(self.ids[i]))
            parents.append(-1)
            scores.append(lp)
            depths.append(1)
            inputs.append(req.root)
        level = list(range(len(tokens)))
        for d in range(2, depth + 1):
            grow = sorted(level, key=lambda n: -scores[n])[: shape.expand]
            t = len(grow)
            m = keys.shape[0] - base  # tree entries cached so far
            mask = torch.zeros((t, base + m + t), dtype=torch.bool, device=self.device)
            mask[:, :base] = True
            for r, node in enumerate(grow):
                a = parents[node]
                while a >= 0:  # its ancestors' entries
                    mask[r, base + entry[a]] = True
                    a = parents[a]
                mask[r, base + m + r] = True
            positions = torch.tensor([base + depths[n] - 1 for n in grow], device=self.device)
            feats, k, v = self.head(
                torch.stack([inputs[n] for n in grow]), self._embed([tokens[n] for n in grow]), positions, keys, values,
                mask,
            )  # fmt: skip
            keys, values = torch.cat([keys, k]), torch.cat([values, v])
            for r, node in enumerate(grow):
                entry[node] = m + r
            log_p = self._log_probs(feats)  # [t, H]
            top = log_p.topk(min(shape.branch, log_p.shape[-1]), dim=-1)
            level = []
            for r, node in enumerate(grow):
                for lp, i in zip(top.values[r].tolist(), top.indices[r].tolist(), strict=True):
                    level.append(len(tokens))
                    tokens.append(int(self.ids[i]))
                    parents.append(node)
                    scores.append(scores[node] + lp)
                    depths.append(d)
                    inputs.append(feats[r])
        # the best nodes; ties go to the shallower node, so a kept node's parent is always kept
        budget = min(room, shape.max_nodes)
        kept = sorted(sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n], n))[:budget])
        kept.sort(key=lambda n: (depths[n], n))  # parents before children
        index = {n: i for i, n in enumerate(kept)}
        return [tokens[n] for n in kept], [index[parents[n]] if parents[n] >= 0 else -1 for n in kept]
