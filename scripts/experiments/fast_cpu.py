"""The whole request on the embedded model, eager against the fast path (buckets + inductor + static cache), side
by side on the same items (docs/GPU.md 8.1).

    python scripts/experiments/fast_cpu.py [--items 12] [--out fast_cpu.json]

`respond` with 4 new tokens; the first item's request is reported on its own (it compiles the fast path's
graphs), the rest as medians, fast and eager alternating which goes first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)



def main() -> None:
    from arr_coc.execution import Execution
    from arr_coc.paths import default_layer_path, default_model_path
    from arr_coc.pipeline.request import Pruning
    from arr_coc import ARRCOC
    from arr_coc_shapes import make_item

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=12)
    p.add_argument("--out", default="fast_cpu.json")
    args = p.parse_args()
    layer = default_layer_path("before")
    eager = ARRCOC.from_pretrained(default_model_path(), arr_coc=layer)
    fast = ARRCOC(eager.backend.sibling(), arr_coc=layer, execution=Execution.fast("cpu"))
    items = [make_item(7, "test", i) for i in range(args.items)]
    rows = []
    for method, encode, budget in (("arr_coc", "before", 0.05), ("none", "after", None)):
        pruning = Pruning.of(method, budget, encode=encode)
        times, first = {"eager": [], "fast": []}, {}
        for i, (image, record, _) in enumerate(items):
            for name in (("eager", "fast") if i % 2 == 0 else ("fast", "eager")):
                t0 = time.perf_counter()
                (eager if name == "eager" else fast).respond([image], [record["question"]], pruning, max_new_tokens=4)
                (times[name] if i else first.setdefault(name, [])).append(time.perf_counter() - t0)
        row = {"method": method, "encode": encode, "budget": budget, "first_eager_s": first["eager"][0],
               "first_fast_s": first["fast"][0], "eager_ms": statistics.median(times["eager"]) * 1e3,
               "fast_ms": statistics.median(times["fast"]) * 1e3}
        row["fast_over_eager"] = row["fast_ms"] / row["eager_ms"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
