"""Statistical certification of losslessness.

"The output has exactly the target's distribution" is a claim about a law, so verispec checks it
as one: generate ``N`` sequences with speculation, count the joint outcomes of the first ``n``
tokens, and compare the counts with the EXACT law of plain sampling from the target by a
chi-square goodness-of-fit test (Pearson 1900). Cells whose expected count is below 5 are pooled;
an outcome of probability 0 that occurs at all fails outright. We report the p-value and the total
variation distance between the empirical and the exact law.

Rules of the method (ARCHITECTURE section 6): the tested prefix is LONGER than K, or the bonus
token is never observed; the significance level is small (alpha = 1e-6) with fixed seeds, so that a
correct rule essentially never fails by chance; and deliberately broken rules (negative controls,
:mod:`verispec.verify.broken` and :class:`~verispec.certify.toy.MisreportingToyDrafter`) must FAIL
the very same test, which shows the test has the power to see the defects that matter.

The sampler under test is any function ``(num_sequences, seed) -> tokens [N, n]``
(:func:`certify_sampler`); :func:`certify_case` builds one from the toy Markov models of
:mod:`verispec.certify.toy`, whose exact law is computable by enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from scipy import stats
from torch import Tensor

from verispec.certify.toy import (
    MarkovLM,
    MisreportingToyDrafter,
    TopKAsSampledToyDrafter,
    ToyDrafter,
    exact_prefix_law,
    generate,
    mean_total_variation,
    sequence_index,
    toy_pair,
)
from verispec.config import SamplingParams, SpecConfig
from verispec.errors import ConfigError
from verispec.verify import TREE_RULES, BlockRule, GreedyRule, RejectionRule, TypicalRule
from verispec.verify.base import AcceptanceRule
from verispec.verify.broken import BROKEN_RULES, SiblingMassLeftRule

if TYPE_CHECKING:
    from verispec.engine.policy import DraftPolicy

DEFAULT_ALPHA = 1e-6
MIN_EXPECTED = 5.0

RULES: dict[str, Callable[[], AcceptanceRule]] = {
    "rejection": RejectionRule,
    "block": BlockRule,
    **TREE_RULES,
    "greedy": GreedyRule,
    "typical": TypicalRule,
    **{cls.name: cls for cls in BROKEN_RULES},
    SiblingMassLeftRule.name: SiblingMassLeftRule,
}
# Toy drafters by name, each given the draft model and the tree shape (None: a chain): children
# drawn i.i.d. ("model"), without replacement ("model-distinct"), or taken deterministically
# (the mode of a chain, the top-k of a tree: "point-mass"); and the broken ones.
DRAFTERS: dict[str, Callable[[MarkovLM, tuple[int, ...] | None], ToyDrafter]] = {
    "model": lambda m, tree: ToyDrafter(m, tree=tree),
    "model-distinct": lambda m, tree: ToyDrafter(m, tree=tree, children="distinct"),
    "point-mass": lambda m, tree: ToyDrafter(m, tree=tree, children="fixed"),
    MisreportingToyDrafter.name: lambda m, tree: MisreportingToyDrafter(m, tree=tree),
    TopKAsSampledToyDrafter.name: lambda m, tree: TopKAsSampledToyDrafter(m, tree=tree),
}
HONEST_DRAFTERS = ("model", "model-distinct", "point-mass")
_CHILDREN = {"model": "sampled", "model-distinct": "distinct", "point-mass": "fixed"}


@dataclass(frozen=True)
class GoodnessOfFit:
    """Chi-square goodness of fit of observed counts against an exact law."""

    statistic: float
    dof: int
    p_value: float
    tv_distance: float  # 0.5 * sum |empirical - exact| over all cells, unpooled
    num_cells: int  # cells after pooling
    impossible: int  # observations in cells of probability 0
    num_samples: int


def chi_square_gof(counts: np.ndarray, law: np.ndarray, min_expected: float = MIN_EXPECTED) -> GoodnessOfFit:
    """Pearson's chi-square test of ``counts`` (``[M]`` int) against the exact ``law`` (``[M]``).

    Cells with expected count below ``min_expected`` are pooled into one cell (merged into the
    smallest other cell if the pool itself stays below it). Any observation in a cell of probability
    exactly 0 gives p = 0.
    """
    counts = np.asarray(counts, dtype=np.float64)
    law = np.asarray(law, dtype=np.float64)
    if counts.shape != law.shape:
        raise ConfigError(f"counts {counts.shape} and law {law.shape} must have the same shape")
    total = counts.sum()
    if total <= 0:
        raise ConfigError("no observations to test; generate at least one sequence")
    if law.min() < 0 or not math.isclose(law.sum(), 1.0, abs_tol=1e-4):
        raise ConfigError(f"the exact law must be non-negative and sum to 1 (sums to {law.sum():.6g})")
    law = law / law.sum()
    tv = 0.5 * float(np.abs(counts / total - law).sum())
    impossible = int(counts[law == 0].sum())
    expected = total * law
    possible = law > 0
    small = possible & (expected < min_expected)
    big = possible & ~small
    obs, exp = list(counts[big]), list(expected[big])
    pooled_obs, pooled_exp = float(counts[small].sum()), float(expected[small].sum())
    if pooled_exp > 0:
        if pooled_exp < min_expected and exp:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
        else:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
    o, e = np.array(obs), np.array(exp)
    if impossible > 0:
        return GoodnessOfFit(math.inf, max(len(o) - 1, 0), 0.0, tv, len(o), impossible, int(total))
    if len(o) < 2:  # a point mass: every observation fell in its one cell
        return GoodnessOfFit(0.0, 0, 1.0, tv, len(o), 0, int(total))
    statistic = float(((o - e) ** 2 / e).sum())
    dof = len(o) - 1
    return GoodnessOfFit(statistic, dof, float(stats.chi2.sf(statistic, dof)), tv, len(o), 0, int(total))


@dataclass(frozen=True)
class ToySetup:
    """The toy target/draft pair certification runs on (see :func:`verispec.certify.toy.toy_pair`)."""

    vocab_size: int = 4
    order: int = 1
    distance: float = 1.0
    seed: int = 0
    prompt: tuple[int, ...] = (0,)

    def pair(self) -> tuple[MarkovLM, MarkovLM]:
        return toy_pair(self.vocab_size, self.order, self.distance, seed=self.seed)


@dataclass(frozen=True)
class CertificationCase:
    """One configuration to certify: acceptance rule, drafter, draft length, sampling parameters,
    and for tree drafts the shape (``tree``: each node's parent, -1 the root; ``k`` is then the
    number of nodes)."""

    rule: str
    drafter: str
    k: int
    params: SamplingParams
    prefix_len: int
    tree: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ConfigError(f"unknown rule {self.rule!r}; choose one of {', '.join(RULES)}")
        if self.drafter not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.drafter!r}; choose one of {', '.join(DRAFTERS)}")
        if self.k < 1:
            raise ConfigError(f"K must be >= 1, got {self.k}")
        if self.tree is not None and self.rule in ("block", "typical"):
            raise ConfigError(f"the {self.rule} rule verifies chains; certify trees with a tree rule")
        if self.tree is not None and len(self.tree) != self.k:
            raise ConfigError(f"a tree of {len(self.tree)} nodes drafts K = {len(self.tree)} tokens, not {self.k}")
        if self.prefix_len < 1:
            raise ConfigError(f"prefix_len must be >= 1, got {self.prefix_len}")

    @property
    def depth(self) -> int:
        """The longest path the draft can have accepted: K for a chain, the tree's depth."""
        if self.tree is None:
            return self.k
        depth: list[int] = []
        for par in self.tree:
            depth.append(1 if par < 0 else depth[par] + 1)
        return max(depth)

    @property
    def observes_bonus(self) -> bool:
        """True when the tested prefix is longer than the deepest draft, so that bonus tokens
        after a fully accepted path are tested too."""
        return self.prefix_len > self.depth

    @property
    def claims_lossless(self) -> bool:
        """Whether this configuration is supposed to preserve the target's law."""
        if self.drafter not in HONEST_DRAFTERS:
            return False
        if self.rule in ("greedy", "typical"):  # exact only when the target law is a point mass
            return self.params.greedy
        if self.rule in TREE_RULES:  # lossless for the children it was made for only
            return TREE_RULES[self.rule].kind == _CHILDREN[self.drafter]
        return bool(RULES[self.rule]().lossless)

    def sampling_label(self) -> str:
        p = self.params
        parts = [f"T={p.temperature:g}"]
        if p.top_k:
            parts.append(f"top_k={p.top_k}")
        if p.top_p < 1:
            parts.append(f"top_p={p.top_p:g}")
        if p.min_p:
            parts.append(f"min_p={p.min_p:g}")
        if p.repetition_penalty != 1:
            parts.append(f"rep={p.repetition_penalty:g}")
        if p.presence_penalty:
            parts.append(f"pres={p.presence_penalty:g}")
        if p.frequency_penalty:
            parts.append(f"freq={p.frequency_penalty:g}")
        if p.logit_bias:
            parts.append(f"bias={dict(p.logit_bias)}")
        return " ".join(parts)

    def label(self) -> str:
        shape = f" tree={list(self.tree)}" if self.tree is not None else ""
        return f"{self.rule}/{self.drafter} K={self.k}{shape} n={self.prefix_len} {self.sampling_label()}"


