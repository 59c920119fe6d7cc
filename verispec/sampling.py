"""The one path from logits to a next-token law, and sampling from it.

Every component that needs a law over the vocabulary (drafters, acceptance rules, plain decoding,
the exact laws of certification) calls :func:`to_probs`; none re-implements a piece of it. That is
what makes "the speculative output has the target's distribution" a statement about one function.
One exception, on the draft's side only: the model drafter's loop on verispec's kernels builds its
laws there (``ops.sampled_pick``'s steps, equal to these to fp32 rounding, certified in the
engine); a draft law may be any law, as long as each token is drawn from the one reported with it.
The target's laws, and so the output's, always come from here.

Order of operations (per row, the same everywhere):

1. **Check** the logits: NaN or +inf raise :class:`~verispec.errors.InputError`; -inf is allowed
   and means "this token is impossible". (The check is made once, on the final logits, so that an
   overflow introduced later, e.g. by a vanishing temperature, is caught too.)
2. **Penalties** on the raw logits, from the token history (:class:`TokenHistory`):
   repetition penalty for tokens seen in the prompt or the output (positive logits divided,
   negative ones multiplied, as in Keskar et al. 2019 / HF / vLLM), then frequency penalty
   (times the token's count in the output) and presence penalty (once if it occurs in the output)
   subtracted, as in the OpenAI API.
3. **Logit bias** added (+inf forces the token: the law is uniform over the forced tokens;
   -inf bans it).
4. **Greedy** rows (temperature 0): a point mass on the argmax, lowest token id on ties.
   Steps 5-8 do not apply to them.
5. **Temperature**: logits / T.
6. **Top-k**: keep the tokens whose logit is >= the k-th largest (ties at the boundary are kept).
7. **Top-p** (nucleus, Holtzman et al. 2020): keep the smallest set of most probable tokens whose
   mass reaches top_p under the law left by top-k (ties broken by the lowest id).
8. **Min-p** (Nguyen et al. 2024): drop the tokens whose probability is below min_p times the
   largest probability of the law left by top-p.
9. **Softmax** in fp32; removed tokens get probability exactly 0.

Sampling inverts the cumulative distribution: one float64 uniform ``u`` per row, the token is the
first whose float64 cumulative mass exceeds ``u`` times the row's total (so laws need not be
normalised: the residual of the rejection rule is used as is). One random number per token, no host
synchronisation. (The exponential race ``argmax(probs / E)`` used on GPUs by gpt-fast and vLLM
needs V random numbers per token, which costs several ms per row on a CPU.)

Randomness comes only from explicit per-request :class:`torch.Generator` objects, by one protocol
(:func:`uniform_draws`); a generator of ``None`` marks a row that takes the mode of its law and
consumes no randomness (used for greedy requests).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.config import SamplingParams
from verispec.errors import ConfigError, InputError

# Top-p candidates: tokens whose probability is at least this fraction of the row's largest; rows
# whose candidates do not hold top_p of the mass try the next ratio, and finally sort everything.
_NUCLEUS_RATIOS = (1e-4, 1e-7)
_SMALL_VOCAB = 1024


def cut_vocab(logits: Tensor, vocab_limit: int) -> Tensor:
    """Give ids ``>= vocab_limit`` (embedding padding past the tokenizer) probability 0, in place.
    ``logits`` ``[..., V]``. Every model's logits go through it before :func:`to_probs`, so the
    draft and target laws share one support and no undecodable id is ever produced."""
    if logits.shape[-1] > vocab_limit:
        logits[..., vocab_limit:] = float("-inf")
    return logits


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one request: seeded with ``seed``, or from OS entropy when None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    return gen


def generator_blocks(generators: Sequence[torch.Generator | None]) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of consecutive rows that share one generator object.

    Rows of one run draw their randomness together, in row order; rows with different
    generators never share a draw. A request's draws therefore depend only on its own rows,
    which is what makes a seeded request give the same output batched or alone.
    """
    blocks: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(generators) + 1):
        if i == len(generators) or generators[i] is not generators[start]:
            if len(generators) > 0:
                blocks.append((start, i))
            start = i
    return blocks


