"""The one path from logits to a next-token law, and sampling from it.

Every component that needs a law over the vocabulary (drafters, acceptance rules, plain decoding,
the exact laws of certification) calls :func:`to_probs`; none re-implements a piece of it. That is
what makes "the speculative output has the target's distribution" a statement about one function.

Order of operations (per row, the same everywhere):

1. **Check** the logits: NaN or +inf raise :class:`~verispec.errors.InputError`; -inf is allowed
   and means "this token is impossible".
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

Sampling draws from a law with the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d.
(as in gpt-fast and vLLM): exact, no cumulative sums, no host synchronisation. Randomness comes
only from explicit per-request :class:`torch.Generator` objects; a generator of ``None`` marks a
row that takes the mode of its law and consumes no randomness (used for greedy requests).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.config import SamplingParams
from verispec.errors import ConfigError, InputError

# Smallest positive normal fp32: exponentials are clamped to it so that probs / E never divides by 0.
_TINY = torch.finfo(torch.float32).tiny


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


def exponentials(
    generators: Sequence[torch.Generator | None], vocab_size: int, device: torch.device
) -> Tensor:
    """``E ~ Exp(1)`` of shape ``[N, V]`` fp32, one row per generator entry; rows whose generator is
    None get ones (so that the race picks the mode) and consume nothing."""
    out = torch.ones((len(generators), vocab_size), dtype=torch.float32, device=device)
    for start, end in generator_blocks(generators):
        gen = generators[start]
        if gen is None:
            continue
        draw = torch.empty((end - start, vocab_size), dtype=torch.float32, device=gen.device)
        draw.exponential_(generator=gen)
        out[start:end] = draw.to(device)
    return out.clamp_min_(_TINY)


def race(probs: Tensor, exp_noise: Tensor) -> Tensor:
    """The exponential race: ``argmax(probs / E)`` is distributed as ``probs`` (unnormalised is
    fine: scaling a row does not change its argmax). ``probs`` ``[N, V]``; returns ``[N]`` int64."""
    return (probs / exp_noise).argmax(dim=-1)


def sample(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row of ``probs`` (``[N, V]`` fp32) with the row's generator.

    Returns ``[N]`` int64. A row whose generator is None returns the mode of its law (lowest id on
    ties) and consumes no randomness: pass None exactly for greedy rows.
    """
    if probs.dim() != 2:
        raise InputError(f"sample() expects probs of shape [N, V], got {tuple(probs.shape)}")
    if len(generators) != probs.shape[0]:
        raise InputError(
            f"sample() got {len(generators)} generators for {probs.shape[0]} rows; pass one per row"
        )
    return race(probs, exponentials(generators, probs.shape[1], probs.device))


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
            raise InputError(
                f"got {len(prompts)} prompts but {len(outputs)} outputs; pass one of each per row"
            )
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

    def for_verification(self, draft_ids: Tensor) -> TokenHistory:
        """Histories of the ``K + 1`` verification rows of each request.

        ``draft_ids`` ``[B, K]`` int64 (-1 = padding). Returns ``B * (K + 1)`` rows: row
        ``b * (K + 1) + i`` is request ``b``'s history with its first ``i`` draft tokens appended,
        which is the history the target would have had at that position in plain decoding.
        """
        batch, k = draft_ids.shape
        vocab = self.output_counts.shape[1]
        valid = (draft_ids >= 0).to(torch.int32)  # [B, K]
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
        raise InputError(
            f"to_probs() got {len(params)} SamplingParams for {logits.shape[0]} rows; pass one per row"
        )
    if not logits.is_floating_point():
        raise InputError(f"logits must be floating point, got {logits.dtype}")
    # One host sync per call: a NaN or +inf logit would silently poison every law built from it.
    bad = torch.isnan(logits) | (logits == float("inf"))
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0, 0])
        raise InputError(
            f"logits row {row} contains NaN or +inf; check the model's numerics "
            "(fp16 overflow is the usual cause: run it in fp32 or bf16)"
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


def _top_k_top_p(x: Tensor, rows: _Rows) -> Tensor:
    """Steps 6-7 on temperature-scaled logits ``x`` [N, V] (greedy rows have neither)."""
    vocab = x.shape[1]
    top_k = rows.column(lambda p: 0 if p.greedy else min(p.top_k, vocab), torch.long)  # [N, 1]
    use_k = rows.any(lambda p: not p.greedy and p.top_k > 0)
    if not rows.any(lambda p: not p.greedy and p.top_p < 1.0):
        # Top-k alone needs only the k-th largest value of each row.
        kmax = max(min(p.top_k, vocab) for p in rows.distinct if not p.greedy)
        kth = torch.topk(x, kmax, dim=1).values.gather(1, (top_k - 1).clamp(0, kmax - 1))
        return x.masked_fill((top_k > 0) & (x < kth), float("-inf"))
    # stable=True: equal logits stay in id order, so top-p ties are broken by the lowest id.
    sorted_x, order = torch.sort(x, dim=1, descending=True, stable=True)  # [N, V]
    if use_k:
        kth = sorted_x.gather(1, torch.where(top_k > 0, top_k - 1, vocab - 1))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=1)
    mass_before = probs.cumsum(dim=1) - probs  # [N, V]: mass of the strictly more probable tokens
    # Rows with top_p == 1 never drop anything (avoid cumsum rounding cutting their tail).
    threshold = rows.column(lambda p: p.top_p if (p.top_p < 1.0 and not p.greedy) else float("inf"))
    drop = mass_before >= threshold
    drop[:, 0] = False  # the most probable token always stays
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def to_probs(logits: Tensor, params: Sequence[SamplingParams], history: TokenHistory | None = None) -> Tensor:
    """Turn logits into next-token laws, one row per entry of ``params`` (see module docstring).

    ``logits`` ``[N, V]`` any float dtype; ``history`` rows align with ``logits`` rows and are
    required only when a penalty is on. Returns ``[N, V]`` fp32, each row summing to 1.
    """
    _check_logits(logits, params)
    x = logits.to(torch.float32)  # [N, V]
    rows = _Rows(params, x)
    if rows.any(lambda p: p.uses_history):
        x = _apply_penalties(x, rows, history)
    x = _apply_logit_bias(x, params, rows)

    any_greedy = rows.any(lambda p: p.greedy)
    if rows.any(lambda p: not p.greedy):
        x = x / rows.column(lambda p: 1.0 if p.greedy else p.temperature)
        if rows.any(lambda p: not p.greedy and (p.top_k > 0 or p.top_p < 1.0)):
            x = _top_k_top_p(x, rows)
        if rows.any(lambda p: not p.greedy and p.min_p > 0):
            probs = torch.softmax(x, dim=1)
            min_p = rows.column(lambda p: 0.0 if p.greedy else p.min_p)
            x = x.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))

    # One host sync: a row whose every token is banned has no law; say so instead of returning NaN.
    # A row max of +inf or NaN means fp32 overflow (logits / a tiny temperature, or penalties and
    # biases pushing a logit past 3.4e38): softmax would return NaN, so say that too.
    row_max = x.max(dim=1).values
    dead = row_max == float("-inf")
    overflow = (row_max == float("inf")) | torch.isnan(row_max)
    if bool((dead | overflow).any()):
        if bool(dead.any()):
            row = int(dead.nonzero()[0, 0])
            raise InputError(
                f"every token of row {row} has probability 0 (all logits are -inf after penalties and "
                "logit_bias); remove the -inf biases or the banned tokens"
            )
        row = int(overflow.nonzero()[0, 0])
        raise InputError(
            f"logits of row {row} overflow fp32 after penalties, logit_bias and temperature "
            f"(temperature {params[row].temperature!r}); use temperature=0 for greedy decoding "
            "instead of a vanishing temperature"
        )
    probs = torch.softmax(x, dim=1)
    if any_greedy:
        mode = torch.nn.functional.one_hot(x.argmax(dim=1), x.shape[1]).to(torch.float32)
        probs = torch.where(rows.column(lambda p: p.greedy, torch.bool), mode, probs)
    return probs


def check_probs(probs: Tensor, name: str, atol: float = 1e-3) -> None:
    """Raise :class:`InputError` unless every row of ``probs`` (``[..., V]``) is a law:
    finite, non-negative, summing to 1 within ``atol``. One host sync."""
    finite = torch.isfinite(probs).all(dim=-1)
    nonneg = (probs >= 0).all(dim=-1)
    sums = probs.sum(dim=-1, dtype=torch.float64)
    normed = (sums - 1.0).abs() <= atol
    ok = finite & nonneg & normed
    if not bool(ok.all()):
        where = tuple(int(i) for i in (~ok).nonzero()[0])
        raise InputError(
            f"{name}{list(where)} is not a probability distribution (sum {float(sums[where]):.6g}, "
            "entries must be finite and >= 0 and sum to 1); build it with verispec.sampling.to_probs"
        )
