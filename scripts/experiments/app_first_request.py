"""The microscope's first request after start against the next ones, with or without the warm-up at load
(docs/GPU.md 8.1).

    python scripts/experiments/app_first_request.py [--no-warm-up]

Loads the page's model and layers as `make run` does, then answers four generated ShapesVQA questions through the
page's own handler and prints each one's wall time, and the first's over the median of the others.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))   # the app's package sits in the checkout beside the library, not in the installed wheel


def main() -> None:
    from arr_coc_shapes import make_item
    from arr_coc_microscope.handler import ask
    from arr_coc_microscope.server import add_layers, load, parse_args, shipped_before_layer, warm_up

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-warm-up", dest="warm", action="store_false")
    args = p.parse_args()
    t0 = time.perf_counter()
    scope = load(None, device="cpu")
    add_layers(scope, shipped_before_layer(scope, parse_args([])))
    print(f"load {time.perf_counter() - t0:.1f} s")
    if args.warm:
        print(f"warm-up {warm_up(scope):.2f} s")
    walls = []
    for i in range(1, 5):
        image, record, _ = make_item(1, "test", i)
        t0 = time.perf_counter()
        result = ask(scope, image, record["question"])
        walls.append(time.perf_counter() - t0)
        print(f"request {i}: {walls[-1] * 1e3:.0f} ms {result.error or ''}")
    rest = sorted(walls[1:])[1]
    print(json.dumps({"warm_up": args.warm, "first_ms": walls[0] * 1e3, "next_median_ms": rest * 1e3,
                      "first_over_next": walls[0] / rest}))


if __name__ == "__main__":
    main()
