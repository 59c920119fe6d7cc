"""Draft, Verdict, the AcceptanceRule protocol, and the checks every rule runs on its inputs.

Glossary (used everywhere in verispec):

- *draft tokens*: proposed by the drafter; *accepted tokens*: draft tokens that passed the rule.
- *recovered token*: drawn from the residual ``norm(max(0, target_probs - draft_probs))`` at the
  first rejection. *bonus token*: drawn from the target after every draft token was accepted.
- *output tokens* = accepted tokens + one recovered-or-bonus token: at least 1, at most K + 1.

Randomness: every stochastic rule draws by the one protocol of
:func:`verispec.sampling.uniform_draws` (per run of rows sharing a generator: float64 acceptance
uniforms, ``num_tokens`` per row in row order, then one uniform per row for its final token, in a
single call), and samples its final token with :func:`verispec.sampling.pick`. Rows whose generator
is None are verified greedily and consume nothing. The reference implementations follow the same
protocol, so fast and slow versions can be compared exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from verispec.errors import InputError
from verispec.names import TREE_CHILDREN
from verispec.sampling import check_probs

PAD_ID = -1
CHILDREN = TREE_CHILDREN  # how a draft's children were produced (Draft.children)


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for a batch.

    ``token_ids`` ``[B, K]`` int64, ``PAD_ID`` after ``num_tokens[b]``.
    ``num_tokens`` ``[B]`` int64, each in ``[0, K]`` (ragged drafts; 0 = plain decoding for that row).
    ``probs`` ``[B, K, V]`` fp32: the law each draft token was ACTUALLY drawn from; ``None`` means
    point-mass drafts (n-gram lookup, greedy heads), i.e. ``draft_probs`` is one-hot on the token.

    Trees: ``parents`` ``[B, K]`` int64, the index of each node's parent (-1: a child of the last
    committed token; parents come before their children; ``PAD_ID`` after ``num_tokens``); None
    is a chain (node i's parent is i - 1). ``children`` says how the children of a node were
    produced, which decides the rule that may verify them (:mod:`verispec.verify.tree`):

    - ``"sampled"``: each child drawn independently from ``probs`` (its parent's draft law; the
      same row for siblings);
    - ``"distinct"``: siblings drawn in index order without replacement from that law (each from
      the law with the earlier siblings removed and renormalised: Gumbel-top-k);
    - ``"fixed"``: candidates that do not depend on any randomness (top-k of the draft, n-gram,
      suffix or retrieval continuations): ``probs`` is None.

    The default is ``"sampled"`` when ``probs`` is given, else ``"fixed"``. For a chain the three
    coincide with the chain rule.
    """

    token_ids: Tensor  # [B, K] int64
    num_tokens: Tensor  # [B] int64
    probs: Tensor | None = None  # [B, K, V] fp32
    parents: Tensor | None = None  # [B, K] int64
    children: str = ""

    def __post_init__(self) -> None:
        if not self.children:
            object.__setattr__(self, "children", "sampled" if self.probs is not None else "fixed")
        if self.children not in CHILDREN:
            raise InputError(f"draft.children must be one of {', '.join(CHILDREN)}, got {self.children!r}")
        if self.children == "fixed" and self.probs is not None:
            raise InputError("fixed (deterministic) children carry no draft law: pass probs=None")
        if self.children != "fixed" and self.probs is None:
            raise InputError(f"{self.children} children need the law they were drawn from (draft.probs)")

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def rows(self, index: Tensor) -> Draft:
        """The draft of rows ``index`` (``[R]`` int64), every field kept."""

        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index.to(t.device))

        return Draft(pick(self.token_ids), pick(self.num_tokens), pick(self.probs), pick(self.parents), self.children)  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> Draft:
        """The same draft on ``device``."""

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return Draft(move(self.token_ids), move(self.num_tokens), move(self.probs), move(self.parents), self.children)  # type: ignore[arg-type]

    @property
    def batch_size(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def max_tokens(self) -> int:
        return int(self.token_ids.shape[1])

    @staticmethod
    def from_lists(
        token_lists: Sequence[Sequence[int]],
        probs: Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> Draft:
        """Build a padded draft from per-row token lists (handy in tests and small drafters)."""
        k = max((len(t) for t in token_lists), default=0)
        ids = torch.full((len(token_lists), k), PAD_ID, dtype=torch.long, device=device)
        for row, tokens in enumerate(token_lists):
            if tokens:
                ids[row, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
        num = torch.tensor([len(t) for t in token_lists], dtype=torch.long, device=device)
        return Draft(ids, num, probs)


@dataclass(frozen=True)
class Verdict:
    """What a rule decides.

    ``output_ids`` ``[B, K + 1]`` int64: the accepted tokens, then one recovered or bonus token,
    then ``PAD_ID``. ``num_accepted`` ``[B]`` int64: draft tokens accepted (the recovered/bonus
    token is not counted). ``path`` ``[B, K]`` for trees: the accepted nodes' indices from the
    root down, ``PAD_ID`` after (their KV is what the caches keep).
    """

    output_ids: Tensor  # [B, K + 1] int64
    num_accepted: Tensor  # [B] int64
    path: Tensor | None = None  # [B, K] int64

    @property
    def num_output(self) -> Tensor:
        """``[B]`` int64: output tokens per row (accepted + 1)."""
        return self.num_accepted + 1

    def tokens(self) -> list[list[int]]:
        """The output tokens of each row as Python lists (one host sync)."""
        counts = self.num_output.tolist()
        rows = self.output_ids.tolist()
        return [row[:n] for row, n in zip(rows, counts, strict=True)]


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides which draft tokens to keep and which token to emit after them.

    ``target_probs`` ``[B, K + 1, V]`` fp32: row ``i`` is the target's law for the token after the
    first ``i`` draft tokens (made by :func:`verispec.sampling.to_probs`); row ``num_tokens[b]`` is
    the bonus position. ``generators``: one per row of the batch (None = greedy row).
    """

    lossless: ClassVar[bool]
    name: ClassVar[str]

    def verify(self, draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict: ...


def check_inputs(
    draft: Draft,
    target_probs: Tensor,
    generators: Sequence[torch.Generator | None],
    *,
    check_values: bool = True,
    trees: bool = False,
) -> None:
    """Raise :class:`InputError` unless the inputs of a rule fit together (``trees``: the rule
    verifies tree drafts too; else ``draft.parents`` must be None).

    Shapes are checked for free; with ``check_values`` the contents too (token ids in range, PAD
    after ``num_tokens``, parents before their children, every used row of ``draft.probs`` and
    ``target_probs`` a law): one sync. For trees, row ``1 + i`` of ``target_probs`` is the law
    after node ``i`` (its path), row 0 the law after the last committed token.
    """
    ids, num = draft.token_ids, draft.num_tokens
    if ids.dim() != 2:
        raise InputError(f"draft.token_ids must be [B, K], got shape {tuple(ids.shape)}")
    batch, k = ids.shape
    if num.shape != (batch,):
        raise InputError(f"draft.num_tokens must be [B] = [{batch}], got shape {tuple(num.shape)}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise InputError(
            f"target_probs must be [B, K + 1, V] = [{batch}, {k + 1}, V], got {tuple(target_probs.shape)}; "
            "the target scores the last committed token plus every draft token"
        )
    vocab = target_probs.shape[2]
    if draft.probs is not None and draft.probs.shape != (batch, k, vocab):
        raise InputError(
            f"draft.probs must be [B, K, V] = [{batch}, {k}, {vocab}], got {tuple(draft.probs.shape)}; "
            "draft and target vocabulary sizes must match"
        )
    if draft.parents is not None and not trees:
        raise InputError(
            "this rule verifies chains only; verify tree drafts with the rejection rule (which picks the "
            "tree rule matching draft.children), greedy, or the tree rule named for their children"
        )
    if draft.parents is not None and draft.parents.shape != (batch, k):
        raise InputError(f"draft.parents must be [B, K] = [{batch}, {k}], got {tuple(draft.parents.shape)}")
    if len(generators) != batch:
        raise InputError(f"got {len(generators)} generators for a batch of {batch}; pass one per row")
    if not check_values:
        return
    pos = torch.arange(k, device=ids.device)
    used = pos.unsqueeze(0) < num.unsqueeze(1)  # [B, K]
    bad_num = (num < 0) | (num > k)
    bad_ids = (used & ((ids < 0) | (ids >= vocab))) | (~used & (ids != PAD_ID))
    checks = [bad_num.any(), bad_ids.any()]
    if draft.parents is not None:
        par = draft.parents
        bad_par = (used & ((par < -1) | (par >= pos.unsqueeze(0)))) | (~used & (par != PAD_ID))
        checks.append(bad_par.any())
    flags = torch.stack(checks).tolist()
    if flags[0]:
        raise InputError(f"draft.num_tokens must lie in [0, K] = [0, {k}], got {num.tolist()}")
    if flags[1]:
        raise InputError(
            f"draft.token_ids must be ids in [0, {vocab}) for the first num_tokens positions and "
            f"PAD_ID ({PAD_ID}) after them"
        )
    if len(flags) > 2 and flags[2]:
        raise InputError(
            "draft.parents must name an earlier node (or -1, the last committed token) for each of the "
            f"first num_tokens nodes and be PAD_ID ({PAD_ID}) after them"
        )
    used_target = torch.arange(k + 1, device=ids.device).unsqueeze(0) <= num.unsqueeze(1)  # [B, K+1]
    check_probs(target_probs, "target_probs", used_target)
    if draft.probs is not None:
        check_probs(draft.probs, "draft.probs", used)


def assemble(token_ids: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """``output_ids`` ``[B, K + 1]``: the first ``num_accepted[b]`` draft tokens, then ``final[b]``,
    then ``PAD_ID``. ``token_ids`` ``[B, K]``, ``num_accepted`` and ``final`` ``[B]`` int64."""
    batch, k = token_ids.shape
    pos = torch.arange(k + 1, device=token_ids.device).unsqueeze(0)  # [1, K+1]
    padded = torch.cat([token_ids, torch.full((batch, 1), PAD_ID, dtype=torch.long, device=token_ids.device)], 1)
    out = torch.where(pos < num_accepted.unsqueeze(1), padded, PAD_ID)
    return out.scatter(1, num_accepted.unsqueeze(1), final.unsqueeze(1))


def gather_at(values: Tensor, token_ids: Tensor) -> Tensor:
    """``values[b, i, token_ids[b, i]]`` as ``[B, K]`` float64 (PAD ids read token 0)."""
    return values.gather(2, token_ids.clamp_min(0).unsqueeze(-1)).squeeze(-1).to(torch.float64)
