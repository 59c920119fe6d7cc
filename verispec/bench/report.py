"""The gate's report: one self-contained HTML file (plots embedded as base64 PNG, no external
resource) and the JSON it was made from, both written atomically."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verispec.formats.files import atomic_path

COLORS = {"baseline": "#4c72b0", "spec": "#dd8452", "predicted": "#55a868"}
VERDICT_COLORS = {"GO": "#2e7d32", "NO-GO": "#c62828", "INCONCLUSIVE": "#9e6a00"}


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()  # titles and axis labels of stacked panels must not overlap
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 3.6) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def plot_speedup(levels: Sequence[dict[str, Any]]) -> str:
    fig, axes = _figure(2)
    x = list(range(len(levels)))
    labels = [lv["label"] for lv in levels]
    ax = axes[0][0]
    tr = [lv["throughput_ratio"] for lv in levels]
    ys = [t["value"] if t else float("nan") for t in tr]
    err = [[t["value"] - t["low"] if t else 0 for t in tr], [t["high"] - t["value"] if t else 0 for t in tr]]
    ax.errorbar(x, ys, yerr=err, fmt="o-", capsize=4, color=COLORS["spec"], label="throughput ratio (CI)")
    ax.plot(x, [lv["tpot_speedup"] or float("nan") for lv in levels], "s--", color=COLORS["baseline"],
            label="per-request speedup (TPOT ratio)")  # fmt: skip
    ax.plot(x, [lv["predicted_speedup"] or float("nan") for lv in levels], "^:", color=COLORS["predicted"],
            label="model S(alpha, K, c)")  # fmt: skip
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(x, labels)
    ax.set_ylabel("speculative / baseline")
    ax.set_title("speedup vs load")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for name in ("baseline", "spec"):
        for q, style in (("p50", "o-"), ("p95", "s--")):
            vals = [1e3 * (lv[name]["itl_s"][q] or float("nan")) for lv in levels]
            ax.plot(x, vals, style, color=COLORS[name], label=f"{name} ITL {q}")
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms between streamed chunks")
    ax.set_title("inter-token latency vs load")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_acceptance(levels: Sequence[dict[str, Any]]) -> str | None:
    rows = [lv for lv in levels if lv["acceptance"] and lv["acceptance"]["acceptance_per_position"]]
    if not rows:
        return None
    fig, axes = _figure(2)
    width = 0.8 / len(rows)
    for j, lv in enumerate(rows):
        acc = lv["acceptance"]
        per_pos = acc["acceptance_per_position"]
        pos = [i + 1 + (j - (len(rows) - 1) / 2) * width for i in range(len(per_pos))]
        axes[0][0].bar(pos, per_pos, width=width, label=lv["label"])
        if acc["alpha"] is not None:
            axes[0][0].plot(range(1, len(per_pos) + 1), [acc["alpha"] ** (i + 1) for i in range(len(per_pos))],
                            "k:", lw=1)  # fmt: skip
        cond = [c if c is not None else float("nan") for c in acc["conditional_acceptance"]]
        axes[0][1].plot(range(1, len(cond) + 1), cond, "o-", label=f"{lv['label']} (alpha {acc['alpha']:.2f})")
    axes[0][0].set_title("P(first i draft tokens accepted); dotted: alpha^i")
    axes[0][0].set_xlabel("draft position i")
    axes[0][0].legend(fontsize=8)
    axes[0][1].set_title("acceptance at position i, given it was reached")
    axes[0][1].set_xlabel("draft position i")
    axes[0][1].set_ylim(0, 1.05)
    axes[0][1].legend(fontsize=8)
    return _png(fig)


def plot_predicted(levels: Sequence[dict[str, Any]]) -> str | None:
    pts = [lv for lv in levels if lv["predicted_speedup"] is not None]
    if not pts:
        return None
    fig, axes = _figure(1, width=5.0, height=4.0)
    ax = axes[0][0]
    for lv in pts:
        p = lv["predicted_speedup"]
        if lv["throughput_ratio"]:
            ax.scatter([p], [lv["throughput_ratio"]["value"]], color=COLORS["spec"])
            ax.annotate(lv["label"], (p, lv["throughput_ratio"]["value"]), fontsize=8)
        if lv["tpot_speedup"]:
            ax.scatter([p], [lv["tpot_speedup"]], color=COLORS["baseline"], marker="s")
    values = [lv["predicted_speedup"] for lv in pts] + [lv["tpot_speedup"] or 1.0 for lv in pts] + [1.0]
    lo, hi = min(values) * 0.8, max(values) * 1.2
    ax.plot([lo, hi], [lo, hi], "k:", lw=1)
    ax.set_xlabel("predicted S(alpha, K, c)")
    ax.set_ylabel("measured (circles: throughput ratio; squares: TPOT ratio)")
    ax.set_title("predicted vs measured speedup")
    return _png(fig)


def plot_distributions(result: dict[str, Any]) -> str | None:
    import numpy as np

    levels, records = result["levels"], result.get("records") or []
    if not records:
        return None
    fig, axes = _figure(3, len(levels), width=4.2, height=2.8)
    for row, (lv, per) in enumerate(zip(levels, records, strict=True)):
        for col, (key, title) in enumerate((("ttft", "TTFT"), ("itl", "ITL (chunk gaps)"), ("tpot", "TPOT"))):
            ax = axes[row][col]
            for name in ("baseline", "spec"):
                recs = [r for rep in per[name] for r in rep if r["ok"]]
                if key == "itl":
                    vals = [b - a for r in recs for a, b in zip(r["chunk_times"], r["chunk_times"][1:], strict=False)]
                else:
                    vals = [r[key] for r in recs if r[key] is not None]
                if vals:
                    xs = np.sort(1e3 * np.asarray(vals))
                    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", color=COLORS[name], label=name)
            ax.set_title(f"{lv['label']}: {title}", fontsize=9)
            ax.set_xlabel("ms", fontsize=8)
            if col == 0:
                ax.set_ylabel("fraction", fontsize=8)
                ax.legend(fontsize=7)
    return _png(fig)


# ------------------------------------------------------------------------------------------ HTML
def _f(x: Any, fmt: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _img(data: str | None, alt: str) -> str:
    return "" if data is None else f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _verdict_rows(levels: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for lv in levels:
        v = lv["verdict"]
        color = VERDICT_COLORS.get(v["verdict"], "#000")
        crit = "<br>".join(f"<b>{html.escape(c['name'])}</b> [{c['status']}]: {html.escape(c['reason'])}"
                           for c in v["criteria"])  # fmt: skip
        rows.append([html.escape(lv["label"]), f'<b style="color:{color}">{v["verdict"]}</b>', crit,
                     html.escape("; ".join(v["notes"]))])  # fmt: skip
    return rows


def _level_rows(levels: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for lv in levels:
        for name in ("baseline", "spec"):
            s = lv[name]
            rows.append([html.escape(lv["label"]), name, f"{s['completed']}/{s['requests']}",
                         _f(s["output_tokens_per_s"], ".1f"), _f(s["requests_per_s"], ".2f"),
                         *(f"{_f(s[k]['p50'], '.0f', 1e3)} / {_f(s[k]['p95'], '.0f', 1e3)}"
                           for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s")),
                         _f(s.get("rss_peak_bytes"), ".0f", 2**-20)])  # fmt: skip
    return rows


def _spec_rows(levels: Sequence[dict[str, Any]]) -> list[list[str]]:
    from verispec.analysis import alpha_min, break_even_c

    rows = []
    for lv in levels:
        acc = lv["acceptance"] or {}
        k, c, a = lv["k"], lv["c"], lv["alpha"]
        amin = alpha_min(k, c) if k and c is not None else None
        cb = break_even_c(min(a, 1.0), k) if k and a is not None else None
        tr = lv["throughput_ratio"]
        rows.append([html.escape(lv["label"]), _f(acc.get("acceptance_rate"), ".3f"),
                     _f(acc.get("mean_acceptance_length")), _f(acc.get("free_draft_share"), ".2f"), _f(a, ".3f"),
                     str(k or "-"),
                     _f(c, ".3f") + f"<br><small>{html.escape(lv['c_source'])}</small>", _f(amin, ".3f"),
                     _f(cb, ".3f"), _f(lv["predicted_speedup"]),
                     "-" if tr is None else f"{tr['value']:.2f} ({tr['low']:.2f}-{tr['high']:.2f})",
                     _f(lv["tpot_speedup"])])  # fmt: skip
    return rows


def _quality_html(q: dict[str, Any]) -> str:
    parts = []
    ge = q["greedy_equality"]
    parts.append(f"<p><b>Greedy equality</b>: {ge['equal']}/{ge['pairs']} prompt runs gave the same text"
                 f"{' (' + html.escape(ge['note']) + ')' if ge.get('note') else ''}.</p>")  # fmt: skip
    ppl = q["perplexity"]
    if ppl.get("measured"):
        d = ppl["delta_nll"]
        parts.append(f"<p><b>Perplexity</b> ({ppl['tokens']} tokens; {html.escape(ppl['method'])}): baseline "
                     f"{ppl['baseline_ppl']:.4f}, speculative {ppl['spec_ppl']:.4f}; delta NLL {d['value']:+.2e} "
                     f"nats/token ({100 * d['confidence']:.0f}% CI {d['low']:+.2e} to {d['high']:+.2e}); "
                     f"largest per-token |delta| {ppl['max_abs_token_delta']:.2e}.</p>")  # fmt: skip
    else:
        parts.append(f"<p><b>Perplexity</b>: not measured ({html.escape(ppl.get('reason', ''))}).</p>")
    he = q["humaneval"]
    if he.get("measured"):
        d = he["difference"]
        parts.append(f"<p><b>HumanEval pass@1</b> ({he['problems']} problems, greedy, max {he['max_tokens']} tokens): "
                     f"baseline {he['baseline_pass_at_1']:.2f}, speculative {he['spec_pass_at_1']:.2f}, difference "
                     f"{d['value']:+.2f} ({100 * d['confidence']:.0f}% CI {d['low']:+.2f} to {d['high']:+.2f}, "
                     f"{html.escape(d['method'])}); {he['identical_completions']}/{he['problems']} completions "
                     f"identical. Tests: {html.escape(he['executor'])}.</p>")  # fmt: skip
        parts.append(_table(["task", "baseline", "speculative"],
                            [[html.escape(p["task_id"]), html.escape(p["baseline"]), html.escape(p["spec"])]
                             for p in he["per_problem"]]))  # fmt: skip
    else:
        parts.append(f"<p><b>HumanEval</b>: not measured ({html.escape(he.get('reason', ''))}).</p>")
    law = q.get("output_law") or {}
    if law.get("measured"):
        from verispec.certify.html import deployment_section

        parts.append(f"<p><b>Output law</b> ({html.escape(law.get('note', ''))}):</p>{deployment_section(law)}")
    else:
        parts.append(f"<p><b>Output law</b>: not measured ({html.escape(law.get('reason', 'not run'))}).</p>")
    return "".join(parts)


def _memory_html(mem: dict[str, Any] | None) -> str:
    if mem is None:
        return (
            "<p>Not measured: external deployments. Watch the servers' own memory (nvidia-smi / DCGM; vLLM "
            "exports KV-cache usage and preemptions, shown per level in the JSON when present).</p>"
        )
    rows = [
        [
            name,
            *(
                _f(mem[name][k], ".1f", 2**-20)
                for k in (
                    "target_weight_bytes",
                    "kv_cache_bytes",
                    "drafter_weight_bytes",
                    "drafter_cache_bytes",
                    "tensor_bytes_total",
                )
            ),
        ]
        for name in ("baseline", "spec")
    ]
    return (
        _table(
            [
                "configuration",
                "target weights MiB",
                "KV cache MiB",
                "draft weights MiB",
                "draft cache MiB",
                "total MiB",
            ],
            rows,
        )
        + f"<p>{html.escape(mem['note'])}. RSS peaks in the level table: {html.escape(mem['method'])}.</p>"
    )


CSS = """body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;
vertical-align:top;text-align:left}th{background:#f2f2f2}img{max-width:100%;margin:.5em 0}
small{color:#666}.box{background:#f7f7f7;padding:.6em 1em;border-left:4px solid #888}"""


def render_plots(result: dict[str, Any]) -> dict[str, str | None]:
    """The report's plots as base64 PNGs (None where there is nothing to plot), rendered once for
    both the HTML report and the summary picture."""
    levels = result["levels"]
    return {
        "speedup": plot_speedup(levels),
        "acceptance": plot_acceptance(levels),
        "predicted": plot_predicted(levels),
        "distributions": plot_distributions(result),
    }


def render_html(result: dict[str, Any], plots: dict[str, str | None] | None = None) -> str:
    plots = plots if plots is not None else render_plots(result)
    levels = result["levels"]
    pair = result.get("pair") or {}
    machine = result["machine"]
    load = machine.get("loadavg_1min")
    title = f"verispec gate: {pair.get('target', result['endpoints']['spec']['model'])}"
    head = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class=box>Pair: {html.escape(json.dumps(pair))}<br>Endpoints: "
        f"{html.escape(json.dumps(result['endpoints']))}<br>Settings: {html.escape(json.dumps(result['settings']))}"
        f"<br>Machine: {html.escape(machine['platform'])}, {machine['cpus']} CPUs"
        + (f", 1-minute load average {load['min']:.1f}-{load['max']:.1f} during the run" if load else "")
        + f"<br>{result['num_prompts']} prompts; created {html.escape(result['created'])} by verispec "
        f"{html.escape(result['verispec_version'])}</p>",
    ]
    body = [
        "<h2>Verdict per load level</h2>",
        _table(["level", "verdict", "criteria", "notes"], _verdict_rows(levels)),
        "<h2>Speedup and latency</h2>", _img(plots["speedup"], "speedup and ITL vs load"),
        _table(["level", "config", "ok", "tok/s", "req/s", "TTFT p50/p95 ms", "ITL p50/p95 ms", "TPOT p50/p95 ms",
                "e2e p50/p95 ms", "RSS peak MiB"], _level_rows(levels)),
        "<h2>Acceptance and the speedup model</h2>",
        _table(["level", "AR", "AL", "free", "alpha", "K", "c", "a_min", "c_break", "S(alpha,K,c)",
                "throughput ratio (CI)", "TPOT ratio"], _spec_rows(levels)),
        _img(plots["acceptance"], "acceptance per position"), _img(plots["predicted"], "predicted vs measured"),
        "<h2>Latency distributions</h2>", _img(plots["distributions"], "latency distributions"),
        "<h2>Quality</h2>", _quality_html(result["quality"]),
        "<h2>Memory</h2>", _memory_html(result["memory"]),
        "<h2>Method</h2><p>Each configuration ran every prompt once per repeat at each level, in alternating order. "
        "alpha is the maximum-likelihood per-token acceptance (accepted / positions reached); free is the share "
        "of drafts that cost no model pass (a composite's lookup; '-' where the server does not say), counted in "
        "AR, AL and alpha like the others; a_min solves "
        "S(a_min, K, c) = 1 (Leviathan et al. 2023); c_break = (E(alpha, K) - 1) / K. The throughput interval is a "
        "paired bootstrap over prompts of per-request rates, so it holds the noise between requests, not slow drift "
        "of a shared machine (see the load average above; use --repeats for that). The model ignores batching: "
        "compare predicted and measured speedups.</p>",
    ]  # fmt: skip
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{''.join(head + body)}</body></html>")  # fmt: skip


def render_summary_png(result: dict[str, Any], plots: dict[str, str | None] | None = None) -> bytes:
    """One picture of the report: the verdict per level over its plots (speedup and ITL vs load,
    acceptance per position, predicted vs measured speedup, latency distributions), as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    plots = plots if plots is not None else render_plots(result)
    images = [mpimg.imread(io.BytesIO(base64.b64decode(p)), format="png") for p in plots.values() if p is not None]
    verdicts = [(lv["label"], lv["verdict"]["verdict"]) for lv in result["levels"]]
    widest = max((im.shape[1] for im in images), default=1)  # each panel keeps its native scale
    heights = [0.45 + 0.28 * len(verdicts)] + [11.0 * im.shape[0] / widest for im in images]
    fig = plt.figure(figsize=(11.0, sum(heights)))
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights, hspace=0.02, left=0, right=1, top=1, bottom=0)
    head = fig.add_subplot(grid[0])
    head.axis("off")
    pair = result.get("pair") or {}
    title = f"verispec gate: {pair.get('target', result['endpoints']['spec']['model'])}"
    if pair.get("draft"):
        dtypes = f"{pair.get('dtype')} target" + (f", {pair['draft_dtype']} draft" if pair.get("draft_dtype") else "")
        title += f" <- {pair['draft']} (K={pair.get('k')}, {dtypes})"
    head.text(0.01, 0.98, title, fontsize=13, weight="bold", va="top")
    for i, (label, verdict) in enumerate(verdicts):
        y = 0.98 - (i + 1) * 0.8 / max(len(verdicts), 1)
        head.text(0.03, y, label, fontsize=11, va="top")
        head.text(0.35, y, verdict, fontsize=11, va="top", weight="bold", color=VERDICT_COLORS.get(verdict, "#000"))
    for i, im in enumerate(images):
        ax = fig.add_subplot(grid[i + 1])
        ax.imshow(im)
        ax.axis("off")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_report(
    result: dict[str, Any], html_path: Path | None, json_path: Path | None, png_path: Path | None = None
) -> None:
    """Write the HTML report, the JSON result and a summary picture (each atomically; None = skip)."""
    if json_path is not None:
        with atomic_path(json_path) as tmp:
            tmp.write_text(json.dumps(finite(result), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    plots = render_plots(result) if html_path is not None or png_path is not None else None
    if html_path is not None:
        text = render_html(result, plots)
        with atomic_path(html_path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    if png_path is not None:
        picture = render_summary_png(result, plots)
        with atomic_path(png_path) as tmp:
            tmp.write_bytes(picture)


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinite floats replaced by None (strict JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj
