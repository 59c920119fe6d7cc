"""verispec: speculative decoding that keeps the target's output distribution exactly.

A cheap drafter proposes K *draft tokens*; the target scores them all in one forward pass; an
acceptance rule keeps the *accepted tokens* and emits one more: a *recovered token* (drawn from the
residual ``norm(max(0, target_probs - draft_probs))`` at the first rejection) or a *bonus token*
(drawn from the target after full acceptance). *Output tokens* per step: accepted + 1, between 1
and K + 1.

Glossary: ``draft_probs`` / ``target_probs`` are the drafter's and the target's laws (never bare
p/q). AR (acceptance rate) = accepted / drafted. AL (mean acceptance length) = 1 + accepted / steps.
c = draft cost per token / target verification cost.

References: Leviathan, Kalman, Matias (2023) "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. (2023) "Accelerating Large Language Model Decoding with Speculative
Sampling"; Cai et al. (2024) "Medusa"; Holtzman et al. (2020) nucleus sampling.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public names and the module that defines each. They load on first use (PEP 562), so that
# `import verispec` and commands that need no tensors (`verispec analyze`) do not import torch.
_EXPORTS = {
    "SamplingParams": "verispec.config",
    "SpecConfig": "verispec.config",
    "ConfigError": "verispec.errors",
    "InputError": "verispec.errors",
    "VerispecError": "verispec.errors",
    "TokenHistory": "verispec.sampling",
    "make_generator": "verispec.sampling",
    "sample": "verispec.sampling",
    "to_probs": "verispec.sampling",
    "Draft": "verispec.verify",
    "GreedyRule": "verispec.verify",
    "RejectionRule": "verispec.verify",
    "TypicalRule": "verispec.verify",
    "Verdict": "verispec.verify",
    "SpecStats": "verispec.metrics",
    "EngineConfig": "verispec.config",
    "Engine": "verispec.engine",
    "RequestOutput": "verispec.engine",
    "generate": "verispec.pipeline",
}

__all__ = [
    "ConfigError",
    "Draft",
    "Engine",
    "EngineConfig",
    "GreedyRule",
    "InputError",
    "RejectionRule",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "TokenHistory",
    "TypicalRule",
    "Verdict",
    "VerispecError",
    "__version__",
    "generate",
    "make_generator",
    "sample",
    "to_probs",
]

if TYPE_CHECKING:
    from verispec.config import EngineConfig, SamplingParams, SpecConfig
    from verispec.engine import Engine, RequestOutput
    from verispec.errors import ConfigError, InputError, VerispecError
    from verispec.metrics import SpecStats
    from verispec.pipeline import generate
    from verispec.sampling import TokenHistory, make_generator, sample, to_probs
    from verispec.verify import Draft, GreedyRule, RejectionRule, TypicalRule, Verdict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
