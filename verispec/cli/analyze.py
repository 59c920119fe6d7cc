"""``verispec analyze``: what the single-request speedup model predicts (see DESCRIPTION below).

Figures come from :mod:`verispec.analysis`; this module only validates CLI limits, prints and plots.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from verispec import analysis
from verispec.errors import ConfigError

K_LIMIT = 1024  # beyond this the "one target pass verifies the whole draft" assumption is fiction
TREE_NODE_LIMIT = 256  # trees: the dynamic programme is O(nodes^2 x depth x ranks)
CELL_LIMIT = 100_000_000  # samples x K: the simulation holds ~9 bytes per simulated draft token
HEATMAP_ALPHAS = 400  # columns of the heat map

DESCRIPTION = """\
Predict the speedup of speculative decoding for one request from the single-request model of
Leviathan et al. (2023): S = E / (K c + 1), with E = (1 - alpha^(K+1)) / (1 - alpha) output tokens
per step. Prints E, S, the break-even cost c_break, the minimum acceptance alpha_min, the best K, a
Monte Carlo check and S for every K; writes a heat map of S over (alpha, K). The model assumes
i.i.d. acceptance and one target pass per step: it bounds the latency gain of one request and does
not predict throughput under batching."""

EPILOG = """\
examples:
  verispec analyze --alpha 0.7 --k 4 --c 0.1
  verispec analyze --alpha 0.75 --c 0.2 --k-max 32 --json --no-plot
  verispec analyze --tree-acceptance 0.62,0.12,0.05 --tree-nodes 16 --c 0.3 --tree-out tree.json
  verispec analyze --tree-acceptance 0.62,0.12,0.05 --tree 4,2,2,12

trees (--tree-acceptance): the expected accepted length of token trees under Sequoia's positional
acceptance model (Chen et al. 2024): p_i = the chance that the i-th child of an accepted node is
accepted (verispec bench prints it for a tree drafter). Prints the best tree of each size by
dynamic programming, a chain of the same size beside it, and with --c the speedup if the tree's
verification pass costs what one token's does (one draft pass per level); --tree-out writes the
best tree as JSON rank paths that --tree FILE takes in generate, bench and serve."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="predict the speedup of speculative decoding from acceptance rate, draft length and cost",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--alpha",
        type=float,
        metavar="A",
        help="per-token acceptance probability in [0, 1], the chance that the target accepts "
        "a draft token given the ones before it were accepted (required unless --tree-acceptance)",
    )
    p.add_argument(
        "--k",
        type=int,
        default=4,
        metavar="K",
        help="draft length: draft tokens proposed per step, >= 1 (default: 4)",
    )
    p.add_argument(
        "--c",
        type=float,
        metavar="C",
        help="draft cost per token divided by the target's cost per verification step, >= 0; "
        "e.g. 8 ms / 40 ms = 0.2 (required unless --tree-acceptance; for trees: per level)",
    )
    p.add_argument(
        "--k-max",
        type=int,
        default=16,
        metavar="N",
        help="longest draft length searched for the best K and shown in the table and heat map, "
        f"1..{K_LIMIT}; raised to --k if smaller (default: 16)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=100_000,
        metavar="N",
        help="steps simulated by the Monte Carlo check, >= 1 (default: 100000)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the Monte Carlo's random generator, >= 0, for reproducible runs (default: 0)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--plot",
        metavar="PATH",
        help="where to write the PNG heat map of S over (alpha, K) "
        "(default: speedup-c{C}.png in the current directory)",
    )
    where.add_argument("--no-plot", action="store_true", help="do not write the heat map")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure instead of tables")
    trees = p.add_argument_group("trees (Sequoia's positional acceptance)")
    trees.add_argument(
        "--tree-acceptance",
        metavar="P1,P2,...",
        help="analyse token trees instead of chains: p_i = chance that the i-th child of an accepted node is "
        "accepted, each in [0, 1], summing to at most 1",
    )
    trees.add_argument(
        "--tree-nodes",
        type=int,
        default=16,
        metavar="N",
        help=f"largest tree considered, 1..{TREE_NODE_LIMIT} (default: 16)",
    )
    trees.add_argument("--tree-depth", type=int, metavar="D", help="deepest tree considered, >= 1 (default: no limit)")
    trees.add_argument(
        "--tree",
        metavar="SHAPE",
        help="also evaluate this tree: DEPTH,EXPAND,BRANCH[,NODES] (its static form) or JSON rank paths",
    )
    trees.add_argument("--tree-out", metavar="PATH", help="write the best tree of --tree-nodes as JSON rank paths")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.tree_acceptance is not None:
        return run_trees(args)
    for flag, value in (("--alpha", args.alpha), ("--c", args.c)):
        if value is None:
            raise ConfigError(f"{flag} is required (or --tree-acceptance, to analyse token trees)")
    report = build_report(args.alpha, args.k, args.c, args.k_max, args.samples, args.seed)
    plot = None if args.no_plot else (args.plot or f"speedup-c{args.c:g}.png")
    if plot is not None:
        write_heatmap(plot, report)
    report["plot"] = plot
    if args.json:
        print(json.dumps(_json_safe(report), indent=2, allow_nan=False))
    else:
        _print_tables(report)
    return 0


