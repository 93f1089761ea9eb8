"""Two eval reports of the same split, item by item: what a refactor must not change.

    python scripts/eval_compare.py before.json after.json [N]    # N: the first N items of both only

For every (method, budget, encode) row of both reports: whether each item's correctness, answer, kept and encoded
cell counts, coverage of the answer's cells and looks are the same, and whether the row's FLOP means are; the first
differing items of a row are printed with both values. Exit status 0 when every item-row is identical, 1 otherwise.
(The kept cells themselves are compared by scripts/kept_cells.py.)
"""

from __future__ import annotations

import argparse
import json
import sys

FIELDS = ("correct", "answers", "item_kept", "item_encoded", "item_coverage", "item_looks")
MEANS = ("prefill_flops_mean", "vision_flops_mean", "e2e_flops_mean", "selector_flops_mean", "adapter_flops_mean")


def rows_of(report: dict) -> dict:
    return {(r["method"], str(r["budget"]), r.get("encode")): r for r in report["results"]}


def first(report: dict, n: int | None) -> dict:
    """The report cut to its first n items (a run with --limit n over the same batches gives the same items)."""
    if n is None:
        return report
    cut = {"ids": report["ids"][:n], "results": []}
    for r in report["results"]:
        cut["results"].append({k: v[:n] if k in FIELDS + ("correct",) else v for k, v in r.items()})
    return cut


def main(old_path: str, new_path: str, n: str | None = None) -> int:
    old, new = (first(json.load(open(p)), None if n is None else int(n)) for p in (old_path, new_path))
    if old["ids"] != new["ids"]:
        print("the two reports are of different items")
        return 1
    a, b = rows_of(old), rows_of(new)
    if a.keys() != b.keys():
        print(f"rows in one report only: {sorted(set(a) ^ set(b))}")
        return 1
    total = same = 0
    for key in sorted(a):
        ra, rb = a[key], b[key]
        fields = [f for f in FIELDS if f in ra]
        diff = [i for i in range(len(ra["correct"])) if any(ra[f][i] != rb[f][i] for f in fields)]
        means = [m for m in MEANS if ra.get(m) != rb.get(m)]
        total, same = total + len(ra["correct"]), same + len(ra["correct"]) - len(diff)
        flops = "not compared (means over another number of items)" if n is not None else \
            "identical" if not means else "differ: " + ", ".join(means)
        print(f"{key}: {len(ra['correct']) - len(diff)} of {len(ra['correct'])} items identical; FLOP means {flops}")
        for i in diff[:5]:
            print("   ", old["ids"][i], {f: (ra[f][i], rb[f][i]) for f in fields if ra[f][i] != rb[f][i]})
    print(f"{same} of {total} item-rows identical")
    return 0 if same == total else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="an eval report (results.json)")
    parser.add_argument("after", help="an eval report of the same split")
    parser.add_argument("n", nargs="?", help="compare the first N items of both only")
    args = parser.parse_args()
    sys.exit(main(args.before, args.after, args.n))
