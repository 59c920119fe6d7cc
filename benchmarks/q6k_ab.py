"""Does reading Q6_K natively make the int4 target's pass faster? Both ways, in one process.

A Q4_K_M file keeps the LM head and half of the ``ffn_down`` / ``attn_v`` tensors in Q6_K. The
"int4" precision reads them as they are with ``VERISPEC_Q6K=1`` (:class:`~verispec.kernels.Q6KLinear`,
0.82 bytes per weight); by default it requantises them to per-channel int8 (1.0 byte per weight
and a second rounding). This benchmark loads the model once, copies it, turns the copy's Q6_K projections into
that int8 (``Int8Linear.from_weight`` of their exact weights, as the loader did), copies both into
fresh memory alike, and times whole passes (decoder layers and the LM head over every row) of T new
tokens after ``--context`` cached ones, the two taking turns every round. Reported: each one's
median ms per pass, the bytes each streams, and the median over rounds of q6k / int8.

    python benchmarks/q6k_ab.py [--model qwen2.5-coder-1.5b-instruct] [--widths 1,4,8] [--rounds 12]
        [--passes 6] [--context 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from ab_passes import decode_variants, interleaved_passes, print_ratios  # benchmarks/ is on the path

from verispec.cli.doctor import machine_line
from verispec.formats.loader import DEFAULT_TARGET, load_model
from verispec.kernels.linear import Int8Linear, Q6KLinear
from verispec.models.quantized import Q6K_ENV


def requantise(model: Any, to_int8: bool) -> int:
    """Copy every packed buffer of ``model`` into fresh memory (the model as loaded maps its cache
    file); with ``to_int8``, its Q6_K projections become int8 of their exact weights. Rebuilds the
    native layer loop; returns how many Q6_K projections there are."""
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Q6KLinear):
            count += 1
            if to_int8:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, Int8Linear.from_weight(module.dequantize(), module.bias))
    for module in model.modules():
        for key, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:
                setattr(module, key, buffer.clone())
    model._native_layers = model._native_layer_loop()
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_TARGET)
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--passes", type=int, default=6, help="passes per width, model and round (the first dropped)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    os.environ[Q6K_ENV] = "1"  # (the int8 copy is made here, as the loader makes it without)
    models = {"q6k": load_model(args.model, dtype="int4").model, "int8": load_model(args.model, dtype="int4").model}
    count = requantise(models["int8"], to_int8=True)
    requantise(models["q6k"], to_int8=False)
    assert models["q6k"]._native_layers is not None and models["int8"]._native_layers is not None
    gen = torch.Generator().manual_seed(0)
    vocab = models["q6k"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
    caches, last = {}, {}
    with torch.inference_mode():
        for name, model in models.items():
            caches[name] = model.new_cache(1, args.context + max(widths))
            last[name] = model(prompt, None, caches[name])[0, -1].float()
        agree = int(last["q6k"].argmax()) == int(last["int8"].argmax())
    variants = decode_variants(models, caches, args.context)
    times = interleaved_passes(variants, widths, args.rounds, args.passes, vocab, gen)
    mb = {name: model.weight_bytes() / 1e6 for name, model in models.items()}
    print(f"### {args.model} int4, whole passes (LM head over every row), {count} Q6_K projections, "
          f"{mb['q6k']:.1f} MB per pass (Q6_K read natively) / {mb['int8']:.1f} MB (as int8); next-token argmax "
          f"after the prompt {'equal' if agree else 'different'}; {machine_line()}; {args.rounds} rounds")  # fmt: skip
    print_ratios(times, "q6k", "int8", widths)


if __name__ == "__main__":
    main()