def uniform_draws(
    generators: Sequence[torch.Generator | None],
    counts: Sequence[int],
    k: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The randomness protocol of verispec: every random number any rule or sampler uses.

    Rows are grouped into maximal runs sharing one generator object (:func:`generator_blocks`).
    Each run, in order, makes ONE call ``torch.rand(sum(counts[run]) + len(run), float64)``: the
    first ``sum(counts[run])`` values are the acceptance uniforms of its rows (``counts[b]`` for row
    ``b``, row order), the last ``len(run)`` values are the uniforms that pick each row's final
    (sampled, recovered or bonus) token. Runs whose generator is None draw nothing.

    Returns ``accept`` ``[B, K]`` float64 (1.0 where unused) and ``final`` ``[B]`` float64
    (0.0 for rows without a generator).
    """
    batch = len(generators)
    accept = torch.ones((batch, k), dtype=torch.float64, device=device)
    final = torch.zeros(batch, dtype=torch.float64, device=device)
    used = None
    if k > 0:
        used = torch.arange(k, device=device).unsqueeze(0) < torch.tensor(counts, device=device).unsqueeze(1)
    for start, end in generator_blocks(generators):
        gen = generators[start]
        if gen is None:
            continue
        n_accept = sum(counts[start:end])
        draw = torch.rand(n_accept + end - start, dtype=torch.float64, generator=gen, device=gen.device)
        draw = draw.to(device)
        if n_accept and used is not None:
            block = accept[start:end]
            block[used[start:end]] = draw[:n_accept]  # boolean-mask assignment fills in row order
        final[start:end] = draw[n_accept:]
    return accept, final


#: Ids per block of :func:`mode`'s first pass.
_MODE_BLOCK = 64


def mode(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` (``[...]`` int64: the first index of each row's largest value, NaN
    counting as the largest, as torch gives it), in two vectorised passes on the CPU: each block of
    64 ids' largest value, then the first block holding the row's largest and the first such index
    in it. torch's argmax over the last dimension is not vectorised there (a verification's
    ``[5, 151936]`` rows: ~0.4 ms against ~0.07). Other devices, and rows not made of whole blocks,
    use argmax itself."""
    v = x.shape[-1]
    if x.device.type != "cpu" or v % _MODE_BLOCK or v < 4 * _MODE_BLOCK:
        return x.argmax(dim=-1)
    lead = x.shape[:-1]
    blocks = x.reshape(*lead, v // _MODE_BLOCK, _MODE_BLOCK)  # [..., V / 64, 64]
    first = blocks.amax(dim=-1).argmax(dim=-1)  # [...]: amax propagates NaN as argmax ranks it
    inside = blocks.gather(-2, first[..., None, None].expand(*lead, 1, _MODE_BLOCK)).squeeze(-2)  # [..., 64]
    return first * _MODE_BLOCK + inside.argmax(dim=-1)


def inverse_cdf(law: Tensor, u: Tensor) -> Tensor:
    """Sample each row of ``law`` (``[N, V]``, non-negative, need not sum to 1) with its uniform
    ``u`` (``[N]`` float64 in [0, 1)): the first token whose cumulative mass exceeds ``u * total``.
    Tokens of mass 0 are never returned (the cumulative mass does not grow across them)."""
    cdf = law.to(torch.float64).cumsum(dim=1)  # [N, V]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [N, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(law.shape[1] - 1)


def pick(law: Tensor, u: Tensor, greedy: Tensor | None) -> Tensor:
    """``[N]`` int64: :func:`inverse_cdf` per row, or the mode (lowest id on ties) where ``greedy``
    (``[N]`` bool, or None when no row is greedy)."""
    if greedy is not None and greedy.device.type == "cpu" and bool(greedy.all()):
        return mode(law)  # every row greedy (known without a device sync): no cumulative sums
    token = inverse_cdf(law, u)
    if greedy is not None:
        token = torch.where(greedy, mode(law), token)
    return token


def greedy_mask(generators: Sequence[torch.Generator | None], device: torch.device) -> Tensor | None:
    """``[N]`` bool marking rows without a generator, or None when every row has one."""
    if all(g is not None for g in generators):
        return None
    return torch.tensor([g is None for g in generators], dtype=torch.bool, device=device)


def sample(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row of ``probs`` (``[N, V]`` fp32) with the row's generator.

    Returns ``[N]`` int64. Each row with a generator consumes one uniform (:func:`uniform_draws`
    with no acceptance uniforms); a row whose generator is None returns the mode of its law (lowest
    id on ties) and consumes nothing: pass None exactly for greedy rows.
    """
    if probs.dim() != 2:
        raise InputError(f"sample() expects probs of shape [N, V], got {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise InputError(f"sample() got {len(generators)} generators for {probs.shape[0]} rows; pass one per row")
    _, u = uniform_draws(generators, [0] * len(generators), 0, probs.device)
    return pick(probs, u, greedy_mask(generators, probs.device))


@dataclass(frozen=True)
class TokenHistory:
    """What penalties need to know about the tokens seen so far, one row per logits row.

    ``output_counts`` ``[N, V]`` int32: how often each token occurs in the generated output.
    ``prompt_mask`` ``[N, V]`` bool: whether each token occurs in the prompt.
    """

    output_counts: Tensor  # [N, V] int32
    prompt_mask: Tensor  # [N, V] bool

    @staticmethod
    def from_ids(
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> TokenHistory:
        if len(prompts) != len(outputs):
            raise InputError(f"got {len(prompts)} prompts but {len(outputs)} outputs; pass one of each per row")
        counts = torch.zeros((len(prompts), vocab_size), dtype=torch.int32, device=device)
        mask = torch.zeros((len(prompts), vocab_size), dtype=torch.bool, device=device)
        for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            for ids in (prompt, output):
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            if len(prompt):
                mask[row, torch.as_tensor(list(prompt), dtype=torch.long, device=device)] = True
            if len(output):
                idx = torch.as_tensor(list(output), dtype=torch.long, device=device)
                counts[row].index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        return TokenHistory(counts, mask)

    def extended(self, token_ids: Tensor) -> TokenHistory:
        """The history after appending ``token_ids`` (``[N, T]`` int64, -1 = nothing) to the output."""
        valid = token_ids >= 0
        idx = token_ids.clamp_min(0)
        counts = self.output_counts.clone()
        counts.scatter_add_(1, idx, valid.to(torch.int32))
        return TokenHistory(counts, self.prompt_mask)

    def for_verification(self, draft_ids: Tensor, parents: Tensor | None = None) -> TokenHistory:
        """Histories of the ``K + 1`` verification rows of each request.

        ``draft_ids`` ``[B, K]`` int64 (-1 = padding). Returns ``B * (K + 1)`` rows: row
        ``b * (K + 1) + i`` is request ``b``'s history with its first ``i`` draft tokens appended,
        which is the history the target would have had at that position in plain decoding. For a
        tree (``parents`` ``[B, K]``, :class:`~verispec.verify.Draft`), row ``b * (K + 1) + 1 + i``
        has the tokens of node ``i``'s path appended (row ``b * (K + 1)``: none).
        """
        batch, k = draft_ids.shape
        vocab = self.output_counts.shape[1]
        valid = (draft_ids >= 0).to(torch.int32)  # [B, K]
        if parents is not None:
            from verispec.verify.tree import path_matrix  # (verify imports sampling)

            nodes = torch.zeros((batch, k, vocab), dtype=torch.int32, device=draft_ids.device)
            nodes.scatter_add_(2, draft_ids.clamp_min(0).unsqueeze(-1), valid.unsqueeze(-1))  # [B, K, V]
            on_path = path_matrix(parents, valid.sum(dim=1)).to(torch.int32)  # [B, K + 1, K]
            counts = self.output_counts.unsqueeze(1) + torch.bmm(on_path.float(), nodes.float()).to(torch.int32)
        else:
            onehot = torch.zeros((batch, k + 1, vocab), dtype=torch.int32, device=draft_ids.device)
            # Token i of the draft counts from row i + 1 on.
            onehot[:, 1:].scatter_add_(2, draft_ids.clamp_min(0).unsqueeze(-1), valid.unsqueeze(-1))
            counts = self.output_counts.unsqueeze(1) + onehot.cumsum(dim=1, dtype=torch.int32)  # [B, K+1, V]
        mask = self.prompt_mask.unsqueeze(1).expand(batch, k + 1, vocab)
        return TokenHistory(counts.reshape(batch * (k + 1), vocab), mask.reshape(batch * (k + 1), vocab))


class _Rows:
    """Per-row parameter columns. Python work is O(distinct params) + one pass over the rows, so
    that a batch of many rows sharing one SamplingParams (certification, big batches) stays cheap."""

    def __init__(self, params: Sequence[SamplingParams], like: Tensor) -> None:
        self.params = params
        self.distinct = list({id(p): p for p in params}.values())
        self.like = like

    def any(self, test: Callable[[SamplingParams], bool]) -> bool:
        return any(test(p) for p in self.distinct)

    def column(self, value: Callable[[SamplingParams], float], dtype: torch.dtype = torch.float32) -> Tensor:
        """``[N, 1]`` tensor of ``value(params[row])``."""
        n, device = len(self.params), self.like.device
        if len(self.distinct) == 1:
            return torch.full((n, 1), value(self.distinct[0]), dtype=dtype, device=device)
        return torch.tensor([value(p) for p in self.params], dtype=dtype, device=device).unsqueeze(1)


def _check_logits(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    if logits.dim() != 2:
        raise InputError(f"to_probs() expects logits of shape [N, V], got {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise InputError(f"to_probs() got {len(params)} SamplingParams for {logits.shape[0]} rows; pass one per row")
    if not logits.is_floating_point():
        raise InputError(f"logits must be floating point, got {logits.dtype}")


def _why_no_law(logits: Tensor, row_max: Tensor, params: Sequence[SamplingParams], row: int) -> InputError:
    """Why row ``row``'s final logits have no law (rare path: costs what it needs)."""
    raw = logits[row]
    if bool(torch.isnan(raw).any() | (raw == float("inf")).any()):
        return InputError(
            f"logits row {row} contains NaN or +inf; check the model's numerics "
            "(fp16 overflow is the usual cause: run it in fp32 or bf16)"
        )
    if float(row_max[row]) == float("-inf"):
        return InputError(
            f"every token of row {row} has probability 0 (all logits are -inf after penalties and "
            "logit_bias); remove the -inf biases or the banned tokens"
        )
    return InputError(
        f"logits of row {row} overflow fp32 after penalties, logit_bias and temperature "
        f"(temperature {params[row].temperature!r}); use temperature=0 for greedy decoding "
        "instead of a vanishing temperature"
    )


def _apply_penalties(x: Tensor, rows: _Rows, history: TokenHistory | None) -> Tensor:
    if history is None:
        raise ConfigError(
            "repetition/presence/frequency penalties need the token history; pass history=TokenHistory(...)"
        )
    if history.output_counts.shape != x.shape or history.prompt_mask.shape != x.shape:
        raise InputError(
            f"history has shape {tuple(history.output_counts.shape)} but logits have {tuple(x.shape)}; "
            "build one history row per logits row"
        )
    rep = rows.column(lambda p: p.repetition_penalty)
    seen = history.prompt_mask | (history.output_counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = history.output_counts.to(torch.float32)
    freq = rows.column(lambda p: p.frequency_penalty)
    pres = rows.column(lambda p: p.presence_penalty)
    return x - freq * counts - pres * (counts > 0).to(torch.float32)


def _apply_logit_bias(x: Tensor, params: Sequence[SamplingParams], table: _Rows) -> Tensor:
    if not table.any(lambda p: bool(p.logit_bias)):
        return x
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    vocab = x.shape[1]
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token >= vocab:
                raise ConfigError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})")
            rows.append(row)
            cols.append(token)
            vals.append(float(bias))
    if not rows:
        return x
    index = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
    x = x.index_put(index, torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)
    if any(v == float("inf") for v in vals):
        # +inf forces a token: the law becomes uniform over the forced tokens of that row. The
        # forced set comes from the biases, not from x == inf: a -inf logit plus a +inf bias is NaN.
        inf_bias = torch.tensor([v == float("inf") for v in vals], device=x.device)
        forced = torch.zeros_like(x, dtype=torch.bool).index_put(index, inf_bias) | (x == float("inf"))
        x = torch.where(forced.any(dim=1, keepdim=True), torch.where(forced, 0.0, float("-inf")), x)
    return x


def _top_k(x: Tensor, rows: _Rows) -> Tensor:
    """Step 6: keep the tokens whose logit is >= the row's k-th largest (ties kept)."""
    vocab = x.shape[1]
    top_k = rows.column(lambda p: 0 if p.greedy else min(p.top_k, vocab), torch.long)  # [N, 1]
    kmax = max(min(p.top_k, vocab) for p in rows.distinct if not p.greedy)
    kth = torch.topk(x, kmax, dim=1).values.gather(1, (top_k - 1).clamp(0, kmax - 1))
    return x.masked_fill((top_k > 0) & (x < kth), float("-inf"))


def _top_p(x: Tensor, rows: _Rows) -> Tensor:
    """Step 7: keep the smallest set of most probable tokens whose mass reaches top_p.

    Order: probability descending, lowest id first among equal probabilities; a token is kept when
    the float64 mass of the tokens before it is below top_p (so the most probable always stays).
    Only candidates are sorted: tokens within a ratio of the row's most probable, when they hold
    at least top_p of the mass (then the kept set lies among them); otherwise the whole row.
    """
    active = [i for i, p in enumerate(rows.params) if not p.greedy and p.top_p < 1.0]
    every_row = len(active) == x.shape[0]
    index = torch.tensor(active, device=x.device)
    sub = x if every_row else x[index]  # [A, V]
    probs = torch.softmax(sub, dim=1)
    top_p = torch.tensor([rows.params[i].top_p for i in active], dtype=torch.float64, device=x.device)  # [A]
    # Candidates: the first ratio whose candidates hold top_p of the row's mass, else every token
    # (small vocabularies: every token at once, sorting them is cheaper than choosing).
    row_max = probs.amax(dim=1, keepdim=True)
    cand: Tensor | None = None
    settled = torch.zeros(len(active), dtype=torch.bool, device=x.device)
    for ratio in _NUCLEUS_RATIOS if x.shape[1] > _SMALL_VOCAB else ():
        mask = probs >= row_max * ratio
        # fp32 mass with a margin far above its rounding error: "enough" must never be wrong.
        enough = torch.where(mask, probs, 0.0).sum(dim=1) >= top_p + 1e-4
        take = enough & ~settled
        cand = mask if cand is None else torch.where(take.unsqueeze(1), mask, cand)
        settled |= enough
        if bool(settled.all()):  # one host sync per ratio tried
            break
    if cand is None:
        cand = torch.ones_like(probs, dtype=torch.bool)
    elif not bool(settled.all()):
        cand = cand | ~settled.unsqueeze(1)  # unsettled rows: every token is a candidate
    # Pack each row's candidates (in id order) to the left of a [A, C] matrix, then sort each row.
    r, c = cand.nonzero(as_tuple=True)  # ordered by row, then id
    counts = torch.bincount(r, minlength=len(active))
    slot = torch.arange(r.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[r]
    width = int(counts.max())  # host sync: the packed width
    vals = torch.full((len(active), width), -1.0, device=x.device)  # -1 < any probability: sorts last
    ids = torch.zeros((len(active), width), dtype=torch.long, device=x.device)
    vals[r, slot] = probs[r, c]
    ids[r, slot] = c
    vals, order = torch.sort(vals, dim=1, descending=True, stable=True)  # equal probabilities keep id order
    ids = ids.gather(1, order)
    v64 = vals.to(torch.float64)
    kept = (v64.cumsum(dim=1) - v64 < top_p.unsqueeze(1)) & (vals >= 0)  # mass before each token < top_p
    keep = torch.zeros_like(cand)
    rows_of = torch.arange(len(active), device=x.device).unsqueeze(1).expand_as(ids)
    keep[rows_of[kept], ids[kept]] = True
    nucleus = torch.where(keep, sub, float("-inf"))
    if every_row:
        return nucleus
    x = x.clone()
    x[index] = nucleus
    return x


@dataclass(frozen=True)
class Laws:
    """Next-token laws of many rows, and the rows that have none.

    ``probs`` ``[N, V]`` fp32, each row summing to 1, except the rows of ``failed`` (row index ->
    why), which are all zero: NaN or +inf logits from the model, or every token banned.
    """

    probs: Tensor  # [N, V] fp32
    failed: dict[int, InputError]


def build_laws(logits: Tensor, params: Sequence[SamplingParams], history: TokenHistory | None = None) -> Laws:
    """:func:`to_probs` that reports the rows without a law instead of raising for the first one,
    so that a batch can go on without them (the engine ends those requests alone)."""
    _check_logits(logits, params)
    x = logits.to(torch.float32)  # [N, V]
    rows = _Rows(params, x)
    if rows.any(lambda p: p.uses_history):
        x = _apply_penalties(x, rows, history)
    x = _apply_logit_bias(x, params, rows)

    any_greedy, any_sampled = rows.any(lambda p: p.greedy), rows.any(lambda p: not p.greedy)
    if any_sampled:
        if rows.any(lambda p: not p.greedy and p.temperature != 1.0):
            x = x / rows.column(lambda p: 1.0 if p.greedy else p.temperature)
        if rows.any(lambda p: not p.greedy and p.top_k > 0):
            x = _top_k(x, rows)
        if rows.any(lambda p: not p.greedy and p.top_p < 1.0):
            x = _top_p(x, rows)
        if rows.any(lambda p: not p.greedy and p.min_p > 0):
            probs = torch.softmax(x, dim=1)
            min_p = rows.column(lambda p: 0.0 if p.greedy else p.min_p)
            x = x.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))

    # One host sync: a row whose largest final logit is not finite has no law. NaN or +inf from
    # the model, fp32 overflow, or every token banned (-inf).
    row_max = x.amax(dim=1)  # [N]; amax propagates NaN
    finite = torch.isfinite(row_max)  # [N] bool
    failed: dict[int, InputError] = {}
    if not bool(finite.all()):
        bad = (~finite).nonzero()[:, 0].tolist()  # rare path
        failed = {row: _why_no_law(logits, row_max, params, row) for row in bad}
        x = torch.where(finite.unsqueeze(1), x, 0.0)  # rows without a law: zeroed below
    if not any_greedy:
        probs = torch.softmax(x, dim=1)
    else:  # the mode: 1 at the largest logit (the lowest id on ties), 0 elsewhere
        probs = torch.zeros_like(x).scatter_(1, mode(x).unsqueeze(1), 1.0)
        if any_sampled:  # (when every row is greedy, no softmax to take)
            probs = torch.where(rows.column(lambda p: p.greedy, torch.bool), probs, torch.softmax(x, dim=1))
    if failed:
        probs = probs * finite.unsqueeze(1)
    return Laws(probs, failed)


def to_probs(logits: Tensor, params: Sequence[SamplingParams], history: TokenHistory | None = None) -> Tensor:
    """Turn logits into next-token laws, one row per entry of ``params`` (see module docstring).

    ``logits`` ``[N, V]`` any float dtype; ``history`` rows align with ``logits`` rows and are
    required only when a penalty is on. Returns ``[N, V]`` fp32, each row summing to 1; a row
    without a law raises :class:`InputError` (:func:`build_laws` reports them instead).
    """
    laws = build_laws(logits, params, history)
    if laws.failed:
        raise laws.failed[min(laws.failed)]
    return laws.probs


def check_probs(probs: Tensor, name: str, used: Tensor | None = None, atol: float = 1e-3) -> None:
    """Raise :class:`InputError` unless every row of ``probs`` (``[..., V]``) is a law: finite,
    non-negative, summing to 1 within ``atol``. ``used`` (``[...]`` bool) limits the check to
    some rows. Two passes over the data and one host sync."""
    sums = probs.sum(dim=-1)  # NaN or inf anywhere makes the sum non-finite
    mins = probs.amin(dim=-1)
    bad = ~(((sums - 1.0).abs() <= atol) & (mins >= 0))
    if used is not None:
        bad &= used
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise InputError(
            f"{name}{list(where)} is not a probability distribution (sum {float(sums[where]):.6g}, "
            f"min {float(mins[where]):.6g}; entries must be finite and >= 0 and sum to 1); "
            "build it with verispec.sampling.to_probs"
        )
