"""Reports of an evaluation: the JSON file, Markdown tables, paired differences, the plot."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any

from ..budget import Budget


def write_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- reports


def fmt_budget(b: Budget) -> str:
    """A budget as a column header: 0.05 -> '5%', 64 -> '64 tok'."""
    return f"{b * 100:g}%" if isinstance(b, float) else f"{b} tok"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _gflops(x: float | None) -> str:
    return "unknown" if x is None else f"{x / 1e9:.3f}"


def _row(by: dict[tuple[str, Any], dict[str, Any]], method: str, budget: Budget) -> dict[str, Any] | None:
    """The (method, budget) result; `none` runs once, at 1.0, and stands for every budget."""
    return by.get((method, budget)) or (by.get((method, 1.0)) if method == "none" else None)


def accuracy_table(report: dict[str, Any]) -> str:
    """Markdown pivot: one row per method, one column per budget, accuracy (coverage).

    Where a row kept a mean share of tokens more than 3% away from its budget (the trained
    layer, whose budget follows the question; downscale's rounded image sizes), the cell says so.
    """
    budgets = report.get("budgets") or sorted({r["budget"] for r in report["results"]}, key=float)
    cols = list(budgets)
    if 1.0 not in cols and any(r["budget"] == 1.0 for r in report["results"]):
        cols.append(1.0)
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    lines = ["| method | " + " | ".join(fmt_budget(b) for b in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for m in methods:
        cells = []
        for b in cols:
            r = _row(by, m, b)
            if r is None or (m == "none" and b != 1.0):
                cells.append("" if m == "none" else "–")
                continue
            if r.get("status") == "failed":
                cells.append("failed")
                continue
            notes = [_fmt(r["coverage"], 2)] if r.get("coverage") is not None else []
            kept = r.get("kept_share")
            if isinstance(b, float) and b < 1.0 and kept is not None and abs(kept - b) > 0.03 * b:
                notes.append(f"{100 * kept:.1f}% kept")  # a budget met on average, or downscale's rounding
            cells.append(_fmt(r["accuracy"]) + (f" ({'; '.join(notes)})" if notes else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_difference(report: dict[str, Any], a: str, b: str, budget: Budget) -> dict[str, float] | None:
    """Accuracy of method `a` minus method `b` at `budget` on the same items, with a 95% interval.

    Paired over items (both methods answered the same questions), so the interval is much
    tighter than two independent ones: diff +- 1.96 * sd(d_i) / sqrt(n), d_i = correct_a - correct_b.
    Also counts the items only `a` got right (`wins`) and only `b` got right (`losses`).
    """
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    ra, rb = _row(by, a, budget), _row(by, b, budget)
    if not ra or not rb or not ra.get("correct") or len(ra["correct"]) != len(rb.get("correct") or []):
        return None
    return paired_stats(ra["correct"], rb["correct"])


def paired_stats(correct_a: list[float], correct_b: list[float]) -> dict[str, float]:
    """Mean of d_i = correct_a - correct_b over the same items, its 95% interval, wins, losses, n.

    The one paired interval of the project (eval's `vs_full`, the paired tables, the scripts): the normal
    approximation, diff +- 1.96 * sd(d_i) / sqrt(n). Fewer than two items have no interval (nan); none, no
    difference either (0.0)."""
    d = [x - y for x, y in zip(correct_a, correct_b)]
    n = len(d)
    mean = sum(d) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, n - 1))
    half = 1.96 * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"diff": mean, "low": mean - half, "high": mean + half, "wins": sum(x > 0 for x in d),
            "losses": sum(x < 0 for x in d), "n": n}


def paired_table(report: dict[str, Any], method: str) -> str:
    """Markdown: `method` minus every other method, per pruned budget (paired 95% intervals)."""
    budgets = [b for b in report.get("budgets", []) if b != 1.0]
    others = [m for m in dict.fromkeys(r["method"] for r in report["results"]) if m not in (method, "none")]
    if not budgets or not others or not any(r["method"] == method for r in report["results"]):
        return ""
    lines = [f"Accuracy of `{method}` minus each method on the same items (paired 95% interval; "
             "items only it / only the other got right):", "",
             "| vs. | " + " | ".join(fmt_budget(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for other in others:
        cells = []
        for b in budgets:
            p = paired_difference(report, method, other, b)
            cells.append("–" if p is None else
                         f"{p['diff']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] {p['wins']}/{p['losses']}")
        lines.append(f"| {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cost_table(report: dict[str, Any]) -> str:
    """Markdown: per row its encoding, budget, kept share, whole-prefill cost against every token, accuracy, the
    paired interval against every token, the agreement with its answers (rows without a `none` row: '–') and how
    many items kept more than the budget (a clip's minimum; `budget_notes` in the JSON says why)."""
    lines = ["| method | encode | budget | kept | cost (whole prefill) | accuracy | vs full (95%) | agree | over budget |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r.get("status") == "failed":
            lines.append(f"| {r['method']} | {r.get('encode', 'after')} | {r['budget']} | failed: {r.get('error', '')} "
                         "| | | | | |")
            continue
        vs = r.get("vs_full")
        lines.append(f"| {r['method']} | {r.get('encode', 'after')} | {r['budget']} | {_fmt(r.get('kept_share'))} | "
                     f"{_fmt(r.get('cost'))} | {_fmt(r.get('accuracy'))} | "
                     f"{'–' if not vs else f'[{vs[0]:+.3f}, {vs[1]:+.3f}]'} | {_fmt(r.get('agree'))} | "
                     f"{r.get('over_budget') or ''} |")
    return "\n".join(lines) + "\n"


def markdown_table(report: dict[str, Any]) -> str:
    """The README's tables: accuracy by budget, then every measured column."""
    out = [f"Accuracy (coverage of the answer's box cells) on {report['n']} items of `{report.get('data', '')}`, "
           f"model `{report.get('model', '')}`:", "", accuracy_table(report),
           "| method | budget | encode | kept / total tokens | accuracy | coverage | prefill GFLOPs | selector GFLOPs | "
           "vision GFLOPs | end-to-end GFLOPs | latency ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r.get("status") == "failed":
            out.append(f"| {r['method']} | {fmt_budget(r['budget'])} | {r.get('encode', 'after')} | "
                       f"failed: {r.get('error', '')} | | | | | | | |")
            continue
        out.append(
            f"| {r['method']} | {fmt_budget(r['budget'])} | {r.get('encode', 'after')} | "
            f"{_fmt(r['kept_tokens_mean'], 1)} / {_fmt(r['total_tokens_mean'], 1)} | {_fmt(r['accuracy'])} | "
            f"{_fmt(r['coverage'], 2)} | {_gflops(r['prefill_flops_mean'])} | {_gflops(r.get('selector_flops_mean'))} | "
            f"{_gflops(r.get('vision_flops_mean'))} | {_gflops(r.get('e2e_flops_mean'))} | "
            f"{_fmt((r['latency_s_median'] or 0) * 1e3, 1)} |")
    best = "arr_coc_trained" if any(r["method"] == "arr_coc_trained" for r in report["results"]) else "arr_coc"
    paired = paired_table(report, best)
    if paired:
        out += ["", paired]
    if report.get("skipped"):
        out += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(out) + "\n"


def write_plot(report: dict[str, Any], path: str) -> None:
    """Up to four panels, one line per method: accuracy and coverage of the answer's cells against the
    share of visual tokens kept, accuracy against LM prefill FLOPs (the method's own work included,
    vision tower excluded) and against end-to-end FLOPs (vision tower + method + LM), each as a share
    of the full model's, where a selector that pays for its choice, or for the full tower, shows it.

    The oracle is drawn as the ceiling (dashed black), all tokens as a dotted line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next((r["prefill_flops_mean"] for r in report["results"] if r["method"] == "none"), None) or next(
        (r["prefill_flops_mean"] for r in report["results"] if r["budget"] == 1.0), None)
    full_e2e = next((r.get("e2e_flops_mean") for r in report["results"] if r["method"] == "none"), None)
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in report["results"]:
        if r.get("status", "ok") == "ok" and r["accuracy"] is not None and r.get("kept_share") is not None:
            flops_share = r["prefill_flops_mean"] / full if full and r.get("prefill_flops_mean") else None
            e2e_share = r["e2e_flops_mean"] / full_e2e if full_e2e and r.get("e2e_flops_mean") else None
            by_method[r["method"]].append({**r, "flops_share": flops_share, "e2e_share": e2e_share})
    panels = [("kept_share", "accuracy", "accuracy")]
    if any(r.get("coverage") is not None for rs in by_method.values() for r in rs):
        panels.append(("kept_share", "coverage", "coverage of the answer's box cells"))
    if full:
        panels.append(("flops_share", "accuracy", "accuracy"))
    if full_e2e:
        panels.append(("e2e_share", "accuracy", "accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), dpi=120, squeeze=False)
    styles = {"oracle": dict(color="black", linestyle="--", linewidth=2.2, marker="^", label="oracle (ceiling)"),
              "arr_coc": dict(color="tab:red", linewidth=2.4, marker="o", label="arr_coc"),
              "arr_coc_trained": dict(color="darkred", linewidth=2.4, marker="o", label="arr_coc_trained")}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan", "tab:gray", "gold", "navy", "teal"]
    colours = {m: palette[i % len(palette)] for i, m in enumerate(m for m in by_method if m not in styles)}
    ticks = sorted({float(b) for b in report.get("budgets", []) if isinstance(b, float)}
                   | {0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0})
    for ax, (xkey, key, label) in zip(axes[0], panels):
        top, xs = 0.0, []
        for method, rs in by_method.items():
            rs = sorted((r for r in rs if r.get(key) is not None and r.get(xkey)), key=lambda r: r[xkey])
            if not rs:
                continue
            top = max([top] + [r[key] for r in rs])
            if method == "none":
                ax.axhline(rs[0][key], color="grey", linestyle=":", linewidth=1.5, label="none (all tokens)")
                continue
            xs += [r[xkey] for r in rs]
            style = styles.get(method) or dict(marker=".", linewidth=1.3, label=method, color=colours[method])
            ax.plot([r[xkey] for r in rs], [r[key] for r in rs], **style)
        ax.set_xscale("log")
        # The axis spans the points drawn (not always up to 100%: a 5% / 10% run would leave most of it empty).
        lo, hi = (min(xs) / 1.25, min(1.05, max(xs) * 1.25)) if xs else (0.01, 1.05)
        shown = [t for t in ticks if lo <= t <= hi]
        ax.set_xlim(lo, hi)
        ax.set_xticks(shown)
        ax.set_xticklabels([f"{t * 100:g}%" for t in shown])
        ax.minorticks_off()
        ax.set_ylim(0.0, min(1.02, top + 0.08) if top > 0 else 1.0)
        if xkey == "kept_share":
            ax.set_xlabel("visual tokens kept (share of the original image's tokens)")
            ax.set_title(f"{label} vs. visual-token budget ({report['n']} items)", fontsize=10)
        elif xkey == "flops_share":
            ax.set_xlabel("LM prefill FLOPs incl. the method's own, vision tower excluded (share of the full)")
            ax.set_title(f"{label} vs. language-model compute ({report['n']} items)", fontsize=10)
        else:
            ax.set_xlabel("end-to-end prefill FLOPs: vision tower + method + LM (share of the full model's)")
            ax.set_title(f"{label} vs. end-to-end compute ({report['n']} items, encode "
                         f"{report.get('encode', {}).get('mode', 'after')})", fontsize=10)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