@dataclass(frozen=True)
class CertificationResult:
    """The verdict on one case. ``passed``: the test did not reject at level ``alpha``."""

    case: CertificationCase
    gof: GoodnessOfFit
    alpha: float
    acceptance_rate: float
    mean_acceptance_length: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.gof.p_value >= self.alpha

    @property
    def as_expected(self) -> bool:
        """A lossless configuration passes; a lossy or broken one fails."""
        return self.passed == self.case.claims_lossless

    def as_dict(self) -> dict[str, Any]:
        case = asdict(self.case)
        case["params"] = {k: v for k, v in case["params"].items() if k not in ("stop", "seed", "max_tokens")}
        return {
            "case": case,
            "label": self.case.label(),
            "claims_lossless": self.case.claims_lossless,
            "passed": self.passed,
            "as_expected": self.as_expected,
            "alpha": self.alpha,
            "p_value": self.gof.p_value,
            "chi2": self.gof.statistic if math.isfinite(self.gof.statistic) else None,
            "dof": self.gof.dof,
            "tv_distance": self.gof.tv_distance,
            "cells": self.gof.num_cells,
            "impossible_outcomes": self.gof.impossible,
            "num_sequences": self.gof.num_samples,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            **self.extra,
        }


def certify_sampler(
    sampler: Callable[[int, int], Tensor],
    law: np.ndarray,
    vocab_size: int,
    *,
    num_sequences: int,
    seed: int,
) -> GoodnessOfFit:
    """Test any sampler ``(num_sequences, seed) -> tokens [N, n]`` against the exact ``law`` of the
    first ``n`` tokens (``[V ** n]``, indexed by :func:`~verispec.certify.toy.sequence_index`)."""
    tokens = sampler(num_sequences, seed)
    counts = np.bincount(sequence_index(tokens, vocab_size), minlength=law.shape[0])
    return chi_square_gof(counts, law)


