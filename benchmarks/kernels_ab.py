"""Did a kernel change make a whole forward pass faster? Old and new kernels in one process, passes interleaved.

On a shared machine the speed of memory and cores moves by 20-50% from minute to minute, so two
runs (before, after) measured one after the other compare the machine's moods as much as the
code. This benchmark builds the kernel sources (``verispec/kernels/csrc``) of a git revision
``--base`` next to the working tree's, loads the same model twice in one process, one on each
module (the Python code is the working tree's for both: the base's C++ must accept its calls; a
base without ``Layers.chain`` sends both models' passes down the general path), and
times passes of T new tokens after ``--context`` cached ones, the two models taking turns every
few passes. Reported: each model's median ms per pass at every width, and per round the ratio
new / old of the two medians, whose median is the figure that counts (below 1: the new kernels
are faster).

With ``--tiers OLD,NEW`` instead of ``--base`` it compares two tiers this CPU executes, the
working tree's kernels on both (e.g. ``avx512,avx512bf16``: does a tier earn its place ahead of
the one below it on this CPU?): each model is loaded and run with ``$VERISPEC_ISA`` set to its
tier, so its weights are packed the way that tier reads them.

    python benchmarks/kernels_ab.py --base HEAD~1 [--role target|draft] [--precision int4]
        [--widths 1,8] [--rounds 16] [--passes 6] [--context 128] [--threads 2]
    python benchmarks/kernels_ab.py --tiers avx512,avx512bf16 --precision bf16 ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

import torch
from ab_passes import Variant, interleaved_passes, print_ratios  # benchmarks/ is on the path

from verispec.cli.doctor import machine_line
from verispec.errors import ConfigError
from verispec.formats.loader import DEFAULT_DRAFT, DEFAULT_TARGET, load_model
from verispec.kernels import build
from verispec.kernels.dispatch import ISA_ENV, selected

ROOT = Path(__file__).resolve().parent.parent
CSRC = "verispec/kernels/csrc"


def base_module(rev: str, out: Path) -> Any:
    """The kernel module built from ``rev``'s sources (extracted with ``git archive``)."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, CSRC], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(out, filter="data")
    tier, src = selected(), out / CSRC
    from torch.utils.cpp_extension import load as load_extension

    (out / "build").mkdir()
    return load_extension(
        name=f"verispec_kernels_base_{tier.name}",
        sources=[str(src / name) for name in tier.sources],
        extra_cflags=list(build.flags_of(tier)),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(src)],
        build_directory=str(out / "build"),
        verbose=False,
    )


def use(module: Any) -> None:
    """Make ``verispec.kernels.load()`` return ``module`` (models ask it per call)."""
    build._STATE.modules[selected().name] = module
    build._STATE.by_env.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="git revision whose kernel sources are 'old'")
    which.add_argument("--tiers", help="OLD,NEW: two tiers this CPU executes, the working tree's kernels on both")
    ap.add_argument("--role", choices=("target", "draft"), default="target")
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--passes", type=int, default=6, help="passes per width, model and round (the first dropped)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    spec = DEFAULT_TARGET if args.role == "target" else DEFAULT_DRAFT
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiers:
            names = args.tiers.split(",")
            if len(names) != 2:
                ap.error(f"--tiers takes OLD,NEW (two tier names), got {args.tiers!r}")
            tiers = dict(zip(("old", "new"), names, strict=True))
            for tier in tiers.values():
                os.environ[ISA_ENV] = tier
                try:
                    selected()  # (a ConfigError naming what this CPU lacks, or an unknown tier)
                except ConfigError as exc:
                    ap.error(str(exc))

            def switch(name: str) -> None:
                os.environ[ISA_ENV] = tiers[name]  # (verispec.kernels.load() follows $VERISPEC_ISA)

            label = f"the {tiers['new']} tier (new) vs the {tiers['old']} tier (old)"
        else:
            print(f"# building the kernels of {args.base} ({selected().name} tier) ...", file=sys.stderr)
            modules = {"new": build.load(), "old": base_module(args.base, Path(tmp))}

            def switch(name: str) -> None:
                use(modules[name])

            label = f"kernels of the working tree (new) vs {args.base} (old)"
        models = {}
        for name in ("new", "old"):
            switch(name)
            models[name] = load_model(spec, dtype=args.precision)
        if any(not hasattr(m.model._native_layers, "chain") for m in models.values()):  # (a base before Layers.chain)
            print("# the base has no Layers.chain: both models run their chain passes by the general path",
                  file=sys.stderr)  # fmt: skip
            for loaded in models.values():
                loaded.model._chain_natively = lambda *args: None
        gen = torch.Generator().manual_seed(0)
        vocab = models["new"].config.vocab_size
        prompt = torch.randint(0, vocab, (1, args.context), generator=gen)
        caches = {}
        for name, loaded in models.items():
            switch(name)
            caches[name] = loaded.model.new_cache(1, args.context + max(widths))
            loaded.model(prompt, None, caches[name], logits_at=torch.tensor([[args.context - 1]]))

        def variant(name: str) -> Variant:
            def run(new: torch.Tensor) -> None:
                switch(name)
                models[name].model(new, None, caches[name])

            return run, lambda: caches[name].truncate([args.context])

        times = interleaved_passes({n: variant(n) for n in models}, widths, args.rounds, args.passes, vocab, gen)
    if args.tiers:
        os.environ.pop(ISA_ENV, None)  # (the machine line names the tier this CPU picks)
    print(f"### {spec} {args.precision}, {label}, {machine_line()}, {args.rounds} rounds")
    print_ratios(times, "new", "old", widths)


if __name__ == "__main__":
    main()
