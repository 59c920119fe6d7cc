"""Training the EAGLE head (:mod:`verispec.drafters.eagle`) on self-distillation data
(:mod:`verispec.train.data`), the target frozen.

A sequence ``x_0 .. x_{L-1}`` with the target's features ``f_t`` gives the head's pairs
``(f_t, e(x_{t+1}))`` at positions ``t = 0 .. L - 2``. The first pass reads the true features
(teacher forcing) and predicts ``f^_{t+1}``. Drafting then reads the head's own predictions, so
training unrolls the way it drafts ("training-time test", EAGLE-3; HASS): pass ``j`` reads
``(f^_t from pass j - 1, e(x_{t+1}))`` and attends, as a draft at depth ``j`` does, to the true
pairs up to ``t - j + 1`` and to its own chain of earlier passes' pairs at ``t - j + 2 .. t``.
Each pass is trained at the answer's positions (``t + 1 >= P - 1``) on the cross-entropy of the
head's law of ``x_{t+2}`` against the target's own (its LM head on ``f_{t+1}``, restricted to the
``head_size`` ids the head scores) plus 0.1 x a smooth-L1 regression of the feature ``f_{t+1}``
(EAGLE weighs these the other way round, 0.1 : 1; with two hundred training sequences rather than
EAGLE's 68,000 conversations the token loss is what the head can afford to learn);
pass ``j`` weighs ``0.8^(j-1)``. The head starts as the identity on the feature
(:meth:`~verispec.drafters.eagle.EagleHead.start_as_identity`). AdamW with a cosine learning
rate; whole sequences are packed into a step (block-diagonal attention).

After every epoch the held-out prompts give the top-1 agreement of each depth with the target's
greedy token and the mean accepted length of a greedy chain (1 + the leading run of correct
depths, from every answer position), and the head is saved (atomically, the optimiser's state
beside it: a stopped run resumes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.drafters.eagle import EagleHead, EagleManifest, EagleShape, load_eagle, save_eagle
from verispec.drafters.heads import target_fingerprint
from verispec.errors import ConfigError
from verispec.models.protocol import LanguageModel
from verispec.train.checkpoint import load_optimiser, save_optimiser
from verispec.train.data import Sequences, load_split

#: Weight of the feature regression beside the token loss (EAGLE weighs them 1 : 0.1; EAGLE-3
#: drops the regression, which limits what the head learns; here it stays as a small term that keeps
#: the features an unrolled pass reads close to the target's).
REG_WEIGHT = 0.1
#: Weight decay of deeper unrolled passes: pass j weighs DECAY^(j-1).
DECAY = 0.8
#: Depths the held-out evaluation unrolls (a chain's accepted length is at most 1 + this).
EVAL_DEPTH = 6

Progress = Callable[[str, int, int, dict[str, float]], None]


@dataclass(frozen=True)
class EagleConfig:
    head_size: int = 32768
    intermediate_size: int | None = None  # the head's MLP width (default 2 x hidden)
    epochs: int = 3
    lr: float = 1e-3
    batch: int = 1024  # pairs per step (whole sequences)
    unroll: int = 3  # training-time-test passes
    seed: int = 0

    def __post_init__(self) -> None:
        if self.head_size < 1 or self.epochs < 1 or self.batch < 1:
            raise ConfigError("--head-size, --epochs and --batch must be >= 1")
        if not 1 <= self.unroll <= 8:
            raise ConfigError(f"--unroll must be in 1..8, got {self.unroll}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ConfigError(f"--intermediate must be >= 1, got {self.intermediate_size}")
        if not 0.0 < self.lr < 1.0:
            raise ConfigError(f"--lr must be in (0, 1), got {self.lr}")


@dataclass
class Pack:
    """Sequences packed into rows, one row per pair ``t`` (``[R]`` or ``[R, C]``)."""

    features: Tensor  # f_t
    next_ids: Tensor  # x_{t+1}: the pair's token
    positions: Tensor  # t
    seq: Tensor  # which sequence of the pack
    prev: Tensor  # the row of pair t - 1 in the same sequence, or -1
    targets: Tensor  # f_{t+1}
    labels: Tensor  # x_{t+2}, or -1 past the end
    trained: Tensor  # bool: t + 1 >= P - 1 (an answer position)


def pack(seqs: Sequences, which: list[int]) -> Pack:
    """Rows of the sequences ``which`` (each needs the prompt's features: data made by a current
    ``verispec train data``)."""
    parts: dict[str, list[Tensor]] = {k: [] for k in Pack.__dataclass_fields__}
    offset = 0
    for n, i in enumerate(which):
        tokens, p, h = seqs.tokens[i], seqs.prompt_lens[i], seqs.hidden[i]
        length = len(tokens)
        if seqs.hidden_starts[i] != 0:
            raise ConfigError(
                "this data folder keeps the answers' hidden states only; the EAGLE head also reads the "
                "prompt's: make the data again with verispec train data (into a new folder)"
            )
        t = torch.arange(length - 1)
        parts["features"].append(h[:-1])
        parts["next_ids"].append(tokens[1:])
        parts["positions"].append(t)
        parts["seq"].append(torch.full_like(t, n))
        parts["prev"].append(torch.where(t > 0, t - 1 + offset, -1))
        parts["targets"].append(h[1:])
        parts["labels"].append(torch.cat([tokens[2:], tokens.new_full((1,), -1)]))
        parts["trained"].append(t + 1 >= p - 1)
        offset += length - 1
    return Pack(**{k: torch.cat(v) for k, v in parts.items()})


def unroll(head: EagleHead, rows: Pack, embeds: Tensor, depth: int) -> list[tuple[Tensor, Tensor]]:
    """The head's passes 1..``depth`` over packed rows: per pass the predicted features ``[R, C]``
    and which rows are real (``[R]`` bool: a pass-j row needs j - 1 earlier pairs)."""
    same = rows.seq[:, None] == rows.seq[None, :]  # [R, R]
    pos = rows.positions
    features = rows.features.float()
    valid = torch.ones_like(rows.seq, dtype=torch.bool)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    out: list[tuple[Tensor, Tensor]] = []
    for j in range(1, depth + 1):
        x = head.fuse(features, embeds)
        q, k, v = head.keys_values(x, pos)
        keys.append(k)
        values.append(v)
        blocks = [same & (pos[None, :] <= pos[:, None] - (j - 1))]  # the true pairs up to t - j + 1
        blocks += [same & (pos[None, :] == pos[:, None] - (j - i)) for i in range(2, j + 1)]  # its own chain
        predicted = head.finish(x, q, torch.cat(keys), torch.cat(values), torch.cat(blocks, dim=1))
        out.append((predicted, valid))
        prev = rows.prev.clamp_min(0)
        features = torch.where((rows.prev >= 0)[:, None], predicted[prev], 0.0)  # pass j + 1 reads pass j's at t - 1
        valid = valid[prev] & (rows.prev >= 0)
    return out


def loss(head: EagleHead, rows: Pack, embeds: Tensor, lm: Tensor, depth: int) -> tuple[Tensor, list[float]]:
    """EAGLE's loss over ``depth`` unrolled passes (module docstring) and each pass's part."""
    passes = unroll(head, rows, embeds, depth)
    total = embeds.new_zeros(())
    parts = []
    with torch.no_grad():
        teacher = torch.log_softmax(rows.targets.float() @ lm.T, dim=-1)  # [R, H]
    for j, (predicted, valid) in enumerate(passes):
        use = valid & rows.trained
        if not use.any():
            parts.append(0.0)
            continue
        reg = F.smooth_l1_loss(predicted[use], rows.targets[use].float())
        student = torch.log_softmax(predicted[use] @ lm.T, dim=-1)
        cls = -(teacher[use].exp() * student).sum(-1).mean()
        part = cls + REG_WEIGHT * reg
        total = total + DECAY**j * part
        parts.append(float(part.detach()))
    return total, parts


@torch.no_grad()
def evaluate(head: EagleHead, rows: Pack, embeds: Tensor, lm: Tensor, depth: int = EVAL_DEPTH) -> dict[str, Tensor]:
    """Over one pack: per depth the number of answer positions reached and of correct drafts
    (agreement with the target's greedy token), and the sum of greedy chains' accepted lengths
    from every answer position (see the module docstring). :func:`summarise` turns sums into figures."""
    passes = unroll(head, rows, embeds, depth)
    n = len(rows.seq)
    roots = torch.nonzero(rows.trained & (rows.labels >= 0)).flatten()  # [N]
    alive = torch.ones(len(roots), dtype=torch.bool)
    reached, right = torch.zeros(depth), torch.zeros(depth)
    accepted = torch.zeros(())
    for j, (predicted, valid) in enumerate(passes):  # depth j + 1 from root r: pass j + 1 at row r + j
        at = (roots + j).clamp(max=n - 1)
        inside = (roots + j < n) & (rows.seq[at] == rows.seq[roots]) & (rows.labels[at] >= 0)
        ok = inside & valid[at] & ((predicted[at] @ lm.T).argmax(-1) == rows.labels[at])
        reached[j], right[j] = inside.sum(), ok.sum()
        alive &= ok
        accepted += alive.sum()
    return {"roots": torch.tensor(float(len(roots))), "accepted": accepted, "reached": reached, "right": right}


def summarise(sums: dict[str, Tensor]) -> dict[str, Any]:
    """Held-out figures from :func:`evaluate`'s sums over packs."""
    roots = float(sums["roots"])
    accuracy = (sums["right"] / sums["reached"].clamp_min(1)).tolist()
    return {"accuracy": accuracy, "chain_al": 1.0 + float(sums["accepted"]) / max(roots, 1.0), "positions": int(roots)}


def _batches(seqs: Sequences, size: int, gen: torch.Generator | None) -> list[list[int]]:
    """Whole sequences in a random order (``gen``; None: in order), in steps of about ``size`` pairs."""
    count = len(seqs.tokens)
    order = torch.randperm(count, generator=gen).tolist() if gen is not None else list(range(count))
    steps: list[list[int]] = [[]]
    rows = 0
    for i in order:
        if steps[-1] and rows + len(seqs.tokens[i]) - 1 > size:
            steps.append([])
            rows = 0
        steps[-1].append(i)
        rows += len(seqs.tokens[i]) - 1
    return [s for s in steps if s]


def train_eagle(
    data: Path,
    target: LanguageModel,
    out: Path,
    config: EagleConfig = EagleConfig(),
    *,
    device: str = "cpu",
    progress: Progress | None = None,
) -> EagleManifest:
    """Train an EAGLE head for ``target`` on the data folder ``data`` and save it to ``out``
    (resuming from ``out`` and its optimiser state when both are there for the same target and shape)."""
    manifest, train = load_split(data, "train")
    _, heldout = load_split(data, "heldout")
    if manifest.fingerprint != target_fingerprint(target):
        raise ConfigError(f"{data} was made with {manifest.target!r}, not this target; make data for it first")
    if not train.tokens:
        raise ConfigError(f"{data} holds no training sequences; make data with more prompts")
    if target.lm_weight is None or target.embed_weight is None:
        raise ConfigError(f"{type(target).__name__} does not expose its LM head and embedding; EAGLE needs both")
    head_size = min(config.head_size, target.config.vocab_size)
    lm = target.lm_weight[:head_size].detach().float().to(device)  # [H, C] frozen
    embed = target.embed_weight

    def embeds(rows: Pack) -> Tensor:  # [R, C] fp32: e(x_{t+1}) of each pair
        return embed.index_select(0, rows.next_ids.to(embed.device)).float().to(device)

    shape = EagleShape.for_target(target, config.intermediate_size)
    torch.manual_seed(config.seed)
    head = EagleHead(shape).start_as_identity().to(device)
    optimiser = torch.optim.AdamW(head.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed)
    steps_per_epoch = len(_batches(train, config.batch, None))
    total = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    step, first_epoch = 0, 0
    state_file = out.with_name(out.name + ".optimizer.safetensors")
    if out.is_file() and state_file.is_file():
        loaded, old = load_eagle(out, target)
        if EagleShape(**old.shape) == shape and old.head_size == head_size:
            head.load_state_dict(loaded.state_dict())
            step = load_optimiser(state_file, optimiser, head)
            first_epoch = step // steps_per_epoch
            schedule.last_epoch = step
    held = [pack(heldout, group) for group in _batches(heldout, config.batch, None)]
    info: dict[str, Any] = {
        "data": str(data), "pairs": sum(len(t) - 1 for t in train.tokens), "unroll": config.unroll,
        "heldout_sequences": len(heldout.tokens),
    }  # fmt: skip
    start = time.perf_counter()
    last_loss = math.nan
    result = EagleManifest(asdict(shape), manifest.target, manifest.fingerprint, head_size, info)
    for epoch in range(first_epoch, config.epochs):
        order = _batches(train, config.batch, gen)
        for s in range(step - epoch * steps_per_epoch, min(steps_per_epoch, len(order))):
            rows = pack(train, order[s])
            rows = Pack(**{k: v.to(device) for k, v in rows.__dict__.items()})
            total_loss, _ = loss(head, rows, embeds(rows), lm, config.unroll)
            optimiser.zero_grad(set_to_none=True)
            total_loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimiser.step()
            schedule.step()
            step += 1
            last_loss = total_loss.item()
            if progress is not None:
                progress("train", step, total, {"loss": last_loss, "epoch": epoch + 1})
        scores: dict[str, Any] = {}
        if held:
            head.eval()
            sums: dict[str, Tensor] = {}
            for group in held:
                rows = Pack(**{k: v.to(device) for k, v in group.__dict__.items()})
                for key, value in evaluate(head, rows, embeds(rows), lm).items():
                    sums[key] = sums[key] + value.cpu() if key in sums else value.cpu()
            scores = summarise(sums)
            head.train()
        info.update({"epochs": epoch + 1, "steps": step, "loss": last_loss, "seconds": time.perf_counter() - start})
        info["heldout"] = scores
        result = EagleManifest(asdict(shape), manifest.target, manifest.fingerprint, head_size, dict(info))
        save_eagle(head, result, out)
        save_optimiser(state_file, optimiser, head, step)
        if progress is not None:
            progress("epoch", epoch + 1, config.epochs, {"chain_al": float(scores.get("chain_al", 0.0))})
    return result
