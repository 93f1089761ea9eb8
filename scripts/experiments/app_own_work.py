"""The microscope's cost table as a visitor sees it: ARR-COC's own work beside the vision tower, per example.

    OMP_NUM_THREADS=2 python scripts/experiments/app_own_work.py --rounds 5 [--checkout /path/to/other/checkout]

Loads the page's model and layers as `make run` does (the app's malloc settings included: two arenas, the heap
trimmed after every request), then asks every example of `assets/examples/examples.json` through the page's own
handler (`arr_coc_microscope.handler.ask`, the page's defaults: config A after the tower, config B before it with
the adapter, both at the page's budget), round after round, and prints per example and configuration the medians
of the table's rows: the vision tower, ARR-COC's own work (of which the selection), the LM prefill, the whole
prefill. --checkout runs another version of the code (a `git worktree` of an older commit) with this script:
the table's rows have kept their names since the app began.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROWS = {"vision": "vision tower, gist incl. (ms)", "own": "ARR-COC's own work (ms)",
        "selection": "of which selection (ms)", "prefill": "LM prefill (ms)", "whole": "whole prefill (ms)"}
COLUMNS = {"baseline": 1, "A": 2, "B": 3}      # the table's columns after the row name


def cell(stats: list[list[str]], row: str, column: int) -> float | None:
    """The number in the table's `row` and `column`, or None where the row is absent or shows no number."""
    for r in stats:
        if r[0] == row:
            try:
                return float(str(r[column]).split()[0])
            except (ValueError, IndexError):
                return None
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", default=str(Path(__file__).resolve().parents[2]),
                   help="the checkout whose app and library run (default: this one)")
    p.add_argument("--rounds", type=int, default=5, help="asks per example, after one warm-up round")
    p.add_argument("--out", default=None, help="write every request's rows as JSON here")
    args = p.parse_args()
    root = Path(args.checkout).resolve()
    sys.path.insert(0, str(root))     # the app's package sits in the checkout beside the library

    from PIL import Image

    from arr_coc_microscope.handler import ask
    from arr_coc_microscope.memory import limit_malloc_arenas, release_memory
    from arr_coc_microscope.server import add_layers, load, parse_args, shipped_before_layer

    import arr_coc
    print(f"library: {arr_coc.__file__}")
    limit_malloc_arenas()
    scope = load(None, device="cpu")
    add_layers(scope, shipped_before_layer(scope, parse_args([])))
    examples = json.loads((root / "assets/examples/examples.json").read_text())
    images = {e["image"]: Image.open(root / "assets/examples" / e["image"]).convert("RGB") for e in examples}
    seen: dict[str, list[dict[str, dict[str, float | None]]]] = {e["image"]: [] for e in examples}
    for n in range(args.rounds + 1):
        for e in examples:
            t0 = time.perf_counter()
            result = ask(scope, images[e["image"]], e["question"])
            release_memory()
            if result.error.startswith("**Error:**"):      # a note (an empty answer) is not one
                raise SystemExit(f"{e['image']}: {result.error}")
            if n:     # round 0 warms every shape up
                seen[e["image"]].append({c: {k: cell(result.stats, row, col) for k, row in ROWS.items()}
                                         for c, col in COLUMNS.items()} | {"wall_ms": (time.perf_counter() - t0) * 1e3})
    print(f"{args.rounds} rounds, medians, ms (config B: before the tower, with the adapter)")
    print("| example | size | B: vision | B: own work | B: of which selection | B: LM prefill | B: own / vision | "
          "A: own work | baseline: vision |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in seen.items():
        med = {c: {k: statistics.median(r[c][k] for r in runs) for k in ROWS} for c in COLUMNS}
        size = "x".join(map(str, images[name].size))
        print(f"| {name} | {size} | {med['B']['vision']:.1f} | {med['B']['own']:.1f} | {med['B']['selection']:.1f} | "
              f"{med['B']['prefill']:.1f} | {med['B']['own'] / med['B']['vision']:.2f} | {med['A']['own']:.1f} | "
              f"{med['baseline']['vision']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"checkout": str(root), "rounds": seen}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
