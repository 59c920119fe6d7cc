"""The deployment certification as HTML: a section (the verdict, one row per prompt, how to read
it) that ``verispec certify --html`` wraps in a page and the gate's report embeds. Every value
from the run (prompts, URLs, model names) is escaped: a prompt file or an endpoint's name cannot
inject markup."""

from __future__ import annotations

import html
import json
from typing import Any

CSS = (
    "body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left;font-family:monospace}.pass{color:#17692b;font-weight:bold}"
    ".fail{color:#b00020;font-weight:bold}.box{background:#f6f6f6;padding:.6em 1em}"
)


def _f(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def deployment_section(result: dict[str, Any]) -> str:
    """An HTML fragment of a certification result (:meth:`DeploymentReport.to_dict`, plus what
    the caller adds: target, drafter, endpoints)."""
    passed = bool(result.get("passed"))
    verdict = "<span class=pass>pass</span>" if passed else "<span class=fail>FAIL</span>"
    if result.get("valid") is False:
        where = html.escape(", ".join(result.get("correlated", [])))
        verdict = (f"<span class=fail>NOT VALID</span> (samples not independent: identical continuations in runs "
                   f"from {where}); the test said {verdict}")  # fmt: skip
    fit = result.get("mode") == "goodness-of-fit"
    how = (
        f"{result.get('samples_per_arm')} speculative samples per prompt tested against the baseline's own "
        f"probabilities (cells from a pilot of {result.get('pilot')})"
        if fit
        else f"{result.get('samples_per_arm')} samples per arm and prompt, two-sample chi-square"
    )
    rows = []
    for p in result.get("prompts", []):
        low, high = (p.get("tv_interval") or [None, None])[:2]
        rows.append(
            "<tr>" + "".join(f"<td>{c}</td>" for c in (
                html.escape(repr(str(p.get("prompt", ""))[:60])), _f(p.get("distinct"), "d"), _f(p.get("cells"), "d"),
                html.escape(str(p.get("method", ""))), _f(p.get("p_value"), ".3g"),
                f"{_f(p.get('tv'), '.3f')} [{_f(low, '.3f')}, {_f(high, '.3f')}]", _f(p.get("detectable_tv"), ".3f"),
                _f(p.get("seconds"), ".0f"),
            )) + "</tr>"
        )  # fmt: skip
    head = "".join(f"<th>{c}</th>" for c in ("prompt", "outcomes", "cells", "test", "p", "TV [95% CI]",
                                              "detectable TV", "s"))  # fmt: skip
    params = html.escape(json.dumps(result.get("params", {})))
    who = {k: result[k] for k in ("target", "drafter", "baseline", "speculative", "tokenizer") if result.get(k)}
    return (
        f"<p>{verdict}: combined p = {_f(result.get('p_value'), '.3g')} ({html.escape(str(result.get('combine')))}) "
        f"at alpha {_f(result.get('alpha'), 'g')}; first {_f(result.get('tokens'), 'd')} tokens; "
        f"{html.escape(how)}.</p>"
        f"<p class=box>{html.escape(json.dumps(who))}<br>sampling: {params}</p>"
        f"<table><tr>{head}</tr>{''.join(rows)}</table>"
        "<p>A pass bounds the difference between the output laws only at the detectable TV (the smallest "
        "total variation this run would have caught with probability 0.8, per prompt; best prompt "
        f"{_f(result.get('detectable_tv'), '.3f')}): smaller differences are not excluded. The TV is estimated "
        "over the test's pooled outcomes, a lower bound of the TV over all continuations.</p>"
    )


def deployment_page(result: dict[str, Any]) -> str:
    """A standalone HTML page of a certification result."""
    title = f"verispec certify: {result.get('target', '')}"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<h2>Is the output law unchanged?</h2>{deployment_section(result)}</body></html>"
    )