def certify_case(
    case: CertificationCase,
    setup: ToySetup = ToySetup(),
    *,
    num_sequences: int = 40_000,
    seed: int = 1234,
    alpha: float = DEFAULT_ALPHA,
) -> CertificationResult:
    """Run one case on the toy pair of ``setup`` and test it against the target's exact law."""
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha must be in (0, 1), got {alpha}")
    if num_sequences < 1:
        raise ConfigError(f"num_sequences must be >= 1, got {num_sequences}")
    target, draft_model = setup.pair()
    law = exact_prefix_law(target, case.params, case.prefix_len, setup.prompt)
    rule = RULES[case.rule]()
    drafter = DRAFTERS[case.drafter](draft_model, case.tree)
    runs = []

    def sampler(n: int, s: int) -> Tensor:
        run = generate(
            target, drafter, rule, case.params, k=case.k, num_sequences=n,
            prefix_len=case.prefix_len, prompt=setup.prompt, seed=s,
        )  # fmt: skip
        runs.append(run)
        return run.tokens

    gof = certify_sampler(sampler, law, target.vocab_size, num_sequences=num_sequences, seed=seed)
    stats_ = runs[0].stats
    extra = {
        "lossless_rule": rule.lossless,
        "mean_tv_target_draft": mean_total_variation(target, draft_model, case.params),
        "target_passes": runs[0].target_passes,
    }
    return CertificationResult(case, gof, alpha, stats_.acceptance_rate, stats_.mean_acceptance_length, extra)


