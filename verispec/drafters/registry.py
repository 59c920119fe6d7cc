"""Drafters by name: the one place that knows how to build each (the engine never checks types)."""

from __future__ import annotations

from verispec.drafters.base import Drafter
from verispec.drafters.composite import CompositeDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.plain import PlainDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.drafters.tree import TreeDrafter, TreeShape
from verispec.errors import ConfigError
from verispec.models.protocol import LanguageModel
from verispec.names import DRAFTERS


def make_drafter(
    name: str,
    *,
    draft_model: LanguageModel | None = None,
    vocab_size: int,
    vocab_limit: int | None = None,
    max_batch: int = 8,
    max_len: int = 4096,
    ngram_min: int = 2,
    ngram_max: int = 4,
    draft_head: int | None = None,
    keep_ids: tuple[int, ...] = (),
    tree: TreeShape | None = None,
    tree_children: str = "fixed",
) -> Drafter:
    """Build the drafter ``name`` ("none" = plain decoding: a drafter that proposes nothing;
    "tree": the draft model's token trees of shape ``tree`` and children ``tree_children``)."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    if name == "none":
        return PlainDrafter()
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name == "suffix":
        return SuffixDrafter(min_n=ngram_min, max_n=max(ngram_max, 8))
    if draft_model is None:
        raise ConfigError(f"drafter {name!r} needs a draft model; pass --draft (or use --drafter ngram)")
    if name == "tree":
        return TreeDrafter(
            draft_model, shape=tree or TreeShape(), children=tree_children, vocab_size=vocab_size,
            vocab_limit=vocab_limit, max_batch=max_batch, max_len=max_len, head_size=draft_head, keep_ids=keep_ids,
        )  # fmt: skip
    model = ModelDrafter(
        draft_model, vocab_size=vocab_size, vocab_limit=vocab_limit, max_batch=max_batch, max_len=max_len,
        head_size=draft_head, keep_ids=keep_ids,
    )  # fmt: skip
    if name == "model":
        return model
    return CompositeDrafter(NgramDrafter(ngram_min, ngram_max), model)
