"""Token trees from the draft model: several continuations per step, verified in one target pass.

Each step grows a tree level by level (dynamic expansion, as EAGLE-2 does: Li et al. 2024,
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees"): the root is the last
committed token; at every level the ``expand`` nodes of the last level whose paths the draft
finds likeliest (the product of the draft probabilities of their tokens) each get ``branch``
children, until the tree is ``depth`` deep or holds ``max_nodes`` nodes. A node's children come
from the draft's law after its path, as ``children`` says (:class:`~verispec.verify.Draft`):

- ``"fixed"``: its ``branch`` likeliest tokens (top-k; no randomness) — with the point-mass rule;
- ``"sampled"``: ``branch`` i.i.d. draws — with SpecInfer's multi-round rule;
- ``"distinct"``: ``branch`` draws without replacement — with Sequoia's rule.

Which nodes grow, and how many children each gets, is decided before their children are drawn,
from the draft's own numbers: the children of a node are then honest draws of the declared kind,
which is what the rules need. Greedy requests always take top-k children (their rule is argmax
matching, whatever the children). With ``expand = branch = 1`` the tree is a chain.

Static shapes (Medusa's path lists, Cai et al. 2024; Sequoia's optimal trees, Chen et al. 2024:
:func:`verispec.analysis.optimal_tree`) grow the same topology every step: a node's children are
the ``n`` its place in the shape has, drawn as ``children`` says.

Draft passes: one per level. The nodes that grow are fed after the tree's nodes already in the
draft cache, under a window mask (each sees the committed tokens and its ancestors, at position
``length + depth``), so a level's pass has as many rows as it grows nodes, which costs about one
row each while the draft's pass is memory-bound. The tree's entries are dropped from the draft
cache when drafting ends; the accepted path comes back as the next step's catch-up.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from verispec.analysis import parents_from_paths, tree_paths
from verispec.drafters.base import BatchView
from verispec.drafters.model import ModelDrafter, _State
from verispec.errors import ConfigError, InputError
from verispec.models.protocol import LanguageModel
from verispec.sampling import TokenHistory, build_laws, sample
from verispec.verify.base import CHILDREN, PAD_ID, Draft

#: The most nodes a tree may have (a verification pass over more rows is no draft), and the
#: largest file of paths read for one.
MAX_TREE_NODES = 1024
MAX_PATHS_BYTES = 1 << 20


@dataclass(frozen=True)
class TreeShape:
    """How a step's tree grows.

    Dynamic (EAGLE-2 style): ``depth`` levels at most, the ``expand`` likeliest nodes of each level
    grown, ``branch`` children per grown node, ``max_nodes`` nodes in all. Static (``parents``
    given: Medusa's path lists, Sequoia's optimal trees from :func:`verispec.analysis.optimal_tree`):
    the same topology every step, node i the child of ``parents[i]`` ranked by index among its
    siblings; ``depth`` and ``max_nodes`` are then the topology's.
    """

    depth: int = 4
    expand: int = 2
    branch: int = 2
    max_nodes: int = 12
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("depth", "expand", "branch", "max_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"tree {name} must be an integer >= 1, got {value!r}")
        if self.max_nodes > MAX_TREE_NODES:
            raise ConfigError(f"a tree has at most {MAX_TREE_NODES} nodes, got max_nodes {self.max_nodes}")

    @staticmethod
    def fixed(parents: Sequence[int]) -> TreeShape:
        """The static shape with these parents (-1: the root; siblings ranked by index)."""
        paths = tree_paths(parents)  # validates
        if not paths:
            raise ConfigError("a static tree needs at least one node")
        kids = [sum(1 for p in parents if p == i) for i in range(-1, len(paths))]
        widths = [sum(1 for path in paths if len(path) == d) for d in range(1, 1 + max(map(len, paths)))]
        return TreeShape(max(map(len, paths)), max(widths), max(kids), len(paths), tuple(int(p) for p in parents))

    @staticmethod
    def parse(text: str) -> TreeShape:
        """``"DEPTH,EXPAND,BRANCH[,MAX_NODES]"`` (dynamic, e.g. ``"4,2,2,12"``), or a static tree as
        a JSON list of rank paths (Medusa's choices, e.g. ``[[0], [1], [0, 0]]``), inline or in a
        file (what ``verispec analyze --tree-out`` writes)."""
        stripped = text.strip()
        if stripped.startswith("[") or stripped.endswith(".json") or os.path.isfile(stripped):
            return TreeShape.fixed(parents_from_paths(_read_paths(stripped)))
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) not in (3, 4):
            raise ConfigError(
                "--tree takes DEPTH,EXPAND,BRANCH[,MAX_NODES] (e.g. 4,2,2,12) or a JSON list of rank paths "
                f"(inline or a file, e.g. [[0],[1],[0,0]]), got {text!r}"
            )
        depth, expand, branch = values[:3]
        return TreeShape(depth, expand, branch, values[3] if len(values) == 4 else depth * expand * branch)

    def static_parents(self) -> tuple[int, ...]:
        """A fixed topology of this shape (static: its own; dynamic: the first ``expand`` nodes
        of each level grow, by index): the parent of each node, for drafters that draw a static tree."""
        if self.parents is not None:
            return self.parents
        parents: list[int] = []
        frontier = [-1]
        for _ in range(self.depth):
            new: list[int] = []
            for node in frontier:
                for _ in range(self.branch):
                    if len(parents) < self.max_nodes:
                        parents.append(node)
                        new.append(len(parents) - 1)
            frontier = new[: self.expand]
        return tuple(parents)


def _read_paths(text: str) -> list[list[int]]:
    """A JSON list of rank paths, inline or from a file (of at most ``MAX_PATHS_BYTES``)."""
    if not text.startswith("["):
        try:
            with open(text, "rb") as f:
                raw = f.read(MAX_PATHS_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read the tree file {text!r} ({exc.strerror or exc})") from exc
        if len(raw) > MAX_PATHS_BYTES:
            raise ConfigError(f"the tree file {text!r} is larger than {MAX_PATHS_BYTES} bytes")
        text = raw.decode("utf-8", errors="replace")
    try:
        paths = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(
            f"a tree's paths must be JSON, a list of lists of ranks (e.g. [[0],[1],[0,0]]): {exc}"
        ) from exc
    if not isinstance(paths, list) or not all(isinstance(p, list) and all(type(r) is int for r in p) for p in paths):
        raise ConfigError("a tree's paths must be a JSON list of lists of integer ranks, e.g. [[0],[1],[0,0]]")
    return paths  # (checked above: a list of lists of ints)


@dataclass
class _Node:
    token: int
    parent: int  # index of the parent node, -1 for the root
    depth: int
    logp: float  # log of the draft probability of the path
    law: Tensor | None  # [V] the law the token was drawn from (sampled / distinct), else None


class TreeDrafter(ModelDrafter):
    """A draft model that proposes token trees (see the module docstring)."""

    name: ClassVar[str] = "tree"
    stops_early: ClassVar[bool] = False  # its drafts are trees of the planned depth, not chains a stop ends

    def __init__(
        self, model: LanguageModel, *, shape: TreeShape = TreeShape(), children: str = "fixed", **kwargs: object
    ) -> None:
        if children not in CHILDREN:
            raise ConfigError(f"tree children must be one of {', '.join(CHILDREN)}, got {children!r}")
        super().__init__(model, **kwargs)  # type: ignore[arg-type]
        self.shape = shape
        self.children = children
        # tokens the last verified step committed: the next proposal feeds them again (the tree
        # left the draft cache), which is the price of drafting, not a catch-up
        self._committed: dict[str, int] = {}

    def observe(self, request_id: str, accepted_ids: Sequence[int]) -> None:
        state = self._get(request_id)
        state.last_k = 0  # the tree left the cache at the end of propose(); the path comes back next time
        self._committed[request_id] = len(accepted_ids)

    def end(self, request_id: str) -> None:
        super().end(request_id)
        self._committed.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: BatchView, max_tokens: Sequence[int]) -> Draft:
        n = len(batch)
        rows = [b for b in range(n) if max_tokens[b] > 0]
        states = [self._get(batch.request_ids[b]) for b in rows]
        for b, state in zip(rows, states, strict=True):
            if len(state.context) + self.shape.max_nodes + 1 > self.max_len:
                raise InputError(f"draft cache overflow for request {batch.request_ids[b]!r}")
        trees: dict[int, list[_Node]] = {b: [] for b in rows}
        # each row's static tree: the policy's plan for it, else the shape's (None: grown dynamically)
        plans = [batch.shapes[b] if batch.shapes and batch.shapes[b] else self.shape.parents for b in rows]
        # nodes per row: the tree's, within what the engine's cache holds for the row this step
        caps = [
            min(len(plan) if plan else self.shape.max_nodes, batch.room[b] if batch.room else self.shape.max_nodes)
            for b, plan in zip(rows, plans, strict=True)
        ]
        self.last_catchup_tokens = 0
        if rows:
            self.last_catchup_tokens = max(
                len(s.context) - s.fed - self._committed.get(batch.request_ids[b], 0) + 1
                for b, s in zip(rows, states, strict=True)
            )  # (a chain drafter re-feeds 1 token in steady state: the same figure for the policy)
            self._grow(batch, rows, states, [max_tokens[b] for b in rows], caps, plans, trees)
        return self._assemble(n, trees)

    def _grow(
        self,
        batch: BatchView,
        rows: list[int],
        states: list[_State],
        depth_caps: list[int],
        node_caps: list[int],
        plans: list[tuple[int, ...] | None],
        trees: dict[int, list[_Node]],
    ) -> None:
        shape = self.shape
        # per row, a static tree's node -> its children (None: grown dynamically)
        row_kids = [_static_children(plan) if plan else None for plan in plans]
        levels = max([shape.depth, *(max(map(len, tree_paths(plan))) for plan in plans if plan)])
        static_of: list[list[int]] = [[] for _ in rows]  # per row, per node: its node of the static shape
        cached: list[list[int]] = [[] for _ in rows]  # per row: the nodes in the draft cache, in order
        histories = self._histories(batch, rows, states)
        # the root's law: the catch-up (tokens committed since the last step) fed as a chain
        self._feed_ahead(states)
        root_logits = self._feed(states, [s.context[s.fed :] for s in states])  # [R, V]
        frontier: list[list[int]] = [[-1] for _ in rows]  # per row: the nodes to grow (-1 = the root)
        frontier_logits: list[Tensor] = [root_logits[j : j + 1] for j in range(len(rows))]
        for level in range(1, levels + 1):
            grown_any = False
            for j, b in enumerate(rows):
                nodes, kids = trees[b], row_kids[j]
                if level > depth_caps[j] or not frontier[j]:
                    frontier[j] = []
                    continue
                laws = self._laws(batch, b, frontier[j], frontier_logits[j], nodes, histories[j] if histories else None)
                new: list[int] = []
                for parent, law in zip(frontier[j], laws, strict=True):
                    room = node_caps[j] - len(nodes)
                    if room <= 0 or law is None:
                        continue
                    places = None if kids is None else kids.get(static_of[j][parent] if parent >= 0 else -1, [])
                    count = shape.branch if places is None else len(places)
                    base = 0.0 if parent < 0 else nodes[parent].logp
                    depth = 1 if parent < 0 else nodes[parent].depth + 1
                    for rank, token in enumerate(self._children(law, min(count, room), batch.generators[b])):
                        p = float(law[token])
                        logp = base + (math.log(p) if p > 0 else float("-inf"))
                        keep_law = law if (self.children != "fixed" and batch.generators[b] is not None) else None
                        nodes.append(_Node(token, parent, depth, logp, keep_law))
                        static_of[j].append(-1 if places is None else places[rank])
                        new.append(len(nodes) - 1)
                if level >= depth_caps[j] or (kids is None and level >= shape.depth):
                    frontier[j] = []
                elif kids is None:  # the likeliest new nodes grow next, decided before their children are drawn
                    frontier[j] = sorted(new, key=lambda i: -nodes[i].logp)[: shape.expand]
                else:  # the static shape says which
                    frontier[j] = [i for i in new if kids.get(static_of[j][i])]
                grown_any = grown_any or bool(frontier[j])
            if not grown_any:
                break
            frontier_logits = self._tree_logits(rows, states, trees, frontier, cached)
        for state in states:  # the tree leaves the draft cache; the committed tokens stay
            self.cache.truncate([state.cached], [state.slot])

    def _laws(
        self,
        batch: BatchView,
        b: int,
        parents: list[int],
        logits: Tensor,
        nodes: list[_Node],
        history: TokenHistory | None,
    ) -> list[Tensor | None]:
        """The draft's law after each of ``parents`` (None where it cannot be built)."""
        hist = None
        if history is not None:
            paths = [self._path(nodes, p) for p in parents]
            width = max((len(p) for p in paths), default=0)
            ids = torch.full((len(paths), width), PAD_ID, dtype=torch.long, device=self.model.device)
            for r, path in enumerate(paths):
                if path:
                    ids[r, : len(path)] = torch.tensor([nodes[i].token for i in path], device=self.model.device)
            base = TokenHistory(
                history.output_counts.expand(len(parents), -1), history.prompt_mask.expand(len(parents), -1)
            )
            hist = base.extended(ids)
        params = batch.params[b]
        if batch.generators[b] is None:  # greedy: rank candidates by the draft's untempered law
            params = replace(params, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        built = build_laws(logits, [params] * len(parents), hist)
        return [None if r in built.failed else built.probs[r] for r in range(len(parents))]

    def _children(self, law: Tensor, count: int, gen: torch.Generator | None) -> list[int]:
        """``count`` children from ``law`` as ``self.children`` says (top-k for greedy requests)."""
        if self.children != "sampled" or gen is None:  # distinct tokens: no more than the law holds
            count = min(count, int((law > 0).sum()))
        if count <= 0:
            return []
        if self.children == "fixed" or gen is None:
            return law.topk(count).indices.tolist()
        if self.children == "sampled":
            return sample(law.unsqueeze(0).expand(count, -1), [gen] * count).tolist()
        drawn: list[int] = []
        rest = law.clone()
        for _ in range(count):  # without replacement: each from the law less the earlier ones
            token = int(sample(rest.unsqueeze(0), [gen])[0])
            drawn.append(token)
            rest[token] = 0.0
        return drawn

    @staticmethod
    def _path(nodes: list[_Node], node: int) -> list[int]:
        path: list[int] = []
        while node >= 0:
            path.append(node)
            node = nodes[node].parent
        return path[::-1]

    def _tree_logits(
        self,
        rows: list[int],
        states: list[_State],
        trees: dict[int, list[_Node]],
        frontier: list[list[int]],
        cached: list[list[int]],
    ) -> list[Tensor]:
        """Feed each row's frontier nodes after the tree's nodes already in its draft cache
        (``cached``, extended here): each sees the committed tokens and its cached ancestors, at
        position ``length + depth - 1``; return the logits after each frontier node."""
        device = self.model.device
        active = [j for j in range(len(rows)) if frontier[j]]
        out: list[Tensor] = [torch.empty(0) for _ in rows]
        if not active:
            return out
        sub = [states[j] for j in active]
        width = max(len(frontier[j]) for j in active)
        before = max(len(cached[j]) for j in active)  # window columns of cached tree nodes
        window = torch.zeros((len(active), width, before + width), dtype=torch.bool)  # [R, T, W]
        positions = torch.zeros((len(active), width), dtype=torch.long)
        pieces: list[list[int]] = []
        for r, j in enumerate(active):
            nodes, own = trees[rows[j]], cached[j]
            window[r, :, : before - len(own)] = True  # columns before this row's tree: committed tokens
            column = {node: before - len(own) + c for c, node in enumerate(own)}
            for t, node in enumerate(frontier[j]):
                ancestor = nodes[node].parent
                while ancestor >= 0:  # (every ancestor of a node that grows grew, so it is cached)
                    window[r, t, column[ancestor]] = True
                    ancestor = nodes[ancestor].parent
                positions[r, t] = states[j].cached + nodes[node].depth - 1  # (depth d: after d - 1 ancestors)
            pieces.append([nodes[node].token for node in frontier[j]])
            own.extend(frontier[j])
        at = torch.arange(width, dtype=torch.long).expand(len(active), -1)
        logits = self._run(sub, pieces, at.to(device), positions.to(device), window.to(device))  # [R, F, V]
        for r, j in enumerate(active):
            out[j] = logits[r, : len(frontier[j])]
        return out

    def _assemble(self, n: int, trees: dict[int, list[_Node]]) -> Draft:
        k = max((len(t) for t in trees.values()), default=0)
        ids = torch.full((n, k), PAD_ID, dtype=torch.long)
        parents = torch.full((n, k), PAD_ID, dtype=torch.long)
        num = torch.zeros(n, dtype=torch.long)
        probs = None
        if self.children != "fixed":
            probs = torch.zeros((n, k, self.vocab_size), dtype=torch.float32, device=self.model.device)
        for b, nodes in trees.items():
            num[b] = len(nodes)
            for i, node in enumerate(nodes):
                ids[b, i] = node.token
                parents[b, i] = node.parent
                if probs is not None:
                    if node.law is not None:
                        probs[b, i] = node.law
                    else:  # a greedy request's top-k child: any law that holds it will do
                        probs[b, i, node.token] = 1.0
        return Draft(ids, num, probs, parents, self.children)


def _static_children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node -> its children in rank order (-1: the root's), for a static shape's ``parents``."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids
