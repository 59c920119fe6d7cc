"""Measuring the target's pass cost on this machine, once, and remembering it.

Speculation pays while a target pass over ``K + 1`` tokens costs about as much as a pass over one
(memory-bound). Whether it does depends on the hardware, the precision, the batch size and the
kernels, so it is measured, not assumed: :func:`calibrate` times target passes over a grid of batch
sizes and widths (tokens per row) — a few seconds: only the batch sizes the run uses, the fastest
of three timed passes per point after a 64-token prefill, with a progress callback — and the result
is cached under ``$VERISPEC_HOME/calibration/`` keyed by the model, its precision and device, the
thread count and the torch version. :class:`~verispec.engine.policy.MeasuredPolicy` starts from it
and refines it with the times of real steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verispec.formats.files import ProgressFn, write_json
from verispec.models.protocol import LanguageModel
from verispec.names import QUANTIZED

log = logging.getLogger(__name__)

FORMAT = 3  # 3: key_seconds; 2: the fastest of the timed passes (1: their median)


@dataclass(frozen=True)
class CostTable:
    """Seconds of one target pass by (batch size, tokens per row), measured at ``context`` cached
    tokens per row, and ``key_seconds``: what each (query row, cached key) pair adds to a pass past
    that context (attention over every layer; 0 where it was not measured)."""

    seconds: dict[tuple[int, int], float]
    context: int
    key: str
    key_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "key": self.key,
            "context": self.context,
            "seconds": [[b, w, s] for (b, w), s in sorted(self.seconds.items())],
            "key_seconds": self.key_seconds,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> CostTable:
        return CostTable(
            {(int(b), int(w)): float(s) for b, w, s in data["seconds"]}, int(data["context"]), str(data["key"]),
            float(data.get("key_seconds", 0.0)),
        )  # fmt: skip

    def relative(self, batch: int) -> dict[int, float]:
        """Cost of each width relative to width 1, for ``batch`` rows (nearest measured batch)."""
        batches = sorted({b for b, _ in self.seconds})
        nearest = min(batches, key=lambda b: abs(b - batch))
        base = self.seconds.get((nearest, 1))
        return {w: s / base for (b, w), s in self.seconds.items() if b == nearest and base}


def fingerprint(model: LanguageModel, name: str) -> str:
    """What the costs depend on: model identity and shape, precision, device, threads, torch, and
    the kernels' sources when the model runs on them."""
    c = model.config
    parts = [
        name, c.architecture, str(c.num_layers), str(c.hidden_size), str(c.intermediate_size), str(c.vocab_size),
        str(model.dtype), str(model.device), str(torch.get_num_threads()), torch.__version__,
        type(model).__name__,
    ]  # fmt: skip
    if model.precision in QUANTIZED:  # quantised weights cost differently from the dtype's dense ones
        parts.append(model.precision)
        linears = getattr(model, "linears", None)  # and by how many projections have which kind (int4 / int4-all)
        if callable(linears):
            kinds = Counter(str(getattr(m, "kind", "?")) for m in linears().values())
            parts.append(",".join(f"{k}={n}" for k, n in sorted(kinds.items())))
    if model.cpu_kernels:  # on verispec's kernels: their sources decide the costs
        from verispec.kernels.build import build_key

        parts.append("kernels " + build_key())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path(home: Path, key: str) -> Path:
    return home / "calibration" / f"{key}.json"


