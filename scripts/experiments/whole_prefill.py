r"""The whole prefill's wall time as the microscope reports it, per configuration, on real items.

    OMP_NUM_THREADS=1 python scripts/experiments/whole_prefill.py --data data/holdout/holdout.jsonl --limit 40

For each item (one at a time, as the app runs them): `generate` with every token (the baseline), then ARR-COC
after the tower and before it at --budget, with the shipped layer of each mode; the whole prefill is
vision tower + ARR-COC's own work (selection + packing) + LM prefill, from each run's Trace
(arr_coc_microscope/readout.py: `whole_prefill_s`). Prints medians over the items and each configuration's median
share of the baseline (per item, the configuration's time over the baseline's).
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from PIL import Image

    from arr_coc.data.jsonl import read_jsonl
    from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_BEFORE_LAYER, SHIPPED_LAYER
    from arr_coc import ARRCOC
    from arr_coc.runtime import keep_large_buffers

    keep_large_buffers()
    after = ARRCOC.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_LAYER)
    before = ARRCOC(after.backend.sibling(), arr_coc=SHIPPED_BEFORE_LAYER)   # the same weights, its own state
    runs = {"baseline": (after, "none", "after"), f"after {args.budget:g}": (after, "arr_coc", "after"),
            f"before {args.budget:g}": (before, "arr_coc", "before")}
    records = read_jsonl(args.data)[: args.limit + args.warmup]
    times: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for n, rec in enumerate(records):
        image = Image.open(rec.image).convert("RGB")
        for name, (vlm, method, encode) in runs.items():
            budget = 1.0 if method == "none" else args.budget
            _, tr = vlm.generate(image, rec.question, budget=budget, method=method, encode=encode, max_new_tokens=1)
            if n >= args.warmup:
                times[name].append({"vision": tr.vision_s, "own": getattr(tr, "arr_coc_s", tr.select_s), "prefill": tr.prefill_s,
                                    "whole": tr.vision_s + getattr(tr, "arr_coc_s", tr.select_s) + tr.prefill_s, "kept": tr.kept_ratio})
    base = times["baseline"]
    print(f"{len(base)} items of {args.data}, one at a time; medians, ms")
    print("| configuration | vision | ARR-COC own | LM prefill | whole prefill | share of the baseline | kept |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in times.items():
        med = {k: statistics.median(r[k] for r in rows) for k in ("vision", "own", "prefill", "whole", "kept")}
        share = statistics.median(r["whole"] / b["whole"] for r, b in zip(rows, base))
        print(f"| {name} | {1e3 * med['vision']:.1f} | {1e3 * med['own']:.1f} | {1e3 * med['prefill']:.1f} | "
              f"{1e3 * med['whole']:.1f} | {share:.2f} | {med['kept']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
