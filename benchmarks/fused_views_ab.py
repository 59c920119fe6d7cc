"""Fused projections read from the packed file's mapping against copies of them in torch's memory.

Since packing format 5 a packed cache file holds the codes of q / k / v and of gate / up back to
back, so each fused projection is a view of the file's mapping (huge pages where the filesystem
gives them: ``hugepages.advise_huge_pages``); before, fusing copied them into memory torch allocated
at load (4 KiB pages unless the OS backs them otherwise). This loads a model of the default pair
twice in one process, one as it loads now and one with every fused projection's codes copied into
torch's memory (as before), and times decode passes over T new tokens after ``--context`` cached
ones, the two taking turns (``ab_passes.py``). Both compute the same bits; the outputs are compared.

    python benchmarks/fused_views_ab.py [--role target|draft] [--precision int4] [--widths 1,8]
        [--rounds 16] [--passes 6] [--context 128] [--threads 2] [--copies-first] [--every]
"""

from __future__ import annotations

import argparse
import time

import torch
from ab_passes import decode_variants, interleaved_passes, print_ratios  # benchmarks/ is on the path

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from verispec.kernels.linear import Bf16Linear, Int8Linear, Q4KLinear, Q6KLinear

CODES = {Q4KLinear: "q4k", Q6KLinear: "q6k", Int8Linear: "int8", Bf16Linear: "bf16"}


def copy_fused(model: torch.nn.Module, every: bool = False) -> int:
    """Copy the codes of every fused projection (``qkv_proj``, ``gate_up_proj``; ``every``: of
    every packed projection) into torch's memory and rebuild the native layer loop on them;
    returns the bytes copied."""
    copied = 0
    for name, module in model.named_modules():
        if (every or name.endswith(("qkv_proj", "gate_up_proj"))) and type(module) in CODES:
            attr = CODES[type(module)]
            codes = getattr(module, attr).clone()
            setattr(module, attr, codes)
            copied += codes.nbytes
    model._native_layers = model._native_layer_loop()  # type: ignore[operator]
    return copied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("target", "draft"), default="target")
    ap.add_argument("--precision", default=None, help="default: int4 (target), int4-all (draft)")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies-first", action="store_true", help="load the model to be copied first")
    ap.add_argument("--every", action="store_true", help="copy every packed projection, not only the fused ones "
                    "(bf16: as its load did before its packed cache file)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = DEFAULT_TARGET if args.role == "target" else DEFAULT_DRAFT
    precision = args.precision or ("int4" if args.role == "target" else "int4-all")
    widths = [int(w) for w in args.widths.split(",") if w]

    loaded, load_s = [], []
    for _ in range(2):  # (the model loaded first read 1-4% slower in A/A runs: --copies-first swaps)
        start = time.perf_counter()
        loaded.append(load_model(spec, dtype=precision).model)
        load_s.append(time.perf_counter() - start)
    views, copies = loaded[::-1] if args.copies_first else loaded
    copied = copy_fused(copies, args.every)
    models = {"views": views, "copies": copies}

    gen = torch.Generator().manual_seed(0)
    vocab = views.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
    caches, first = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = model.new_cache(1, args.context + max(widths))
            first[name] = model(prompt, None, caches[name], logits_at=torch.tensor([[args.context - 1]]))
    if not torch.equal(first["views"], first["copies"]):
        raise SystemExit("the two copies disagree: the fused views are not the fused projections")

    variants = decode_variants(models, caches, args.context)
    times = interleaved_passes(variants, widths, args.rounds, args.passes, vocab, gen)
    what = "every packed projection" if args.every else "fused projections"
    print(f"### {spec} {precision}: {what} as views of the packed file (views) against copies "
          f"in torch's memory (copies, {copied / 2**20:.0f} MiB); {machine_line()}, {args.rounds} rounds; "
          f"loads {load_s[0]:.2f}, {load_s[1]:.2f} s{', copies first' if args.copies_first else ''}")  # fmt: skip
    print_ratios(times, "views", "copies", widths)


if __name__ == "__main__":
    main()