def grid(
    *,
    ks: Iterable[int] = (1, 2, 4),
    temperatures: Iterable[float] = (1.0, 0.7),
    top_ks: Iterable[int] = (0,),
    top_ps: Iterable[float] = (1.0, 0.9),
    min_ps: Iterable[float] = (0.0,),
    rule: str = "rejection",
    drafter: str = "model",
    prefix_extra: int = 2,
    base: SamplingParams | None = None,
) -> list[CertificationCase]:
    """The product of the given values, one case each; the prefix is ``K + prefix_extra`` long."""
    if prefix_extra < 1:
        raise ConfigError("the tested prefix must be longer than K (prefix_extra >= 1), or bonus tokens go untested")
    base = base or SamplingParams()
    cases = []
    for k in ks:
        for t in temperatures:
            for tk in top_ks:
                for tp in top_ps:
                    for mp in min_ps:
                        params = SamplingParams(
                            temperature=t, top_k=tk, top_p=tp, min_p=mp,
                            repetition_penalty=base.repetition_penalty,
                            presence_penalty=base.presence_penalty,
                            frequency_penalty=base.frequency_penalty,
                            logit_bias=base.logit_bias,
                        )  # fmt: skip
                        cases.append(CertificationCase(rule, drafter, k, params, k + prefix_extra))
    return cases


def negative_controls(k: int = 2, params: SamplingParams | None = None) -> list[CertificationCase]:
    """One case per deliberately broken rule, plus the misreporting drafter: each must FAIL.

    ``params`` must warp the law (temperature != 1 or a filter) for the misreporting drafter to
    misreport anything; the default is temperature 0.7.
    """
    params = params or SamplingParams(temperature=0.7)
    cases = [CertificationCase(cls.name, "model", k, params, k + 2) for cls in BROKEN_RULES]
    cases.append(CertificationCase("rejection", MisreportingToyDrafter.name, k, params, k + 2))
    return cases


def tree_negative_controls(
    tree: tuple[int, ...] = (-1, -1, -1, 0, 1), params: SamplingParams | None = None
) -> list[CertificationCase]:
    """The tree rules' negative controls, each must FAIL: a rejected sibling's mass left in the
    residual, and deterministic (top-k) children handed to the i.i.d. rule as samples."""
    params = params or SamplingParams(temperature=0.7)
    depth = CertificationCase("specinfer", "model", len(tree), params, 1, tree).depth
    return [
        CertificationCase(SiblingMassLeftRule.name, "model", len(tree), params, depth + 2, tree),
        CertificationCase("specinfer", TopKAsSampledToyDrafter.name, len(tree), params, depth + 2, tree),
    ]


