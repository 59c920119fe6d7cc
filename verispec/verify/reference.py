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


def reference_tree(
    draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None], kind: str
) -> Verdict:
    """The tree rules of :mod:`verispec.verify.tree`, one row and one node at a time: at each
    node of the walk, its children in index order; accept with probability min(1, r(x) / q(x))
    (r, q normalised), else take q off the residual (and, for "distinct" children, x off q). The
    residual is kept as the fast rule keeps it (unnormalised, with its mass, in the target laws'
    dtype), so that both take the same decisions under identical generator states."""
    batch, k = draft.token_ids.shape
    vocab = target_probs.shape[2]
    counts = [int(n) for n in draft.num_tokens]
    us, es = _draws(generators, counts)
    rows: list[list[int]] = []
    paths: list[list[int]] = []
    for b in range(batch):
        greedy = generators[b] is None
        if draft.parents is not None:
            parents = [int(p) for p in draft.parents[b, : counts[b]]]
        else:
            parents = list(range(-1, counts[b] - 1))
        cur, path = -1, []
        residual, mass = target_probs[b, 0], 1.0
        while True:
            q: Tensor | None = None  # "distinct": the draft law at cur, less the rejected siblings
            q_mass = 1.0
            for j in (j for j in range(counts[b]) if parents[j] == cur):
                x = int(draft.token_ids[b, j])
                if greedy:
                    if x == int(target_probs[b, cur + 1].argmax()):
                        break
                    continue
                if kind == "fixed":
                    law = torch.nn.functional.one_hot(torch.tensor(x), vocab).to(residual.dtype)
                else:
                    assert draft.probs is not None
                    later = q is not None
                    if q is None or kind == "sampled":
                        q = draft.probs[b, j].clone()
                    law = q
                    if kind == "distinct" and later and float(law[x]) <= 0:
                        continue  # not a draw without replacement: skipped
                q_x = float(law[x])
                if q_x > 0 and us[b][j] * q_x * mass < float(residual[x]) * q_mass:
                    break
                residual = torch.clamp(residual * q_mass - law.to(residual.dtype) * mass, min=0.0)
                mass = float(residual.sum(dtype=torch.float64))
                if kind == "distinct":
                    law[x] = 0.0
                    q_mass = max(q_mass - q_x, 0.0)
            else:  # no child accepted: the walk ends here
                break
            path.append(j)
            cur = j
            residual, mass = target_probs[b, j + 1], 1.0
        law = residual if float(residual.sum()) > 0 else target_probs[b, cur + 1]
        rows.append([int(draft.token_ids[b, j]) for j in path] + [_emit(law, es[b])])
        paths.append(path)
    verdict = _verdict(rows, k, [len(p) for p in paths], target_probs.device)
    path_t = torch.full((batch, k), PAD_ID, dtype=torch.long)
    for b, path in enumerate(paths):
        path_t[b, : len(path)] = torch.tensor(path, dtype=torch.long)
    return Verdict(verdict.output_ids, verdict.num_accepted, path_t.to(target_probs.device))


def reference_block(draft: Draft, target_probs: Tensor, generators: Sequence[torch.Generator | None]) -> Verdict:
    """Block verification (Sun et al. 2025, Algorithm 2) for one row at a time, in float64."""
    batch, k = draft.token_ids.shape
    vocab = target_probs.shape[2]
    counts = [int(n) for n in draft.num_tokens]
    us, es = _draws(generators, counts)
    rows: list[list[int]] = []
    accepted: list[int] = []
    for b in range(batch):
        n = counts[b]
        xs = [int(draft.token_ids[b, i]) for i in range(n)]
        target = [target_probs[b, i].to(torch.float64) for i in range(n + 1)]

        def draft_law(i: int, b: int = b, xs: list[int] = xs) -> Tensor:
            if draft.probs is not None:
                return draft.probs[b, i].to(torch.float64)
            return torch.nn.functional.one_hot(torch.tensor(xs[i]), vocab).to(torch.float64)

        if generators[b] is None:
            tau = 0
            while tau < n and xs[tau] == int(target_probs[b, tau].argmax()):
                tau += 1
            rows.append([*xs[:tau], int(target_probs[b, tau].argmax())])
            accepted.append(tau)
            continue
        w = [1.0]
        for i in range(1, n + 1):
            s = float(draft_law(i - 1)[xs[i - 1]])
            w.append(min(1.0, w[-1] * float(target[i - 1][xs[i - 1]]) / s) if s > 0 else 0.0)
        tau = 0
        for i in range(1, n + 1):
            if i == n:
                h = w[n]
            else:
                r = float(torch.clamp(w[i] * target[i] - draft_law(i), min=0.0).sum())
                h = r / (r + (1.0 - w[i])) if r > 0 else 0.0
            if us[b][i - 1] < h:
                tau = i
        if tau == n:
            law = target[n]
        else:
            law = torch.clamp(w[tau] * target[tau] - draft_law(tau), min=0.0)
            if float(law.sum()) <= 0:
                law = target[tau]
        rows.append([*xs[:tau], _emit(law, es[b])])
        accepted.append(tau)
    return _verdict(rows, k, accepted, target_probs.device)