@torch.inference_mode()
def calibrate(
    model: LanguageModel,
    *,
    batch_sizes: Sequence[int] = (1,),
    widths: Sequence[int] = (1, 2, 3, 5, 9),
    context: int = 64,
    repeats: int = 3,
    key: str = "",
    progress: ProgressFn | None = None,
) -> CostTable:
    """Time target passes (the fastest of ``repeats`` after one warm-up) over the grid;
    ``progress`` is called as ``progress("calibrate", passes done, passes in all)`` after each pass.
    The policy refines these from the real steps' times, so a coarse grid is enough; what it
    keeps from the grid is how the widths compare, so each round times every width in turn (on a
    shared machine a slow spell then slows all widths alike, where timing one width after the
    other let a slow spell land on one width alone), and each width keeps its fastest pass: a
    neighbour on the machine only ever slows a pass, and a median of three still took one from a
    slow spell (a table cached on two Zen 4 cores priced a one-token pass of the 1.5B at 46.8 ms,
    above its 43.8 ms for three tokens; timed again, 32-37 ms against 37-40)."""
    max_batch = max(batch_sizes)
    cache = model.new_cache(max_batch, context + max(widths) + 1)
    slots = [cache.add_sequence() for _ in range(max_batch)]
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (max_batch, context), generator=gen).to(model.device)
    last = torch.zeros((max_batch, 1), dtype=torch.long, device=model.device) + context - 1
    total, done = len(batch_sizes) * len(widths) * (repeats + 1) + 1, 1
    model.forward(prompt, None, cache, slots=slots, logits_at=last)
    if progress is not None:
        progress("calibrate", done, total)
    times: dict[tuple[int, int], list[float]] = {(b, w): [] for b in batch_sizes for w in widths}
    for r in range(repeats + 1):  # (round 0 warms up)
        for batch in batch_sizes:
            for width in widths:
                tokens = torch.randint(0, vocab, (batch, width), generator=gen).to(model.device)
                start = time.perf_counter()
                model.forward(tokens, None, cache, slots=slots[:batch])
                elapsed = time.perf_counter() - start
                cache.truncate([context] * batch, slots[:batch])
                if r > 0:
                    times[(batch, width)].append(elapsed)
                done += 1
                if progress is not None:
                    progress("calibrate", done, total)
    seconds = {cell: min(samples) for cell, samples in times.items()}
    return CostTable(seconds, context, key, attention_key_seconds(model, max(widths), context))


def attention_key_seconds(model: LanguageModel, width: int, context: int, extra: int = 1024,
                          repeats: int = 5) -> float:  # fmt: skip
    """Seconds each (query row, cached key) pair adds to a pass, all layers: the kernels' attention
    (one query row at a time, as decoding steps run it) over ``width`` rows, timed with ``context``
    and ``context + extra`` keys (the fastest of ``repeats`` each), the difference per row and key,
    times the layers. Attention is the part of a pass that grows with the context, which the
    calibration's short context leaves out (an 8-token int4 pass of the 1.5B: 1.33x one at 160
    cached tokens, 1.62x at 2048). 0 for a model off the kernels (not measured: the costs keep the
    calibration's context). Milliseconds: no model pass."""
    if not model.cpu_kernels:
        return 0.0
    from verispec.kernels import load

    ops, cfg = load(), model.config
    gen = torch.Generator().manual_seed(0)
    best: list[float] = []
    for span in (context + width, context + extra + width):
        q = torch.randn(1, width, cfg.num_heads, cfg.head_dim, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(1, cfg.num_kv_heads, span, cfg.head_dim, generator=gen).to(torch.bfloat16) for _ in "kv")
        visible = torch.ones(1, width, span, dtype=torch.bool)
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            ops.attention_rows(q, k, v, visible, cfg.head_dim**-0.5)
            samples.append(time.perf_counter() - start)
        best.append(min(samples[1:]))
    return max(best[1] - best[0], 0.0) / (width * extra) * cfg.num_layers


def load_or_calibrate(model: LanguageModel, name: str, home: Path, **kwargs: Any) -> CostTable:
    """The cached table for this model and machine, or a fresh measurement (then cached)."""
    key = fingerprint(model, name)
    path = cache_path(home, key)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("format") == FORMAT and data.get("key") == key:
                return CostTable.from_dict(data)
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable calibration file %s", path)
    log.info("measuring the target's pass costs on this machine (once; cached in %s)", path)
    start = time.perf_counter()
    table = calibrate(model, key=key, **kwargs)
    log.info("measured the target's pass costs in %.1f s", time.perf_counter() - start)
    os.makedirs(path.parent, exist_ok=True)
    write_json(path, table.as_dict())
    return table
