"""Which items lose most when pruned: every token's accuracy minus a pruned row's, by question type, by the answer
box's size (terciles of its area) and by the number of answer boxes, with a second pruned row beside it.

    python scripts/experiments/pruning_loss_by_kind.py val_adapter.json data/val/val.jsonl --budget 0.05 \
        --row arr_coc_trained@before-adapter --beside arr_coc_trained@before+adapter
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report"), p.add_argument("data")
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--row", default="arr_coc_trained@before-adapter")
    p.add_argument("--beside", default=None)
    a = p.parse_args()
    report = json.load(open(a.report))
    records = {r["id"]: r for r in map(json.loads, open(a.data))}
    rows = {(x["method"], x["budget"]): np.array(x["correct"]) for x in report["results"] if x.get("correct")}
    full, row = rows[("none", 1.0)], rows[(a.row, a.budget)]
    beside = rows.get((a.beside, a.budget)) if a.beside else None
    items = [records[i] for i in report["ids"]]
    types = np.array([r["type"] for r in items])
    area = np.array([min(((x1 - x0) * (y1 - y0) for x0, y0, x1, y1 in r.get("boxes") or []), default=np.nan)
                     for r in items], dtype=float)
    boxes = np.array([len(r.get("boxes") or []) for r in items])
    low, high = np.nanquantile(area, [1 / 3, 2 / 3])
    groups = [(f"type {t}", types == t) for t in sorted(set(types))]
    groups += [(f"answer box <= {low:.0f} px2", area <= low), ("answer box between", (area > low) & (area <= high)),
               (f"answer box > {high:.0f} px2", area > high), ("no answer box", boxes == 0),
               ("one answer box", boxes == 1), ("2+ answer boxes", boxes >= 2)]
    print(f"| items | n | every token | {a.row} | loss |" + (f" {a.beside} |" if beside is not None else ""))
    print("|---|---|---|---|---|" + ("---|" if beside is not None else ""))
    for name, m in groups:
        cells = f"| {name} | {m.sum()} | {full[m].mean():.3f} | {row[m].mean():.3f} | {full[m].mean() - row[m].mean():+.3f} |"
        print(cells + (f" {beside[m].mean():.3f} |" if beside is not None else ""))


if __name__ == "__main__":
    main()
