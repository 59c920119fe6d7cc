"""Certification of the whole engine on tiny transformers built in code: for every drafter and
for temperature / top-k / top-p / min-p / penalties, the first tokens sampled through the engine
(prefix of K + 2: the prefill's token, then a full-length draft and its bonus token, with
max_tokens past the prefix so that no draft inside it is cut short) follow the target's exact
law; a broken rule in the same engine fails."""

from __future__ import annotations

import pytest

from verispec.certify.core import DEFAULT_ALPHA, EngineCase, certify_engine_case
from verispec.config import SamplingParams
from verispec.verify.broken import AlwaysAcceptRule, ResidualIsTargetRule

N = 8_000
REPETITIVE = (3, 0, 0, 1, 0, 0, 2, 0, 0)  # so that prompt lookup finds matches

CASES = [
    EngineCase("model", 2, SamplingParams(temperature=1.0), 4),
    EngineCase("model", 3, SamplingParams(temperature=0.7, top_k=3, min_p=0.05), 5),
    EngineCase("model", None, SamplingParams(temperature=0.9, top_p=0.85), 5),
    EngineCase(
        "model",
        2,
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.2),
        4,
    ),
    EngineCase("ngram", 2, SamplingParams(temperature=0.8), 4),
    EngineCase("ngram", 2, SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.4), 4),
    EngineCase("composite", 2, SamplingParams(temperature=0.9, min_p=0.1), 4),
    EngineCase("model", 3, SamplingParams(temperature=0.9), 5, draft_head=2),
    # a restricted head's laws built on its ids alone (top-k / top-p there), and on the whole row (a penalty)
    EngineCase("model", 3, SamplingParams(temperature=0.8, top_k=3, top_p=0.9), 5, draft_head=3),
    EngineCase("model", 2, SamplingParams(temperature=1.0, frequency_penalty=0.4), 4, draft_head=3),
    EngineCase("tree", 2, SamplingParams(temperature=1.0), 4, tree="2,2,2,6", tree_children="fixed"),
    EngineCase("suffix", 2, SamplingParams(temperature=0.8, top_k=3), 4),
    EngineCase("tree", 2, SamplingParams(temperature=0.8, top_p=0.9), 4, tree="2,2,2,6", tree_children="sampled"),
    EngineCase(
        "tree", 2, SamplingParams(temperature=0.9, frequency_penalty=0.4), 4, tree="2,2,2,6", tree_children="distinct"
    ),
    EngineCase("retrieval", 2, SamplingParams(temperature=0.9, top_p=0.9), 4),
    # Medusa heads on the target's hidden state: a chain, and a static tree of their candidates
    EngineCase("medusa", 3, SamplingParams(temperature=0.8, min_p=0.05), 5),
    EngineCase("medusa", 2, SamplingParams(temperature=1.0, top_k=3), 4, tree="[[0],[1],[0,0],[1,0]]"),
    # the EAGLE head (its own features, autoregressive): a chain, and an EAGLE-2 dynamic tree
    EngineCase("eagle", 3, SamplingParams(temperature=0.9, top_p=0.9), 5),
    EngineCase("eagle", 2, SamplingParams(temperature=1.0, min_p=0.05), 4, tree="2,2,2,5"),
    # a static shape (Medusa-style rank paths): top-k and sampled children
    EngineCase("tree", 2, SamplingParams(temperature=1.0, top_k=3), 4, tree="[[0],[1],[0,0],[0,1],[1,0]]"),
    EngineCase(
        "tree", 2, SamplingParams(temperature=0.8), 4, tree="[[0],[1],[0,0],[0,1],[1,0]]", tree_children="sampled"
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_engine_is_lossless(case: EngineCase) -> None:
    gof, acceptance = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE)
    assert gof.p_value >= DEFAULT_ALPHA, (case.label(), gof)
    assert acceptance > 0.0  # speculation happened


def test_a_composites_lookup_drafting_while_the_model_is_off_is_lossless() -> None:
    """K chosen per step, every step scheduled K = 0 for the model: the composite's lookup drafts
    alone, to its own length within the policy's ceiling (``free_when_off``)."""
    from tests.tiny import ModelOffPolicy

    case = EngineCase("composite", None, SamplingParams(temperature=0.9, top_p=0.95), 5)
    gof, acceptance = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE, policy=ModelOffPolicy(4))
    assert gof.p_value >= DEFAULT_ALPHA, gof
    assert acceptance > 0.0  # the lookup drafted and was accepted
    broken, _ = certify_engine_case(
        case, num_sequences=N, seed=1, prompt=REPETITIVE, policy=ModelOffPolicy(4), broken_rule=AlwaysAcceptRule()
    )
    assert broken.p_value < DEFAULT_ALPHA  # the same test sees a wrong rule on these drafts


@pytest.mark.parametrize(
    ("rule", "drafter"),
    [(AlwaysAcceptRule(), "model"), (ResidualIsTargetRule(), "model"), (AlwaysAcceptRule(), "eagle")],
    ids=lambda r: getattr(r, "name", r),
)
def test_engine_with_a_broken_rule_fails(rule, drafter: str) -> None:  # type: ignore[no-untyped-def]
    case = EngineCase(drafter, 2, SamplingParams(temperature=1.0), 4)
    gof, _ = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE, broken_rule=rule)
    assert gof.p_value < DEFAULT_ALPHA


