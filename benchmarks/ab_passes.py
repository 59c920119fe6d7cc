"""Two variants of a forward pass, timed in turns in one process: what the A/B benchmarks share.

On a shared machine the speed of memory and cores moves by 20-50% from minute to minute, so the
variants take turns: every round times each variant at every width (``passes`` passes of T random
new tokens, the first dropped, the median kept), the first variant first on even rounds and
second on odd ones (an A/A run read 0.99-1.07 with a fixed order, 1.00-1.04 alternating: int4, 12
rounds, Zen 4). The figure that counts is the median over rounds of each round's ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: A variant: a pass over the given new tokens ``[1, T]``, and what puts its cache back after it.
Variant = tuple[Callable[[torch.Tensor], object], Callable[[], object]]


def decode_variants(models: dict[str, Any], caches: dict[str, Any], context: int) -> dict[str, Variant]:
    """Each model's pass over the new tokens into its own cache, the cache put back to ``context``
    cached tokens after it."""
    return {
        name: (lambda new, m=model, c=caches[name]: m(new, None, c), lambda c=caches[name]: c.truncate([context]))
        for name, model in models.items()
    }


@torch.inference_mode()
def interleaved_passes(
    variants: dict[str, Variant], widths: list[int], rounds: int, passes: int, vocab: int, gen: torch.Generator
) -> dict[tuple[str, int], list[float]]:
    """Seconds per pass, ``(variant, width) -> [median of each round]``."""
    times: dict[tuple[str, int], list[float]] = {(n, w): [] for n in variants for w in widths}
    for r in range(rounds):
        order = list(variants.items()) if r % 2 == 0 else list(variants.items())[::-1]
        for name, (run, reset) in order:
            for width in widths:
                seconds = []
                for _ in range(passes):
                    new = torch.randint(0, vocab, (1, width), generator=gen)
                    t0 = time.perf_counter()
                    run(new)
                    seconds.append(time.perf_counter() - t0)
                    reset()
                times[(name, width)].append(statistics.median(seconds[1:]))
    return times


def print_ratios(times: dict[tuple[str, int], list[float]], a: str, b: str, widths: list[int]) -> None:
    """The markdown table of ``a`` against ``b``: medians and the median of per-round ratios."""
    print(f"| width T | {a} ms (median) | {b} ms (median) | {a} / {b} per round, median [min-max] |")
    print("|---|---|---|---|")
    for width in widths:
        x, y = times[(a, width)], times[(b, width)]
        ratios = [p / q for p, q in zip(x, y, strict=True)]
        print(f"| {width} | {1e3 * statistics.median(x):.2f} | {1e3 * statistics.median(y):.2f} | "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] |")  # fmt: skip
