"""Slow, obviously correct versions of the acceptance rules, for tests.

One request at a time, one position at a time, in plain Python control flow. They follow the same
randomness protocol as the fast rules (:func:`verispec.sampling.uniform_draws`): per run of rows
sharing a generator, ONE call drawing float64 uniforms, first ``num_tokens`` acceptance uniforms per
row in row order, then one uniform per row for its final token; generator None = greedy row, no
draws. The final token is sampled by inverting the float64 cumulative distribution. Under identical
generator states the fast rules must return exactly the same verdicts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from verispec.verify.base import PAD_ID, Draft, Verdict


def _draws(
    generators: Sequence[torch.Generator | None], counts: list[int]
) -> tuple[list[list[float]], list[float | None]]:
    """Per row: its acceptance uniforms and its final-token uniform (None for greedy rows)."""
    us: list[list[float]] = [[] for _ in counts]
    finals: list[float | None] = [None for _ in counts]
    start = 0
    while start < len(generators):
        end = start
        while end < len(generators) and generators[end] is generators[start]:
            end += 1
        gen = generators[start]
        if gen is not None:
            total = sum(counts[start:end])
            draw = torch.rand(total + end - start, dtype=torch.float64, generator=gen, device=gen.device)
            flat = draw.tolist()
            offset = 0
            for row in range(start, end):
                us[row] = flat[offset : offset + counts[row]]
                offset += counts[row]
            for row in range(start, end):
                finals[row] = flat[total + row - start]
        start = end
    return us, finals


def _emit(law: Tensor, u: float | None) -> int:
    """Sample from an (unnormalised) law: the first token whose cumulative mass exceeds
    ``u * total``; None = take the mode."""
    if u is None:
        return int(law.argmax())
    cdf = law.to(torch.float64).cumsum(dim=0)
    target = u * float(cdf[-1])
    for token in range(law.shape[0]):
        if float(cdf[token]) > target:
            return token
    return law.shape[0] - 1


def _verdict(rows: list[list[int]], k: int, accepted: list[int], device: torch.device) -> Verdict:
    out = torch.full((len(rows), k + 1), PAD_ID, dtype=torch.long)
    for b, tokens in enumerate(rows):
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return Verdict(out.to(device), torch.tensor(accepted, dtype=torch.long, device=device))


def reference_rejection(draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
    """Leviathan et al. (2023) Algorithm 1, one token at a time."""
    batch, k = draft.token_ids.shape
    vocab = target_probs.shape[2]
    counts = [int(n) for n in draft.num_tokens]
    us, es = _draws(generators, counts)
    rows: list[list[int]] = []
    accepted: list[int] = []
    for b in range(batch):
        greedy = generators[b] is None
        out: list[int] = []
        final: int | None = None
        for i in range(counts[b]):
            x = int(draft.token_ids[b, i])
            p = target_probs[b, i]
            q = (
                draft.probs[b, i]
                if draft.probs is not None
                else torch.nn.functional.one_hot(torch.tensor(x), vocab).to(torch.float32)
            )
            if greedy:
                ok = x == int(p.argmax())
            else:
                p_x, q_x = float(p[x]), float(q[x])
                ok = q_x > 0 and us[b][i] * q_x < p_x
            if ok:
                out.append(x)
                continue
            residual = torch.clamp(p - q.to(p.device), min=0.0)
            law = residual if (not greedy and float(residual.sum()) > 0) else p
            final = _emit(law, es[b])
            break
        accepted.append(len(out))
        if final is None:  # every draft token accepted: bonus token from the target
            final = _emit(target_probs[b, counts[b]], es[b])
        rows.append([*out, final])
    return _verdict(rows, k, accepted, target_probs.device)


def reference_greedy(draft: Draft, target_probs: Tensor) -> Verdict:
    batch, k = draft.token_ids.shape
    rows: list[list[int]] = []
    accepted: list[int] = []
    for b in range(batch):
        out: list[int] = []
        final: int | None = None
        for i in range(int(draft.num_tokens[b])):
            x = int(draft.token_ids[b, i])
            best = int(target_probs[b, i].argmax())
            if x != best:
                final = best
                break
            out.append(x)
        accepted.append(len(out))
        if final is None:
            final = int(target_probs[b, len(out)].argmax())
        rows.append([*out, final])
    return _verdict(rows, k, accepted, target_probs.device)


def reference_typical(
    draft: Draft,
    target_probs: Tensor,
    generators: Sequence[torch.Generator | None],
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Verdict:
    batch, k = draft.token_ids.shape
    counts = [int(n) for n in draft.num_tokens]
    _, es = _draws(generators, [0] * len(counts))
    rows: list[list[int]] = []
    accepted: list[int] = []
    for b in range(batch):
        out: list[int] = []
        for i in range(counts[b]):
            x = int(draft.token_ids[b, i])
            p = target_probs[b, i]
            entropy = float(torch.special.entr(p).sum(dim=-1).to(torch.float64))
            threshold = min(epsilon, delta * float(torch.exp(torch.tensor(-entropy, dtype=torch.float64))))
            if not float(p[x]) > threshold:
                break
            out.append(x)
        accepted.append(len(out))
        rows.append([*out, _emit(target_probs[b, len(out)], es[b])])
    return _verdict(rows, k, accepted, target_probs.device)
