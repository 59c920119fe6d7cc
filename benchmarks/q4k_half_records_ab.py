"""Do half records make a draft pass faster? The same model in both Q4_K layouts, in one process.

A requantised projection of 896 inputs (the 0.5B draft's q/k/v/o and gate/up) is padded to whole
128s: two and a half super-blocks of 256 are stored as three records and a half one (1280 bytes
instead of 2304 for the last). The layout it replaced stored the zero half too. This benchmark
loads the model once per layout ("half": as verispec packs it; "whole": every half record followed
by the 1024 bytes of codes it leaves out, the kernels told to read
K = 1024; both copied into fresh memory) and times decoder passes of T new tokens after
``--context`` cached ones, without the LM head (a draft pass scores its restricted head
separately), the two taking turns every round. Reported: each layout's median
ms per pass, the bytes each streams, and the median over rounds of half / whole.

    python benchmarks/q4k_half_records_ab.py [--model qwen2.5-coder-0.5b-instruct] [--precision int4-all]
        [--widths 1,4] [--rounds 16] [--passes 6] [--context 128] [--threads 2]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from ab_passes import Variant, interleaved_passes, print_ratios  # benchmarks/ is on the path

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_DRAFT, load_model
from verispec.kernels import load
from verispec.kernels.linear import Q4KLinear


def relayout(model: Any, whole: bool) -> int:
    """Copy every Q4_K projection of ``model`` that ends in half records into fresh memory (both
    layouts alike, so that they differ in layout alone: the model as loaded maps its cache file),
    with ``whole``, in the whole-record layout (``q4k_whole_records``: the same weights); rebuild
    its native layer loop and return how many projections it copied."""
    changed = 0
    for module in model.modules():
        if isinstance(module, Q4KLinear) and module.packed_in_features % 256:
            n, k = module.out_features, module.packed_in_features
            module.q4k = load().q4k_whole_records(module.q4k, n, k) if whole else module.q4k.clone()
            module.packed_in_features += 128 if whole else 0
            changed += 1
    model._native_layers = model._native_layer_loop()
    return changed


def layer_bytes(model: Any) -> int:
    return sum(m.q4k.numel() for m in model.modules() if isinstance(m, Q4KLinear))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_DRAFT)
    ap.add_argument("--precision", default="int4-all")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--passes", type=int, default=6, help="passes per width, layout and round (the first dropped)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    models = {"half": load_model(args.model, dtype=args.precision).model,
              "whole": load_model(args.model, dtype=args.precision).model}  # fmt: skip
    changed = relayout(models["whole"], whole=True)
    relayout(models["half"], whole=False)
    gen = torch.Generator().manual_seed(0)
    vocab = models["half"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
    none = torch.empty((1, 0), dtype=torch.long)
    caches, outputs = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = model.new_cache(1, args.context + max(widths))
            outputs[name] = model.forward_with_hidden(prompt, None, caches[name], logits_at=none).hidden
        assert torch.equal(outputs["half"], outputs["whole"]), "the two layouts must compute the same hidden states"
    variants: dict[str, Variant] = {
        name: (
            lambda new, m=model, c=caches[name]: m.forward_with_hidden(new, None, c, logits_at=none),
            lambda c=caches[name]: c.truncate([args.context]),
        )
        for name, model in models.items()
    }
    times = interleaved_passes(variants, widths, args.rounds, args.passes, vocab, gen)
    mb = {name: layer_bytes(model) / 1e6 for name, model in models.items()}
    print(f"### {args.model} {args.precision}, decoder layers (no LM head), {changed} projections with half "
          f"records, Q4_K bytes {mb['half']:.1f} MB (half) / {mb['whole']:.1f} MB (whole); {machine_line()}; "
          f"{args.rounds} rounds")  # fmt: skip
    print_ratios(times, "half", "whole", widths)


if __name__ == "__main__":
    main()
