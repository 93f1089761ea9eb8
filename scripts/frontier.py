r"""Accuracy against whole-prefill FLOPs across several `eval` runs on the same items, with paired intervals.

    python scripts/frontier.py runs/after.json runs/before.json=layer:before-tex --reference none@1.0 \
        --out docs/frontier.png --markdown frontier.md

Each argument is a results.json from `python -m arr_coc eval` (optionally `=LABEL` to prefix its rows'
names, e.g. when two runs evaluated `arr_coc_trained` with different layers). All runs must cover the
same items (their `ids` are checked). Every row is placed at its e2e cost (vision tower + ARR-COC +
LM prefill, `e2e_flops_mean`) as a share of the reference row's (default: method none at budget 1.0),
and compared item by item with the reference and with the best anchor at or below its own cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def shown_method(method: str) -> str:
    """A row's method as the plot names it: "X-adapter" is X (the layer alone), "X+adapter" is "X + adapter", and
    "arr_coc_trained@before" is arr_coc_trained (the encode is shown beside it anyway)."""
    from arr_coc.evaluation.plans import split_spec

    base = split_spec(method)[0]
    return f"{base} + adapter" if method.endswith("+adapter") else base


def load_rows(specs: list[str]) -> tuple[list[dict], list]:
    rows, ids = [], None
    for spec in specs:
        path, _, label = spec.partition("=")
        report = json.loads(Path(path).read_text())
        if ids is None:
            ids = report["ids"]
        elif report["ids"] != ids:
            raise SystemExit(f"{path} covers other items than {specs[0].partition('=')[0]}: paired comparison needs the same")
        for r in report["results"]:
            if r.get("status") != "ok" or not r.get("correct"):
                continue
            plain = r["method"] in ("none", "downscale")  # no encoding choice: every patch, or a smaller image
            method = shown_method(r["method"])
            name = method if plain else f"{method} ({r.get('encode', 'after')})"
            name = f"{label}: {name}" if label else name
            if any(x["name"] == name and x["budget"] == r["budget"] for x in rows):
                continue                                 # the same row in two runs (e.g. each run's none): once
            rows.append({**r, "name": name})
    return rows, ids


def paired(a: list[int], b: list[int]) -> tuple[float, float, float]:
    """(difference, low, high): `arr_coc.evaluation.report.paired_stats`, the eval report's own interval."""
    from arr_coc.evaluation.report import paired_stats

    p = paired_stats(a, b)
    return p["diff"], p["low"], p["high"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="results.json[=LABEL]")
    p.add_argument("--reference", default="none@1.0", help="METHOD@BUDGET every share is taken of (default none@1.0)")
    p.add_argument("--anchors", default="fastv,visionzip,divprune,cdpruner,random,grid,downscale",
                   help="methods the frontier is compared with at their own cost")
    p.add_argument("--out", default=None, help="PNG: accuracy against e2e FLOP share")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)

    rows, ids = load_rows(args.runs)
    ref_method, _, ref_budget = args.reference.partition("@")
    ref = next((r for r in rows if r["method"] == ref_method and float(r["budget"]) == float(ref_budget)), None)
    if ref is None:
        raise SystemExit(f"no row {args.reference} in the runs")
    full = ref["e2e_flops_mean"]
    anchors = set(args.anchors.split(","))
    for r in rows:
        r["e2e_share"] = r["e2e_flops_mean"] / full
    lines = [f"{len(ids)} items; reference {args.reference}: accuracy {ref['accuracy']:.3f}, "
             f"e2e {full / 1e9:.3f} GFLOPs per item (vision tower included)", "",
             "| row | budget | kept | e2e share | accuracy | vs reference | vs best anchor at <= its cost |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["e2e_share"]):
        d, lo, hi = paired(r["correct"], ref["correct"])
        cheaper = [a for a in rows if a["method"] in anchors and a["e2e_share"] <= r["e2e_share"] and a is not r]
        best = max(cheaper, key=lambda a: a["accuracy"], default=None)
        vs = "" if best is None else "{:+.3f} [{:+.3f}, {:+.3f}] ({} {})".format(
            *paired(r["correct"], best["correct"]), best["name"], best["budget"])
        lines.append(f"| {r['name']} | {r['budget']} | {r['kept_share']:.3f} | {r['e2e_share']:.3f} | "
                     f"{r['accuracy']:.3f} | {d:+.3f} [{lo:+.3f}, {hi:+.3f}] | {vs} |")
    lines += ["", "At every anchor's own cost: the most accurate ARR-COC row costing no more, minus the anchor "
              "(paired 95% interval):", "",
              "| anchor | budget | e2e share | accuracy | best ARR-COC row at <= its cost | its accuracy | difference |",
              "|---|---|---|---|---|---|---|"]
    for a in sorted((r for r in rows if r["method"] in anchors), key=lambda r: r["e2e_share"]):
        ours = [r for r in rows if r["method"].startswith("arr_coc") and r["e2e_share"] <= a["e2e_share"]]
        best = max(ours, key=lambda r: r["accuracy"], default=None)
        if best is None:
            lines.append(f"| {a['name']} | {a['budget']} | {a['e2e_share']:.3f} | {a['accuracy']:.3f} | none as cheap | | |")
            continue
        lines.append("| {} | {} | {:.3f} | {:.3f} | {} {} ({:.3f}) | {:.3f} | {:+.3f} [{:+.3f}, {:+.3f}] |".format(
            a["name"], a["budget"], a["e2e_share"], a["accuracy"], best["name"], best["budget"], best["e2e_share"],
            best["accuracy"], *paired(best["correct"], a["correct"])))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5.2))
        by_name: dict[str, list[dict]] = {}
        for r in rows:
            by_name.setdefault(r["name"], []).append(r)
        colours = plt.get_cmap("tab20").colors
        for i, (name, group) in enumerate(sorted(by_name.items())):
            group.sort(key=lambda r: r["e2e_share"])
            ours = group[0]["method"].startswith("arr_coc")
            ax.plot([r["e2e_share"] for r in group], [r["accuracy"] for r in group], "o-", label=name,
                    ms=5 if ours else 4, lw=2.2 if ours else 1.2, color=colours[(2 * i) % 20 if i < 10 else 2 * i - 19])
        ax.axhline(ref["accuracy"], color="grey", ls=":", lw=1)
        ax.set_xlabel("whole-prefill FLOPs (vision tower + ARR-COC + LM) / full model's")
        ax.set_ylabel("accuracy")
        ax.set_xscale("log")
        ax.set_title(f"accuracy against end-to-end cost ({len(ids)} items)")
        ax.legend(fontsize=7, loc="lower center")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out, dpi=130)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
