"""Two eval reports of the same items (e.g. without and with a change), row by row: accuracy, kept share and
whole-prefill FLOPs (% of the every-token row) of each, and B - A with the paired 95% interval eval itself uses.

    python scripts/paired_reports.py A.json B.json
"""

from __future__ import annotations

import argparse
import json
import sys

from arr_coc.evaluation.report import paired_stats


def key(row: dict) -> tuple:
    return row["method"], row.get("encode"), row["budget"]


def main(path_a: str, path_b: str) -> None:
    a, b = (json.load(open(p)) for p in (path_a, path_b))
    if a["ids"] != b["ids"]:
        sys.exit("the two reports are not over the same items in the same order")
    full = next(r["e2e_flops_mean"] for r in a["results"] if r["method"] == "none")
    rows_b = {key(r): r for r in b["results"]}
    print(f"| row | A | B | B - A [95%] |\n|---|---|---|---|")
    for ra in a["results"]:
        rb = rows_b.get(key(ra))
        if rb is None or not ra.get("correct") or not rb.get("correct"):
            continue
        p = paired_stats(rb["correct"], ra["correct"])
        side = [f"{r['accuracy']:.4f}, kept {100 * r.get('kept_share', 1):.2f}%, {100 * r['e2e_flops_mean'] / full:.2f}%"
                for r in (ra, rb)]
        print(f"| {ra['method']} {ra.get('encode') or ''} {ra['budget']} | {side[0]} | {side[1]} | "
              f"{p['diff']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}] |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="an eval report (results.json)")
    parser.add_argument("b", help="an eval report of the same items")
    args = parser.parse_args()
    main(args.a, args.b)