def run_cases(
    cases: Sequence[CertificationCase],
    setup: ToySetup = ToySetup(),
    *,
    num_sequences: int = 40_000,
    seed: int = 1234,
    alpha: float = DEFAULT_ALPHA,
    on_result: Callable[[CertificationResult], None] | None = None,
) -> list[CertificationResult]:
    """Certify every case (each with its own seed derived from ``seed``)."""
    results = []
    for i, case in enumerate(cases):
        result = certify_case(case, setup, num_sequences=num_sequences, seed=seed + i, alpha=alpha)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


# ------------------------------------------------------------------------------ the whole engine
@dataclass(frozen=True)
class EngineCase:
    """One engine configuration to certify on tiny transformers: drafter, K (None = the measured
    policy), sampling parameters, tested prefix length."""

    drafter: str
    k: int | None
    params: SamplingParams
    prefix_len: int
    rule: str = "rejection"
    draft_head: int | None = None  # restrict the draft model's head to the first N ids
    tree: str | None = None  # the tree drafter's shape, "DEPTH,EXPAND,BRANCH[,MAX_NODES]"
    tree_children: str = "fixed"
    draft_on_kernels: bool = False  # the model drafter's model: a bf16 one on verispec's CPU kernels

    def label(self) -> str:
        k = "auto" if self.k is None else str(self.k)
        head = f" head={self.draft_head}" if self.draft_head is not None else ""
        head += " on-kernels" if self.draft_on_kernels else ""
        tree = f" tree={self.tree} {self.tree_children}" if self.tree is not None else ""
        return (
            f"engine {self.rule}/{self.drafter}{head}{tree} K={k} n={self.prefix_len} "
            + CertificationCase("rejection", "model", 1, self.params, self.prefix_len).sampling_label()
        )


def toy_datastore(vocab_size: int, documents: int = 16, length: int = 48) -> Any:
    """The retrieval drafter's datastore for engine certification: fixed pseudo-random documents
    over the toy vocabulary (every short suffix occurs in them, with several continuations)."""
    from verispec.drafters.retrieval import Datastore

    rng = np.random.default_rng(1234)
    return Datastore.build(rng.integers(0, vocab_size, size=(documents, length)).tolist())