def test_a_tree_whose_accepted_path_was_not_compacted_fails() -> None:
    """The next step must see the accepted path's keys and values, not the step's first entries."""
    case = EngineCase("tree", 2, SamplingParams(temperature=1.0), 5, tree="2,3,3,9", tree_children="fixed")
    gof, acceptance = certify_engine_case(case, num_sequences=4_000, seed=1, prompt=REPETITIVE, uncompacted_trees=True)
    assert acceptance > 0.0
    assert gof.p_value < DEFAULT_ALPHA


# Drafting on verispec's kernels (a bf16 draft: Transformer.draft, its laws by ops.sampled_pick):
# top-k and top-p with the request's own ids beside a head of 3, min-p, and every id in the head
KERNEL_CASES = [
    EngineCase("model", 3, SamplingParams(temperature=0.8, top_k=3, top_p=0.9), 5, draft_head=3, draft_on_kernels=True),
    EngineCase("model", 3, SamplingParams(temperature=0.9, min_p=0.1), 5, draft_head=3, draft_on_kernels=True),
    EngineCase("model", 3, SamplingParams(temperature=1.0), 5, draft_head=4, draft_on_kernels=True),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.label())
def test_drafting_on_the_kernels_is_lossless(case: EngineCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled drafts proposed in one native call a proposal (their laws by the kernels, their
    tokens drawn with the requests' generators) leave the engine's output law the target's."""
    from tests.kernels import require_kernels
    from verispec.drafters.model import ModelDrafter

    require_kernels()
    native: list[bool] = []  # (a mark for each proposal drafted in one native call)
    real = ModelDrafter._draft_natively
    monkeypatch.setattr(ModelDrafter, "_draft_natively", lambda self, *a: (native.append(True), real(self, *a))[1])
    gof, acceptance = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE)
    assert gof.p_value >= DEFAULT_ALPHA, (case.label(), gof)
    assert acceptance > 0.0 and len(native) > 10


def test_drafting_on_the_kernels_with_skewed_uniforms_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the same drafting with each token drawn by u^2 instead of u (not from
    the law it reports) changes the output's law."""
    import verispec.drafters.model as model_drafter
    from tests.kernels import require_kernels
    from verispec.models.transformer import DraftSampling

    require_kernels()

    def skewed(rules, merge, draw):  # type: ignore[no-untyped-def]
        return DraftSampling(rules, merge, lambda i, rows: [u * u for u in draw(i, rows)])

    monkeypatch.setattr(model_drafter, "DraftSampling", skewed)
    gof, _ = certify_engine_case(KERNEL_CASES[0], num_sequences=N, seed=1, prompt=REPETITIVE)
    assert gof.p_value < 1e-6, gof


@pytest.mark.parametrize(
    ("drafter", "params", "head"),
    [
        ("model", SamplingParams(temperature=1.0), None),
        ("model", SamplingParams(temperature=0.8, top_p=0.9), 3),
        ("composite", SamplingParams(temperature=0.9), None),
    ],
    ids=["model", "model-head", "composite"],
)
def test_drafts_ended_by_their_confidence_are_lossless(drafter: str, params: SamplingParams, head: int | None) -> None:
    """A draft stop ends drafts after doubtful tokens (``verispec.engine.confidence``): the law is
    unchanged whether a position was drafted or left to the bonus token, as long as the doubtful
    token itself is kept."""
    from tests.tiny import ThresholdStopPolicy

    policy = ThresholdStopPolicy(3, threshold=0.5)
    case = EngineCase(drafter, None, params, 5, draft_head=head)
    gof, acceptance = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE, policy=policy)
    assert gof.p_value >= DEFAULT_ALPHA, gof
    assert acceptance > 0.0
    assert policy.ended > 1000 and policy.continued > 1000, (policy.ended, policy.continued)  # both ways, often


def test_taking_back_the_doubtful_token_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of the stop: a drafter that drops the doubtful token it drew (ends the
    draft before it instead of after it) changes the law that position was drawn from."""
    import verispec.drafters.registry as registry
    from tests.tiny import ThresholdStopPolicy
    from verispec.drafters.model import ModelDrafter
    from verispec.verify.base import Draft

    policy = ThresholdStopPolicy(3, threshold=0.5)
    real_propose = ModelDrafter.propose

    def drops_doubtful(self, batch, max_tokens):  # type: ignore[no-untyped-def]
        draft = real_propose(self, batch, max_tokens)
        ended = policy.last.ended if policy.last is not None else set()
        num = draft.num_tokens.clone()
        for row in ended:
            num[row] -= 1
            self._get(batch.request_ids[row]).last_k -= 1  # (its cache as if it had never drafted it)
        width = int(num.max()) if len(num) else 0
        assert draft.probs is not None
        return Draft(draft.token_ids[:, :width], num, draft.probs[:, :width])

    monkeypatch.setattr(registry.ModelDrafter, "propose", drops_doubtful)
    case = EngineCase("model", None, SamplingParams(temperature=1.0), 5)
    gof, _ = certify_engine_case(case, num_sequences=N, seed=1, prompt=REPETITIVE, policy=policy)
    assert policy.ended > 1000
    assert gof.p_value < DEFAULT_ALPHA, gof
