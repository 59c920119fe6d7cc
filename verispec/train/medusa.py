"""Training Medusa heads (Cai et al. 2024, Medusa-1: the target frozen, heads alone) on
self-distillation data (:mod:`verispec.train.data`).

For a sequence ``x_0 .. x_{L-1}`` with hidden states ``h_t`` (after token ``x_t``), head ``k``
(``k = 1 .. K``) learns to predict ``x_{t+1+k}`` from ``h_t`` at every position ``t >= P - 1`` of the
answer (``P``: the prompt's length), through the target's frozen LM head restricted to its first
``head_size`` ids (labels outside it are left out: a head never proposes them, and the rule still
reaches them through the target). The loss is the heads' cross-entropies weighted ``λ^(k-1)``
(Medusa's λ = 0.8), with AdamW and a cosine learning rate. After every epoch the held-out prompts
give each head's top-1 accuracy and the mean accepted length a greedy chain of the heads would
reach there (``1 +`` the leading run of correct heads, averaged over positions), and the heads are
saved (atomically; with the optimiser's state beside them, so that a stopped run resumes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafters.heads import HeadsManifest, MedusaHeads, load_heads, save_heads, target_fingerprint
from verispec.errors import ConfigError
from verispec.models.protocol import LanguageModel
from verispec.train.checkpoint import load_optimiser, save_optimiser
from verispec.train.data import Sequences, load_split

IGNORE = -100
#: Medusa's per-head loss weight: head k weighs λ^(k-1).
HEAD_DECAY = 0.8

Progress = Callable[[str, int, int, dict[str, float]], None]


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    head_size: int = 32768
    epochs: int = 2
    lr: float = 1e-3
    batch: int = 256  # positions per step
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_heads <= 16:
            raise ConfigError(f"--heads must be in 1..16, got {self.num_heads}")
        if self.head_size < 1 or self.epochs < 1 or self.batch < 1:
            raise ConfigError("--head-size, --epochs and --batch must be >= 1")
        if not 0.0 < self.lr < 1.0:
            raise ConfigError(f"--lr must be in (0, 1), got {self.lr}")


def positions(seqs: Sequences, num_heads: int, head_size: int) -> tuple[Tensor, Tensor]:
    """Every answer position: hidden states ``[N, C]`` bf16 and labels ``[N, K]`` int64 (head
    ``k``'s token ``x_{t+1+k}``, or IGNORE past the end or outside the scored ids)."""
    hidden, labels = [], []
    for i, (tokens, p) in enumerate(zip(seqs.tokens, seqs.prompt_lens, strict=True)):
        n = len(tokens) - p  # answer tokens
        h = seqs.answer_hidden(i)  # positions p - 1 .. L - 1
        if n <= 0:
            continue
        t = torch.arange(p - 1, len(tokens) - 1)  # [n]: positions whose next token is in the answer
        target = t[:, None] + 1 + torch.arange(1, num_heads + 1)[None, :]  # [n, K]
        ok = target < len(tokens)
        lab = torch.where(ok, tokens[target.clamp(max=len(tokens) - 1)], IGNORE)
        lab = torch.where(lab < head_size, lab, IGNORE)
        hidden.append(h[:n])
        labels.append(lab)
    if not hidden:
        raise ConfigError("the training data holds no answer tokens; make data with longer answers")
    return torch.cat(hidden), torch.cat(labels)


def head_loss(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """``logits`` ``[K, B, H]``, ``labels`` ``[B, K]`` -> the weighted loss and each head's loss ``[K]``."""
    k = logits.shape[0]
    per_head = torch.stack([
        F.cross_entropy(logits[i], labels[:, i], ignore_index=IGNORE) if (labels[:, i] != IGNORE).any()
        else logits.new_zeros(()) for i in range(k)
    ])  # fmt: skip
    weights = HEAD_DECAY ** torch.arange(k, dtype=per_head.dtype, device=per_head.device)
    return (weights * per_head).sum(), per_head.detach()


@torch.no_grad()
def evaluate(heads: MedusaHeads, lm: Tensor, hidden: Tensor, labels: Tensor, batch: int = 1024) -> dict[str, Any]:
    """Top-1 accuracy of each head and the mean accepted length of a greedy chain of all heads
    (1 + the leading run of correct heads) over held-out positions."""
    correct = []
    for s in range(0, len(hidden), batch):
        h = hidden[s : s + batch].float()
        pred = (heads(h) @ lm.T).argmax(-1).T  # [B, K]
        correct.append(pred == labels[s : s + batch])
    ok = torch.cat(correct)  # [N, K]
    valid = labels != IGNORE
    accuracy = [float(ok[valid[:, k], k].float().mean()) if valid[:, k].any() else 0.0 for k in range(ok.shape[1])]
    run = torch.cumprod((ok & valid).int(), dim=1).sum(1).float()  # leading correct heads
    return {"accuracy": accuracy, "chain_al": 1.0 + float(run.mean()) if len(run) else 1.0, "positions": len(run)}


def train_medusa(
    data: Path,
    target: LanguageModel,
    out: Path,
    config: MedusaConfig = MedusaConfig(),
    *,
    device: str = "cpu",
    progress: Progress | None = None,
) -> HeadsManifest:
    """Train Medusa heads for ``target`` on the data folder ``data`` and save them to ``out``
    (resuming from ``out`` and its optimiser state when both are there for the same target)."""
    manifest, train = load_split(data, "train")
    _, heldout = load_split(data, "heldout")
    if manifest.fingerprint != target_fingerprint(target):
        raise ConfigError(f"{data} was made with {manifest.target!r}, not this target; make data for it first")
    head_size = min(config.head_size, target.config.vocab_size)
    hidden, labels = positions(train, config.num_heads, head_size)
    eval_hidden, eval_labels = (
        positions(heldout, config.num_heads, head_size) if heldout.tokens else (hidden[:0], labels[:0])
    )
    if target.lm_weight is None:
        raise ConfigError(f"{type(target).__name__} does not expose its LM head; Medusa heads need it")
    lm = target.lm_weight[:head_size].detach().float().to(device)  # [H, C] frozen
    gen = torch.Generator().manual_seed(config.seed)
    heads = MedusaHeads(target.config.hidden_size, config.num_heads).to(device)
    optimiser = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(len(hidden) / config.batch)
    total = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    step, first_epoch = 0, 0
    state_file = out.with_name(out.name + ".optimizer.safetensors")
    if out.is_file() and state_file.is_file():
        loaded, old = load_heads(out, target)
        if old.num_heads == config.num_heads and old.head_size == head_size:
            heads.load_state_dict(loaded.state_dict())
            step = load_optimiser(state_file, optimiser, heads)
            first_epoch = step // steps_per_epoch
            schedule.last_epoch = step
    info: dict[str, Any] = {"data": str(data), "positions": len(hidden), "heldout_positions": len(eval_hidden)}
    start = time.perf_counter()
    for epoch in range(first_epoch, config.epochs):
        order = torch.randperm(len(hidden), generator=gen)
        for s in range(step - epoch * steps_per_epoch, steps_per_epoch):
            idx = order[s * config.batch : (s + 1) * config.batch]
            h, y = hidden[idx].float().to(device), labels[idx].to(device)
            loss, _ = head_loss(heads(h) @ lm.T, y)  # (loss: a tensor with a graph until the next step)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            schedule.step()
            step += 1
            if progress is not None:
                progress("train", step, total, {"loss": loss.item(), "epoch": epoch + 1})
        scores = evaluate(heads, lm, eval_hidden.to(device), eval_labels.to(device)) if len(eval_hidden) else {}
        info.update({"epochs": epoch + 1, "steps": step, "loss": loss.item(), "seconds": time.perf_counter() - start})
        info["heldout"] = scores
        manifest_out = HeadsManifest(
            config.num_heads, target.config.hidden_size, manifest.target, manifest.fingerprint, head_size, dict(info)
        )
        save_heads(heads, manifest_out, out)
        save_optimiser(state_file, optimiser, heads, step)
        if progress is not None:
            progress("epoch", epoch + 1, config.epochs, {"chain_al": float(scores.get("chain_al", 0.0))})
    return HeadsManifest(
        config.num_heads, target.config.hidden_size, manifest.target, manifest.fingerprint, head_size, info
    )
