"""Drafters by name: the one place that knows how to build each (the engine never checks types)."""

from __future__ import annotations

from verispec.config import DRAFT_CONTEXT_WINDOW
from verispec.drafters.base import Drafter
from verispec.drafters.composite import CompositeDrafter
from verispec.drafters.eagle import EagleDrafter, EagleHead
from verispec.drafters.heads import MedusaDrafter, MedusaHeads
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.plain import PlainDrafter
from verispec.drafters.retrieval import Datastore, RetrievalDrafter
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
    datastore: Datastore | None = None,
    target_model: LanguageModel | None = None,
    heads: MedusaHeads | EagleHead | None = None,
    draft_window: int | None = DRAFT_CONTEXT_WINDOW,
) -> Drafter:
    """Build the drafter ``name`` ("none" = plain decoding: a drafter that proposes nothing;
    "tree": the draft model's token trees of shape ``tree`` and children ``tree_children``;
    "retrieval": trees of continuations found in ``datastore``; "medusa": ``heads`` on
    ``target_model``'s hidden states, a chain or the static tree ``tree``; "eagle": the EAGLE
    head ``heads`` on them, a chain or the dynamic tree ``tree``). ``draft_window``: the most prompt
    tokens a draft model reads (None: all; :data:`~verispec.config.DRAFT_CONTEXT_WINDOW`)."""
    if name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    free = _model_free(name, ngram_min, ngram_max, datastore)
    if free is not None:
        return free
    if name == "eagle":
        if not isinstance(heads, EagleHead) or target_model is None:
            raise ConfigError("the eagle drafter needs a head: pass --heads PATH (verispec train eagle writes it)")
        return EagleDrafter(
            target_model, heads, vocab_size=vocab_size, head_size=draft_head, tree=tree, max_len=max_len
        )
    if name == "medusa":
        if not isinstance(heads, MedusaHeads) or target_model is None:
            raise ConfigError("the medusa drafter needs heads: pass --heads PATH (verispec train medusa writes them)")
        return MedusaDrafter(
            target_model, heads, vocab_size=vocab_size, head_size=draft_head, tree=tree.parents if tree else None
        )  # (a dynamic shape: a chain, unless the policy plans trees per step)
    if draft_model is None:
        raise ConfigError(f"drafter {name!r} needs a draft model; pass --draft (or use --drafter ngram)")
    if name == "tree":
        return TreeDrafter(
            draft_model, shape=tree or TreeShape(), children=tree_children, vocab_size=vocab_size,
            vocab_limit=vocab_limit, max_batch=max_batch, max_len=max_len, head_size=draft_head, keep_ids=keep_ids,
            context_window=draft_window,
        )  # fmt: skip
    model = ModelDrafter(
        draft_model, vocab_size=vocab_size, vocab_limit=vocab_limit, max_batch=max_batch, max_len=max_len,
        head_size=draft_head, keep_ids=keep_ids, context_window=draft_window,
    )  # fmt: skip
    if name == "model":
        return model
    return CompositeDrafter(_suffix(ngram_min, ngram_max), model)


def _model_free(name: str, ngram_min: int, ngram_max: int, datastore: Datastore | None) -> Drafter | None:
    """The drafters that need no draft model (None for the others)."""
    if name == "none":
        return PlainDrafter()
    if name == "ngram":
        return NgramDrafter(ngram_min, ngram_max)
    if name == "suffix":
        return _suffix(ngram_min, ngram_max)
    if name == "retrieval":
        if datastore is None:
            raise ConfigError(
                "the retrieval drafter needs a datastore: pass --datastore PATH (a folder of text or code)"
            )
        return RetrievalDrafter(datastore, min_n=ngram_min, max_n=max(ngram_max, 12))
    return None


def _suffix(ngram_min: int, ngram_max: int) -> SuffixDrafter:
    """The suffix index of the suffix drafter and of the composite's lookup: suffixes of
    ``ngram_min`` to at least 8 tokens."""
    return SuffixDrafter(min_n=ngram_min, max_n=max(ngram_max, 8))