def build_report(alpha: float, k: int, c: float, k_max: int, samples: int, seed: int) -> dict[str, Any]:
    """Every figure the command shows, as plain data (the ``--json`` object, before ``plot``)."""
    for name, value in (("--k", k), ("--k-max", k_max)):
        if not 1 <= value <= K_LIMIT:
            raise ConfigError(f"{name} must be in 1..{K_LIMIT}, got {value}")
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    if samples * k > CELL_LIMIT:
        raise ConfigError(
            f"--samples x --k must be <= {CELL_LIMIT:,} (the simulation keeps every draft "
            f"token in memory), got {samples * k:,}; lower --samples"
        )
    k_hi = max(k_max, k)
    by_k: list[dict[str, Any]] = [
        {
            "k": kk,
            "expected_tokens": analysis.expected_tokens(alpha, kk),
            "speedup": analysis.speedup(alpha, kk, c),
            "break_even_c": analysis.break_even_c(alpha, kk),
            "alpha_min": analysis.alpha_min(kk, c),
        }
        for kk in range(1, k_hi + 1)
    ]
    best_k = analysis.optimal_k(alpha, c, k_hi)
    sim = analysis.simulate(alpha, k, c, samples, seed)
    return {
        "model": "single request, i.i.d. acceptance (Leviathan et al. 2023)",
        "alpha": alpha,
        "c": c,
        "k_max": k_hi,
        **by_k[k - 1],  # k, expected_tokens, speedup, break_even_c, alpha_min at the given K
        "optimal_k": best_k,
        "optimal_speedup": by_k[best_k - 1]["speedup"] if best_k else 1.0,
        "monte_carlo": {
            "samples": sim.n,
            "seed": sim.seed,
            "tokens_per_step": sim.tokens_per_step,
            "tokens_per_step_std_error": sim.std_error,
            "speedup": sim.speedup,
            "speedup_std_error": sim.speedup_std_error,
            "acceptance_rate": sim.acceptance_rate,
            "z": _z(sim.tokens_per_step, by_k[k - 1]["expected_tokens"], sim.std_error),
        },
        "by_k": by_k,
    }


def _z(simulated: float, exact: float, std_error: float) -> float:
    """Standard errors between simulation and closed form (NaN when n = 1; 0/inf when no spread)."""
    if std_error == 0.0:
        return 0.0 if abs(simulated - exact) <= 1e-12 * exact else math.inf
    return (simulated - exact) / std_error


