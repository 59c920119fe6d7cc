"""The short way in: load a target/draft pair and build an engine, or generate in one call.

>>> from verispec import generate, SamplingParams                       # doctest: +SKIP
>>> out = generate(["def quicksort(arr):"], SamplingParams(temperature=0, max_tokens=64))
>>> print(out[0].text, out[0].stats.mean_acceptance_length)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verispec.config import DRAFT_CONTEXT_WINDOW, EngineConfig, SamplingParams, SpecConfig
from verispec.drafters.eagle import load_eagle
from verispec.drafters.heads import MedusaDrafter, load_heads
from verispec.drafters.registry import make_drafter
from verispec.drafters.retrieval import Datastore, DatastoreFiles, text_files
from verispec.drafters.tree import TreeShape
from verispec.engine.engine import Engine
from verispec.engine.policy import DraftPolicy
from verispec.engine.request import RequestOutput
from verispec.errors import ConfigError
from verispec.formats.loader import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DTYPES,
    DTypeName,
    LoadedModel,
    ProgressFn,
    check_compatible,
    check_precision,
    default_draft_dtype,
    load_model,
    peek_config,
)
from verispec.formats.tokenizer import Tokenizer
from verispec.models.kv_cache import check_cache_fits
from verispec.models.protocol import LanguageModel
from verispec.names import DRAFTERS, MODEL_DRAFTERS, PRECISIONS, TRAINED_DRAFTERS, TREE_DRAFTERS

#: ``--tree auto``: the largest tree the policy plans (nodes, depth).
AUTO_TREE_NODES, AUTO_TREE_DEPTH = 16, 8


@dataclass
class Pipeline:
    """An engine with the models it runs, kept together so that they can be reported on."""

    engine: Engine
    target: LoadedModel
    draft: LoadedModel | None


def check_device(device: str) -> str:
    """``device`` if torch can use it, else a :class:`ConfigError` that says what to do."""
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
        return device
    raise ConfigError(f"unknown device {device!r}; use cpu or cuda")


#: The draft head of the machine defaults: the first 32768 token ids (and the stop ids).
DEFAULT_DRAFT_HEAD = 32768


@dataclass(frozen=True)
class MachineDefaults:
    """The precisions and draft head :func:`machine_defaults` picks, and why (one line)."""

    dtype: DTypeName
    draft_dtype: DTypeName
    draft_head: int | None
    why: str

    def flags(self) -> str:
        head = f" --draft-vocab {self.draft_head}" if self.draft_head else ""
        return f"--dtype {self.dtype} --draft-dtype {self.draft_dtype}{head} --k auto"


def machine_defaults(
    target: str | os.PathLike[str] = DEFAULT_TARGET,
    draft: str | os.PathLike[str] | None = DEFAULT_DRAFT,
    device: str = "cpu",
    draft_dtype_given: DTypeName | None = None,
) -> MachineDefaults:
    """The fastest configuration this machine runs exactly (every choice keeps the output law the
    target precision's own; only speed differs): on a CPU whose tier of verispec's kernels is a
    vector one (:mod:`verispec.kernels.dispatch`), an int4 target when its file has Q4_K weights
    (used exactly: a decode pass reads a third of bf16's bytes) else bf16, and a draft in int4-all
    when its file has Q4_K weights (every decoder projection 4-bit, the others requantised), else
    int8 (its precision only moves the acceptance rate: on the default pair, 2-core Sapphire
    Rapids, an int4 draft decoded 5 HumanEval prompts 7% faster than an int8 one; on 2-core Zen 5
    an int4-all draft 1.05-1.14x faster than an int4 one, medians of three runs, acceptance
    0.83-0.85 -> 0.77-0.82, benchmarks/vs_llamacpp.py), scoring the first 32768 token ids (and
    the request's own ids outside them, :mod:`verispec.drafters.model`) when its vocabulary is
    much larger; elsewhere (CUDA, or a CPU where only the portable tier builds) bf16 on torch's
    kernels. K is chosen per step from measured costs in every case. ``draft_dtype_given``: the
    user's draft precision, which is kept (and said to be theirs)."""
    if device != "cpu":
        draft_on_device: DTypeName = draft_dtype_given or "bf16"
        why = f"on {device}: bf16 target, {draft_on_device} draft on torch's kernels"
        return MachineDefaults("bf16", draft_on_device, None, why)
    from verispec.formats.loader import bf16_kernel_usable, has_q4k_weights
    from verispec.kernels import dispatch

    if not bf16_kernel_usable():
        why = "verispec's vector kernels do not run here: bf16 on torch's kernels"
        return MachineDefaults("bf16", draft_dtype_given or "bf16", None, why)
    tier = dispatch.selected().name
    q4k = has_q4k_weights(target)
    draft_dtype: DTypeName = draft_dtype_given or (
        "int4-all" if draft is not None and has_q4k_weights(draft) else "int8"
    )
    mine = " (as given)" if draft_dtype_given else ""
    config = peek_config(draft) if draft is not None else None
    head = DEFAULT_DRAFT_HEAD if config is not None and config.vocab_size > 2 * DEFAULT_DRAFT_HEAD else None
    target_why = "int4 target (the file's Q4_K weights exactly)" if q4k else "bf16 target (no Q4_K weights to use)"
    head_why = ""
    if head and config is not None:
        head_why = f" scoring {head} of {config.vocab_size} ids and the request's own"
    return MachineDefaults(
        "int4" if q4k else "bf16", draft_dtype, head,
        f"{tier} kernels: {target_why}, {draft_dtype} draft{mine}{head_why}, K per step from measured costs",
    )  # fmt: skip


def check_rule_fits_drafter(rule: str, drafter: str, tree_children: str = "fixed") -> None:
    """Refuse, before anything loads, a rule the drafter's drafts cannot go to: a chain-only rule
    with a tree drafter, or a tree rule named for children the drafter does not produce."""
    from verispec.verify.tree import TREE_RULES

    trees = drafter in TREE_DRAFTERS
    if trees and rule in ("block", "typical"):
        raise ConfigError(f"--rule {rule} verifies chains; the {drafter} drafter proposes trees: use --rule rejection")
    children = {"model": "sampled", "composite": "sampled", "ngram": "fixed", "suffix": "fixed", "retrieval": "fixed"}
    children["medusa"] = children["eagle"] = "fixed"  # (the heads' candidates are point masses)
    children["tree"] = tree_children
    made_for = TREE_RULES[rule].kind if rule in TREE_RULES else None
    if made_for is not None and drafter in children and children[drafter] != made_for:
        raise ConfigError(
            f"--rule {rule} verifies {made_for} children, but the {drafter} drafter's are {children[drafter]}: "
            "use --rule rejection (it picks the rule that fits)"
        )


def load_datastore(files: DatastoreFiles, tokenizer: Tokenizer, progress: ProgressFn | None = None) -> Datastore:
    """The retrieval drafter's datastore of ``files`` in ``tokenizer``'s ids: built once (progress
    in files tokenised) and cached under ``$VERISPEC_HOME/datastores``."""
    from verispec.formats.registry import verispec_home

    total = len(files.texts)

    def encode(texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(texts), 64):
            out += tokenizer.encode_batch(texts[start : start + 64], add_special_tokens=False)
            if progress is not None:
                progress("datastore", min(start + 64, total), total)
        return out

    fingerprint = hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()
    return Datastore.from_files(files, encode, verispec_home() / "datastores", fingerprint)


def load_trained(drafter: str, path: str | os.PathLike[str], target: LanguageModel) -> tuple[Any, Any]:
    """The medusa or eagle drafter's trained file for ``target``: (module, manifest)."""
    if drafter == "eagle":
        return load_eagle(path, target)
    return load_heads(path, target)


def tree_shape(drafter: str, tree: str | None, k: int | None, rule: str) -> tuple[TreeShape | None, int | None]:
    """The shape of the drafter's trees from ``--tree`` (None: chains), and the draft length then
    fixed (a static or dynamic shape's depth unless ``k`` is given; None for ``auto``, whose
    trees the policy plans per step within a 16-node, depth-8 shape)."""
    if tree is None:
        return (TreeShape(), TreeShape().depth if k is None else k) if drafter == "tree" else (None, k)
    if drafter not in ("tree", "medusa", "eagle"):
        raise ConfigError("--tree shapes the trees of the tree, medusa or eagle drafter; add --drafter tree")
    if drafter in TRAINED_DRAFTERS and rule in ("block", "typical"):
        raise ConfigError(f"--rule {rule} verifies chains; a {drafter} tree needs --rule rejection")
    if drafter == "eagle" and (tree == "auto" or tree.lstrip().startswith("[")):
        raise ConfigError("EAGLE trees grow dynamically: give --tree DEPTH,EXPAND,BRANCH[,NODES] (e.g. 5,2,2,8)")
    if tree == "auto":
        if k is not None:
            raise ConfigError("--tree auto chooses each step's tree from measured acceptance and costs; drop --k")
        return TreeShape(AUTO_TREE_DEPTH, 2, 2, AUTO_TREE_NODES), None
    shape = TreeShape.parse(tree)
    if drafter == "medusa" and shape.parents is None:
        raise ConfigError("Medusa trees are static: give --tree as JSON rank paths (e.g. [[0],[1],[0,0]]) or auto")
    return shape, shape.depth if k is None else k


def build(
    target: str | os.PathLike[str] = DEFAULT_TARGET,
    draft: str | os.PathLike[str] | None = DEFAULT_DRAFT,
    *,
    drafter: str = "model",
    k: int | None = None,
    dtype: DTypeName = "bf16",
    draft_dtype: DTypeName | None = None,
    device: str = "cpu",
    max_batch: int = 8,
    max_len: int = 4096,
    rule: str = "rejection",
    allow_lossy: bool = False,
    draft_head: int | None = None,
    tree: str | None = None,
    tree_children: str = "fixed",
    datastore: str | os.PathLike[str] | None = None,
    heads: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
    confidence_stop: bool = True,
    draft_window: int | None = DRAFT_CONTEXT_WINDOW,
) -> Pipeline:
    """Load the models and build the engine. ``drafter``: "model", "ngram", "composite" or "none";
    ``k``: draft length, or None for the measured policy; ``dtype`` / ``draft_dtype``: "fp32",
    "bf16", "int8" or "int4" (see :mod:`verispec.formats.loader`; the draft's default is
    :func:`~verispec.formats.loader.default_draft_dtype`: int8 where the CPU kernels run, else
    ``dtype``); ``draft_head``: score only the first N token ids (and the stop ids) with the draft
    model; ``tree`` / ``tree_children``: the tree drafter's shape ("D,E,B[,N]" or rank paths,
    :class:`~verispec.drafters.tree.TreeShape`; "auto": a static tree planned per step by
    :class:`~verispec.engine.policy.TreePolicy`) and how its children are drawn. A fixed shape's
    depth is ``k`` when given, else the shape's.
    ``datastore``: the retrieval drafter's folder (or file) of text or code; ``heads``: the
    medusa drafter's heads file (``verispec train medusa``). ``confidence_stop``: with K chosen
    per step, a draft model's chain may run past it and ends where its confidence says the next
    token does not pay (:mod:`verispec.engine.confidence`). ``draft_window``: the most prompt
    tokens the draft model reads, a longer prompt from its last that many (None: all)."""
    if drafter not in DRAFTERS:
        raise ConfigError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if draft_dtype is None and drafter in MODEL_DRAFTERS and dtype in PRECISIONS:
        draft_dtype = default_draft_dtype(dtype, device)
    for name, value in (("dtype", dtype), ("draft dtype", draft_dtype or dtype)):
        if value not in PRECISIONS:
            raise ConfigError(f"{name} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    device = check_device(device)
    for value in {dtype, draft_dtype or dtype}:
        check_precision(value, device)  # before any loading: int4/int8 need this CPU's AMX kernels
    check_rule_fits_drafter(rule, drafter, tree_children)
    if (drafter in TRAINED_DRAFTERS) != (heads is not None):
        raise ConfigError(
            f"the {drafter} drafter needs --heads PATH ({TRAINED_DRAFTERS[drafter]} writes it)"
            if drafter in TRAINED_DRAFTERS
            else "--heads feeds the medusa or eagle drafter; add --drafter medusa or --drafter eagle"
        )
    if heads is not None and not os.path.isfile(heads):
        raise ConfigError(f"--heads {str(heads)!r} is not a file; train one with {TRAINED_DRAFTERS[drafter]}")
    shape, k = tree_shape(drafter, tree, k, rule)
    if (drafter == "retrieval") != (datastore is not None):
        raise ConfigError(
            "the retrieval drafter needs --datastore PATH (a folder of text or code)"
            if drafter == "retrieval"
            else "--datastore feeds the retrieval drafter; add --drafter retrieval"
        )
    files = text_files(datastore) if datastore is not None else None  # (read before any model loads)
    config = EngineConfig(
        max_batch=max_batch, max_len=max_len, num_draft_tokens=k, spec=SpecConfig(rule=rule, allow_lossy=allow_lossy),
        max_draft_tokens=max(8, shape.max_nodes if shape else 0), confidence_stop=confidence_stop,
    )  # fmt: skip
    # KV caches larger than the machine are refused before any weight is read (where the configs
    # can be read cheaply); the caches' own check catches the rest.
    sizes = [(target, dtype)] + ([(draft, draft_dtype or dtype)] if drafter in MODEL_DRAFTERS and draft else [])
    for spec, precision in sizes:
        model_config = peek_config(spec)
        if model_config is not None:
            check_cache_fits(model_config, max_batch, max_len + config.max_draft_tokens + 1, DTYPES[precision], device)
    target_model = load_model(target, dtype=dtype, device=device, progress=progress)
    draft_model = None
    vocab = target_model.vocab_size
    if drafter in MODEL_DRAFTERS:
        if draft is None:
            raise ConfigError(f"drafter {drafter!r} needs a draft model; pass one or use the ngram drafter")
        draft_model = load_model(draft, dtype=draft_dtype or dtype, device=device, progress=progress)
        vocab = check_compatible(target_model, draft_model).vocab_size
    trained = load_trained(drafter, heads, target_model.model) if heads is not None else None  # (module, manifest)
    if trained is not None:  # the heads score the ids they were trained on, fewer if asked
        draft_head = min(draft_head or trained[1].head_size, trained[1].head_size)
    d = make_drafter(
        drafter,
        draft_model=draft_model.model if draft_model is not None else None,
        vocab_size=target_model.logits_width,
        vocab_limit=vocab,
        max_batch=max_batch,
        max_len=max_len + config.max_draft_tokens + 1,
        draft_head=draft_head,
        keep_ids=tuple(target_model.tokenizer.eos_token_ids),
        tree=shape,
        tree_children=tree_children,
        datastore=load_datastore(files, target_model.tokenizer, progress) if files is not None else None,
        target_model=target_model.model,
        heads=trained[0] if trained is not None else None,
        draft_window=draft_window,
    )
    policy: DraftPolicy | None = None
    if d.proposes and k is None:
        from verispec.engine.calibrate import load_or_calibrate
        from verispec.engine.policy import TreePolicy, make_policy
        from verispec.formats.registry import verispec_home

        costs = load_or_calibrate(
            target_model.model, target_model.name, verispec_home(), batch_sizes=sorted({1, max_batch}),
            progress=progress,
        )  # fmt: skip
        if tree == "auto" and shape is not None:
            depth = min(shape.depth, d.depth) if isinstance(d, MedusaDrafter) else shape.depth  # (a head per level)
            policy = TreePolicy(shape.max_nodes, depth, costs=costs)
        else:
            policy = make_policy(config, speculative=True, costs=costs)
    engine = Engine(target_model.model, target_model.tokenizer, d, config, vocab_limit=vocab, policy=policy)
    return Pipeline(engine, target_model, draft_model)


def generate(
    prompts: str | Sequence[str],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    target: str | os.PathLike[str] = DEFAULT_TARGET,
    draft: str | os.PathLike[str] | None = DEFAULT_DRAFT,
    drafter: str = "model",
    k: int | None = None,
    dtype: DTypeName = "bf16",
    device: str = "cpu",
    chat: bool = False,
) -> list[RequestOutput]:
    """Generate for ``prompts`` with speculative decoding on the default pair (or the models
    given); returns one final :class:`RequestOutput` per prompt. ``chat=True`` wraps each prompt
    as a user message in the model's chat template."""
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    pipe = build(target, draft, drafter=drafter, k=k, dtype=dtype, device=device, max_batch=max(1, min(len(texts), 8)))
    if chat:
        texts = [chat_prompt(pipe.target, t) for t in texts]
    return pipe.engine.generate(texts, params)


def chat_prompt(model: LoadedModel, text: str) -> str:
    """``text`` as the user turn of ``model``'s chat template, ready for the assistant's answer."""
    if not model.tokenizer.chat_template:
        raise ConfigError(f"{model.name} has no chat template; drop --chat and write the prompt yourself")
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
