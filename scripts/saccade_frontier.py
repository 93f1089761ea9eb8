r"""Two looks against one: accuracy and whole-prefill cost of every gate threshold, beside one-look budgets.

    python scripts/saccade_frontier.py --rows runs/saccade/test_rows/rows.jsonl \
        --one-look runs/saccade/test_one_look.json [--gate runs/saccade/val_gate/gate.json] \
        --out docs/saccades_test2000.png --markdown saccades.md

--rows: `train-saccade`'s rows.jsonl on the split (two looks forced for every item: each threshold's outcome is
exact, `arr_coc.training.saccade.frontier`); --one-look: an `eval --encode before` report on the same items
(several budgets). Costs are shares of the every-token model's whole prefill (vision tower included), taken
from the rows. For each one-look budget the table gives the two-look threshold of about the same mean cost and
the paired difference (95% interval) against it, overall and on count questions; --gate marks a trained gate's
threshold (trained on another split).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: --rows, --one-look, --gate, --signal, --out, --markdown."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True)
    p.add_argument("--one-look", required=True)
    p.add_argument("--gate", default=None)
    p.add_argument("--signal", default="margin")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    return p.parse_args(argv)


def _load(rows_path: str, one_look_path: str) -> tuple[list[dict], dict]:
    """The two-look rows, in the one-look report's item order, and that report; they must cover the same items."""
    rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines() if line.strip()]
    report = json.loads(Path(one_look_path).read_text())
    by_id = {r["id"]: r for r in rows}
    if [by_id.get(i) is not None for i in report["ids"]].count(True) != len(report["ids"]):
        raise SystemExit("the rows and the one-look report cover other items")
    return [by_id[i] for i in report["ids"]], report


def _table(rows: list[dict], report: dict, curve: list[dict], u: list[float], full: float,
           paired_stats: Any) -> tuple[list[str], list[tuple]]:
    """Each one-look budget beside the best two-look threshold as cheap -> (table lines, (cost, accuracy, budget)s)."""
    def outcome(t: float) -> list[float]:
        """Each item's correctness when items above threshold `t` look again."""
        return [r["correct_2"] if x > t else r["correct_1"] for r, x in zip(rows, u)]

    lines = [f"{len(rows)} items; every token: whole prefill {full / 1e9:.3f} GFLOPs per item (vision tower included)",
             "", "| one look | its cost | its accuracy | two looks at <= that cost: threshold | cost | items looking "
             "again | accuracy | two looks - one look [95%] | on count questions [95%] |",
             "|---|---|---|---|---|---|---|---|---|"]
    count = [i for i, r in enumerate(rows) if r["type"] == "count"]
    one_look = []
    for res in sorted(report["results"], key=lambda r: r["e2e_flops_mean"]):
        if res.get("status") != "ok":
            continue
        cost = res["e2e_flops_mean"] / full
        one_look.append((cost, res["accuracy"], res["budget"]))
        fits = [c for c in curve if c["cost"] <= cost + 1e-12]
        if not fits:
            lines.append(f"| {res['budget']} | {100 * cost:.2f}% | {res['accuracy']:.4f} | none as cheap | | | | | |")
            continue
        best = max(fits, key=lambda c: c["accuracy"])
        two = outcome(best["threshold"])
        d = paired_stats(two, res["correct"])
        dc = paired_stats([two[i] for i in count], [res["correct"][i] for i in count])
        lines.append(f"| {res['budget']} | {100 * cost:.2f}% | {res['accuracy']:.4f} | {best['threshold']:.4f} | "
                     f"{100 * best['cost']:.2f}% | {100 * best['saccade_share']:.1f}% | {best['accuracy']:.4f} | "
                     f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}] | "
                     f"{dc['diff']:+.4f} [{dc['low']:+.4f}, {dc['high']:+.4f}] |")
    return lines, one_look


def _plot(out: str, curve: list[dict], one_look: list[tuple], gate: dict | None, n_items: int) -> None:
    """Draw the two-look curve, the one-look budgets and the trained gate to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([100 * c["cost"] for c in curve], [c["accuracy"] for c in curve], "-", lw=1.2, color="tab:orange",
            label="two looks: every gate threshold")
    ax.plot([100 * c for c, _, _ in one_look], [a for _, a, _ in one_look], "o-", color="tab:blue", lw=2,
            label="one look: budgets " + ", ".join(f"{b:g}" for _, _, b in one_look))
    if gate is not None:
        ax.plot([100 * gate["cost"]], [gate["accuracy"]], "r*", ms=13, label="two looks: the trained gate")
    ax.set_xlabel("whole-prefill FLOPs, % of the every-token model (vision tower included)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"a second look against a larger first look ({n_items} items)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the two-look vs one-look table; optionally plot it."""
    from arr_coc.evaluation.report import paired_stats
    from arr_coc.training.saccade import frontier

    args = _parse_args(argv)
    rows, report = _load(args.rows, args.one_look)
    full = sum(r["full"] for r in rows) / len(rows)
    u = [r[f"u_{args.signal}"] for r in rows]
    curve = frontier(rows, args.signal)
    lines, one_look = _table(rows, report, curve, u, full, paired_stats)
    gate = None
    if args.gate:
        g = json.loads(Path(args.gate).read_text())
        (gate,) = frontier(rows, args.signal, [g["threshold"]])
        lines += ["", f"Trained gate (threshold {g['threshold']:.4f}, trained on {g.get('trained_on')}): accuracy "
                      f"{gate['accuracy']:.4f} at {100 * gate['cost']:.2f}%, {100 * gate['saccade_share']:.1f}% of "
                      "items look again."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.out:
        _plot(args.out, curve, one_look, gate, len(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
