"""Resumable training: the optimiser's state beside the weights, so that a stopped run goes on
where it stopped (the weights themselves are saved by each drafter's own writer)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def save_optimiser(path: Path, optimiser: torch.optim.Optimizer, module: nn.Module, step: int) -> None:
    """AdamW's moments of ``module``'s parameters and the step count, atomically (safetensors)."""
    from safetensors.torch import save_file

    from verispec.formats.files import atomic_path

    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {}
    for group in optimiser.param_groups:
        for p in group["params"]:
            st = optimiser.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"{names[id(p)]}.{key}"] = st[key].detach().cpu().contiguous()
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"step": str(step)})


def load_optimiser(path: Path, optimiser: torch.optim.Optimizer, module: nn.Module) -> int:
    """Restore what :func:`save_optimiser` wrote into ``optimiser``; returns the step count."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        step = int((f.metadata() or {}).get("step", "0"))
        for name, p in module.named_parameters():
            if f"{name}.exp_avg" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                optimiser.state[p] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": f.get_tensor(f"{name}.exp_avg").to(p.device),
                    "exp_avg_sq": f.get_tensor(f"{name}.exp_avg_sq").to(p.device),
                }
    return step