def toy_heads(hidden_size: int, num_heads: int = 3, seed: int = 4321) -> Any:
    """Medusa heads for engine certification: fixed random blocks (so that each head proposes
    something other than the LM head's choice, sometimes right and sometimes wrong)."""
    from verispec.drafters.heads import MedusaHeads

    heads = MedusaHeads(hidden_size, num_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return heads.eval()


def _toy_trained(drafter: str, target: Any) -> Any:
    if drafter == "medusa":
        return toy_heads(target.config.hidden_size)
    return toy_eagle(target) if drafter == "eagle" else None


def toy_eagle(target: Any, seed: int = 4321) -> Any:
    """An EAGLE head for engine certification: random weights, fixed by ``seed`` (its drafts are
    sometimes right and sometimes wrong, which is what the rules must survive)."""
    from verispec.drafters.eagle import EagleHead, EagleShape

    torch.manual_seed(seed)
    return EagleHead(EagleShape.for_target(target)).eval()


def certify_engine_case(
    case: EngineCase,
    *,
    vocab_size: int = 4,
    num_sequences: int = 12_000,
    seed: int = 0,
    alpha: float = DEFAULT_ALPHA,
    prompt: Sequence[int] = (1, 2, 3),
    model_seed: int = 0,
    broken_rule: AcceptanceRule | None = None,
    uncompacted_trees: bool = False,
    device: str = "cpu",
    policy: DraftPolicy | None = None,
) -> tuple[GoodnessOfFit, float]:
    """Sample ``num_sequences`` requests through :class:`~verispec.engine.Engine` (each with its
    own seed) on a tiny target/draft transformer pair built in code, and test the first
    ``prefix_len`` tokens against the target's exact law. Returns the fit and the acceptance rate.
    ``broken_rule`` swaps in a deliberately wrong rule, ``uncompacted_trees`` makes the engine keep
    a tree step's first entries instead of its accepted path's (both negative controls);
    ``device`` runs the engine there (the exact law is always computed on the CPU in fp32);
    ``policy`` replaces the engine's draft-length policy (e.g. one that schedules the model no
    draft, so that a composite's lookup drafts alone)."""
    from dataclasses import replace

    from verispec.certify.exact import exact_prefix_law_lm
    from verispec.certify.tiny import tiny_pair
    from verispec.config import EngineConfig
    from verispec.drafters.registry import make_drafter
    from verispec.drafters.tree import TreeShape
    from verispec.engine import Engine

    shape = TreeShape.parse(case.tree) if case.tree is not None else None
    if case.k is not None and case.prefix_len < case.k + 2:
        raise ConfigError(
            "the tested prefix must be at least K + 2 (the prefill's token, a full draft and its bonus "
            "token), or full-length drafts go untested"
        )
    law = exact_prefix_law_lm(tiny_pair(vocab_size, seed=model_seed)[0], case.params, prompt, case.prefix_len)
    target, draft = tiny_pair(vocab_size, seed=model_seed, device=device)
    if case.draft_on_kernels:
        from verispec.certify.tiny import kernel_draft

        draft = kernel_draft(vocab_size, seed=model_seed)
    batch = min(num_sequences, 1024)
    # Generate far enough that the first speculative step (after the prefill's token) is not cut
    # short by max_tokens: it drafts its full length (a chain's K, a tree's every node), and its
    # accepted tokens and bonus token fall inside a prefix of K + 2.
    full_draft = shape.max_nodes if shape else (case.k or 4)
    max_tokens = max(case.prefix_len, full_draft + 2)
    draft_room = max(case.k or 4, full_draft)
    max_len = len(prompt) + max_tokens + 1
    config = EngineConfig(
        max_batch=batch, max_len=max_len, num_draft_tokens=case.k, max_draft_tokens=draft_room,
        spec=SpecConfig(rule=case.rule, allow_lossy=case.rule == "typical"),
    )  # fmt: skip
    # Prompt lookup from single tokens up: on a tiny vocabulary every token has occurred before.
    drafter = make_drafter(
        case.drafter, draft_model=draft, vocab_size=vocab_size, max_batch=batch, max_len=max_len + 16,
        ngram_min=1, ngram_max=3, draft_head=case.draft_head, tree=shape, tree_children=case.tree_children,
        datastore=toy_datastore(vocab_size) if case.drafter == "retrieval" else None,
        target_model=target, heads=_toy_trained(case.drafter, target),
    )  # fmt: skip
    engine = Engine(target, None, drafter, config, policy=policy)
    if broken_rule is not None:
        engine.rule = broken_rule
    if uncompacted_trees:  # WRONG: the step's first entries stay, not the accepted path's

        def keep_prefix(batch: Any, draft: Any, accepted: list[int], paths: Any) -> None:
            engine.cache.keep_step_prefix([1 + a for a in accepted], [r.cache_slot for r in batch])

        engine._keep_accepted = keep_prefix  # type: ignore[method-assign]
    base = replace(case.params, max_tokens=max_tokens)
    for i in range(num_sequences):
        engine.add_request(prompt, replace(base, seed=seed * 1_000_003 + i), request_id=str(i))
    tokens = torch.full((num_sequences, case.prefix_len), 0, dtype=torch.long)
    drafted = accepted = 0
    for out in engine.run():
        if out.finished:
            tokens[int(out.request_id)] = torch.tensor(out.token_ids[: case.prefix_len])
            drafted += out.stats.num_draft_tokens
            accepted += out.stats.num_accepted_tokens
    counts = np.bincount(sequence_index(tokens, vocab_size), minlength=law.shape[0])
    return chi_square_gof(counts, law), accepted / drafted if drafted else 0.0