def _json_safe(value: Any) -> Any:
    """NaN and infinities have no JSON spelling: they become null."""
    if isinstance(value, dict):
        return {key: _json_safe(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def _print_tables(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    a, k, c, s = r["alpha"], r["k"], r["c"], r["speedup"]
    console.print(f"[bold]Speculative decoding speedup model[/] at α = {a:g}, K = {k}, c = {c:g}")
    console.print(f"[dim]{r['model']}[/]")

    verdict = "[green]speculation pays" if s > 1 else "[red]plain decoding is faster" if s < 1 else "no gain"
    amin, best = r["alpha_min"], r["optimal_k"]
    main = Table(show_header=False, box=None, padding=(0, 2))
    rows = [
        ("expected tokens per step E", _fmt(r["expected_tokens"]), "accepted draft tokens + 1 (AL)"),
        ("speedup S = E / (K c + 1)", _fmt(s) + "×", verdict),
        ("break-even cost c_break", _fmt(r["break_even_c"]), "max c with S ≥ 1 (= expected AR)"),
        ("minimum acceptance α_min", _fmt(amin), "min α with S ≥ 1" if amin is not None else "none: c > 1"),
        (
            f"best K ≤ {r['k_max']}",
            str(best),
            f"S = {_fmt(r['optimal_speedup'])}×" if best else "no K beats plain decoding",
        ),
    ]
    for row in rows:
        main.add_row(*row)
    console.print(main)

    mc = r["monte_carlo"]
    sim = Table(title=f"Monte Carlo check: {mc['samples']:,} steps, seed {mc['seed']}", title_justify="left")
    for col in ("", "simulated", "± std error", "closed form"):
        sim.add_column(col, justify="left" if not col else "right")
    e_row = (mc["tokens_per_step"], mc["tokens_per_step_std_error"], r["expected_tokens"])
    sim.add_row("tokens per step E", *map(_fmt, e_row))
    sim.add_row("speedup S", _fmt(mc["speedup"]), _fmt(mc["speedup_std_error"]), _fmt(s))
    console.print(sim)
    z = mc["z"]
    if not math.isnan(z):
        ok = abs(z) <= 4.0
        console.print(f"{'[green]agrees' if ok else '[red]DISAGREES'}[/] with the closed form: z = {z:+.2f}")

    table = Table(title=f"Speedup by draft length at α = {a:g}, c = {c:g}", title_justify="left")
    for col in ("K", "E", "S", "c_break", "α_min", ""):
        table.add_column(col, justify="right" if col else "left")
    for row in r["by_k"]:
        marks = [m for m, on in (("★ best", row["k"] == best), ("← --k", row["k"] == k)) if on]
        style = "bold green" if row["k"] == best else ("red" if row["speedup"] < 1 else None)
        table.add_row(
            str(row["k"]),
            _fmt(row["expected_tokens"]),
            _fmt(row["speedup"]),
            _fmt(row["break_even_c"]),
            _fmt(row["alpha_min"]),
            "  ".join(marks),
            style=style,
        )
    console.print(table)
    if r["plot"]:
        console.print(f"heat map written to {r['plot']}", markup=False, soft_wrap=True)
    console.print("[dim]A single-request latency model: it does not predict throughput under batching.[/]")


def write_heatmap(path: str, r: dict[str, Any]) -> None:
    """Write the PNG heat map of S over alpha in [0, 1) and K in 1..k_max, atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    c, k_hi = r["c"], r["k_max"]
    alphas = (np.arange(HEATMAP_ALPHAS) + 0.5) / HEATMAP_ALPHAS  # cell centres in (0, 1)
    ks = np.arange(1, k_hi + 1)
    grid = analysis.speedup_grid(alphas, ks, c).T  # [K, alpha]
    fig = Figure(figsize=(7.5, 4.8), dpi=150)
    fig.subplots_adjust(left=0.08, right=1.0, bottom=0.11, top=0.93)  # fixed: layout engines draw twice
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Colours symmetric in log S, so that 2x faster and 2x slower look equally strong; 1 is white.
    m = max(float(grid.max()), 1.0 / float(grid.min()), 1.01)
    norm = LogNorm(vmin=1.0 / m, vmax=m)
    extent = (0.0, 1.0, 0.5, k_hi + 0.5)
    image = ax.imshow(
        grid, origin="lower", aspect="auto", interpolation="nearest", cmap="RdBu", norm=norm, extent=extent
    )
    ticks = [2.0**i for i in range(-16, 17) if 1.0 / m <= 2.0**i <= m] + ([1.0 / m, m] if m < 2 else [])
    bar = fig.colorbar(image, ax=ax, ticks=ticks, format="{x:.3g}", label="speedup S (× plain decoding)")
    bar.minorticks_off()
    if grid.min() < 1.0 < grid.max():
        contour = ax.contour(alphas, ks, grid, levels=[1.0], colors="black", linewidths=1.2)
        ax.clabel(contour, fmt={1.0: "S = 1"}, fontsize=8)
    best = [analysis.optimal_k(float(a), c, k_hi) or math.nan for a in alphas]  # same ties rule
    ax.step(alphas, best, where="mid", color="black", linestyle="--", linewidth=1, label="best K for α")
    label = f"α = {r['alpha']:g}, K = {r['k']}: S = {r['speedup']:.3f}"
    ax.plot(r["alpha"], r["k"], "*", markersize=15, markerfacecolor="gold", markeredgecolor="black", label=label)
    ax.set(
        xlim=extent[:2],
        ylim=extent[2:],
        xlabel="per-token acceptance probability α",
        ylabel="draft length K",
        title=f"Modeled single-request speedup at c = {c:g}",
    )
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _write_file(path, buf.getvalue(), "heat map", "--plot")


# ---------------------------------------------------------------------------------------- trees
def run_trees(args: argparse.Namespace) -> int:
    report = build_tree_report(args.tree_acceptance, args.tree_nodes, args.tree_depth, args.c, args.tree)
    if args.tree_out:
        write_tree_paths(args.tree_out, report["best"]["paths"])
    plot = None if args.no_plot else (args.plot or "tree-acceptance.png")
    if plot is not None:
        write_tree_plot(plot, report)
    report["plot"], report["tree_out"] = plot, args.tree_out
    if args.json:
        print(json.dumps(_json_safe(report), indent=2, allow_nan=False))
    else:
        _print_tree_tables(report)
    return 0


def _parse_acceptance(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"--tree-acceptance takes comma-separated probabilities (e.g. 0.6,0.15,0.05), got {text!r}"
        ) from None


def build_tree_report(
    acceptance: str, nodes: int, depth: int | None, c: float | None, tree: str | None
) -> dict[str, Any]:
    """Every figure of the tree analysis, as plain data (the ``--json`` object, before ``plot``)."""
    from verispec.drafters.tree import TreeShape

    ps = _parse_acceptance(acceptance)
    if not 1 <= nodes <= TREE_NODE_LIMIT:
        raise ConfigError(f"--tree-nodes must be in 1..{TREE_NODE_LIMIT}, got {nodes}")
    if depth is not None and depth < 1:
        raise ConfigError(f"--tree-depth must be >= 1, got {depth}")
    plans = analysis.optimal_trees(ps, nodes, depth)

    if c is not None and not 0.0 <= c < math.inf:
        raise ConfigError(f"--c must be a finite number >= 0, got {c}")

    def speedup(e: float, levels: int) -> float | None:  # one draft pass per level, a flat verification pass
        return None if c is None else e / (levels * c + 1.0)

    by_nodes = []
    for n in range(1, nodes + 1):
        plan, k = plans[n], min(n, depth or n)
        chain = analysis.expected_tokens(ps[0], k)
        by_nodes.append(
            {
                "nodes": n,
                "expected_tokens": plan.expected_tokens,
                "depth": plan.depth,
                "speedup": speedup(plan.expected_tokens, plan.depth),
                "chain_expected_tokens": chain,
                "chain_speedup": speedup(chain, k),
            }
        )
    best = plans[nodes]
    report: dict[str, Any] = {
        "model": "token trees, positional acceptance (Sequoia, Chen et al. 2024); flat verification pass",
        "acceptance": ps,
        "c": c,
        "max_depth": depth,
        "best": {
            "nodes": len(best.parents),
            "depth": best.depth,
            "expected_tokens": best.expected_tokens,
            "paths": [list(p) for p in analysis.tree_paths(best.parents)],
        },
        "by_nodes": by_nodes,
    }
    if tree is not None:
        parents = TreeShape.parse(tree).static_parents()
        e = analysis.tree_expected_tokens(parents, ps)
        levels = max(len(p) for p in analysis.tree_paths(parents))
        report["given"] = {"tree": tree, "nodes": len(parents), "depth": levels, "expected_tokens": e,
                           "speedup": speedup(e, levels)}  # fmt: skip
    return report


def _print_tree_tables(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    ps = ", ".join(f"{p:g}" for p in r["acceptance"])
    console.print(
        f"[bold]Token trees[/] at positional acceptance p = ({ps})"
        + (f", c = {r['c']:g}" if r["c"] is not None else "")
    )
    console.print(f"[dim]{r['model']}[/]")
    table = Table(title="Best tree of each size, and a chain", title_justify="left")
    cols = ["nodes", "E tree", "depth", "E chain", "tree / chain"] + (
        ["S tree", "S chain"] if r["c"] is not None else []
    )
    for col in cols:
        table.add_column(col, justify="right")
    for row in r["by_nodes"]:
        cells = [str(row["nodes"]), _fmt(row["expected_tokens"]), str(row["depth"]), _fmt(row["chain_expected_tokens"]),
                 _fmt(row["expected_tokens"] / row["chain_expected_tokens"], ".3f")]  # fmt: skip
        if r["c"] is not None:
            cells += [_fmt(row["speedup"]), _fmt(row["chain_speedup"])]
        table.add_row(*cells)
    console.print(table)
    b = r["best"]
    console.print(f"best tree of {b['nodes']} nodes, depth {b['depth']}: E = {_fmt(b['expected_tokens'])}")
    console.print(json.dumps(b["paths"]), markup=False, soft_wrap=True)
    if "given" in r:
        g = r["given"]
        extra = f", S = {_fmt(g['speedup'])}" if g["speedup"] is not None else ""
        console.print(
            f"--tree {g['tree']}: {g['nodes']} nodes, depth {g['depth']}, E = {_fmt(g['expected_tokens'])}{extra}",
            markup=False,
            soft_wrap=True,
        )
    if r.get("tree_out"):
        console.print(
            f"best tree written to {r['tree_out']} (use it with --drafter tree --tree {r['tree_out']})",
            markup=False,
            soft_wrap=True,
        )
    if r.get("plot"):
        console.print(f"plot written to {r['plot']}", markup=False, soft_wrap=True)
    console.print(
        "[dim]S assumes the verification pass over the tree costs one token's pass: measure it (verispec bench).[/]"
    )


def _write_file(path: str, data: bytes, what: str, flag: str) -> None:
    """``data`` at ``path``, atomically (nothing half-written is left); errors name ``flag``."""
    from verispec.formats.files import atomic_path

    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path!r} is a directory; give a file name, e.g. {os.path.join(path, 'out')!r}")
    try:
        with atomic_path(Path(os.path.abspath(path))) as tmp:
            tmp.write_bytes(data)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the {what} to {path!r} ({exc.strerror or exc}); "
            f"pass {flag} with a path in a writable directory" + (", or --no-plot" if flag == "--plot" else "")
        ) from exc


def write_tree_paths(path: str, paths: list[list[int]]) -> None:
    """The tree as JSON rank paths (what ``--tree FILE`` reads), written atomically."""
    _write_file(path, (json.dumps(paths) + "\n").encode(), "tree", "--tree-out")


def write_tree_plot(path: str, r: dict[str, Any]) -> None:
    """A PNG of E (and S with --c) against the node budget, best tree vs chain, written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = r["by_nodes"]
    n = [row["nodes"] for row in rows]
    fig = Figure(figsize=(7.0, 4.2), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(n, [row["expected_tokens"] for row in rows], "o-", label="best tree: E")
    ax.plot(n, [row["chain_expected_tokens"] for row in rows], "s--", label="chain: E")
    if r["c"] is not None:
        ax.plot(n, [row["speedup"] for row in rows], "o-", alpha=0.6, label=f"best tree: S at c = {r['c']:g}")
        ax.plot(n, [row["chain_speedup"] for row in rows], "s--", alpha=0.6, label=f"chain: S at c = {r['c']:g}")
    ps = ", ".join(f"{p:g}" for p in r["acceptance"][:6])
    ax.set(xlabel="draft nodes per step", ylabel="tokens per step / speedup", title=f"Token trees at p = ({ps})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    _write_file(path, buf.getvalue(), "plot", "--plot")
