"""What the layer's pass costs with almost no pixels: its fixed cost (one op after another) against the part that
grows with the picture, and what that leaves of issue 64's "5x faster at 896 px" target.

    OMP_NUM_THREADS=1 python scripts/experiments/pass_floor.py [--sizes 56,112,224,448,896] [--batches 1,8]
        [--rounds 3] [--repeats 9] [--wall] [--out floor.json]

The shipped before-mode layer's pass (`ARRCOCLayer.device_pass`, what `bench --layer` times) on `bench --layer`'s
896 px scenes resized down to each size, seeded question embeddings, budget 10%. A 56 px picture is 2 x 2 cells:
the pass runs nearly all its ops (955 against 1,143 at 896 px; k-means and the label steps stop sooner) on next
to no pixels. This process's CPU clock (--wall: the wall clock, for more than one thread, whose CPU clock adds
every thread's time). The rounds alternate the configurations; each configuration's figure is its lowest median
of --repeats passes over the rounds. The aten ops are counted once per configuration as the pass runs here (the
CPU's own paths). glibc keeps freed buffers (`keep_large_buffers`, as the commands do), so no page faults are
timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from PIL import Image

from arr_coc.core.layer import ARRCOCLayer
from arr_coc.evaluation.opcount import OpCounter
from arr_coc.evaluation.scenes import bench_scene
from arr_coc.runtime import keep_large_buffers

LAYER = "checkpoints/arr-coc-shapes-before"


def inputs(layer: ARRCOCLayer, size: int, batch: int):
    """(LayerBatch, Plan): `batch` bench scenes of 896 px resized to size x size, one cell per 28 px."""
    pictures = [bench_scene(0, i, 896)[0].resize((size, size), Image.BICUBIC) for i in range(batch)]
    width = layer.config.knowing.query_dim
    queries = [torch.randn(16, width, generator=torch.Generator().manual_seed(i)) for i in range(batch)]
    work = layer.batch(pictures, [(size // 28, size // 28)] * batch, queries)
    return work, layer.allocator.plan(work.grid, 0.1)


@torch.no_grad()
def median_ms(layer: ARRCOCLayer, work, plan, repeats: int, timer=time.process_time) -> float:
    times = []
    for _ in range(repeats):
        start = timer()
        layer.device_pass(work, plan)
        times.append(timer() - start)
    return 1e3 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="56,112,224,448,896")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--wall", action="store_true", help="time with the wall clock, not this process's CPU clock")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    keep_large_buffers()
    layer = ARRCOCLayer.from_pretrained(LAYER).eval()
    configs = [(s, b) for b in map(int, args.batches.split(",")) for s in map(int, args.sizes.split(","))]
    prepared = {c: inputs(layer, *c) for c in configs}
    ops = {}
    with torch.no_grad():
        for c, (work, plan) in prepared.items():
            layer.device_pass(work, plan)                                  # warm-up: constants, buffers
            with OpCounter(record_stacks=False) as counter:
                layer.device_pass(work, plan)
            ops[c] = counter.total
    timer = time.perf_counter if args.wall else time.process_time
    best = {c: float("inf") for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            best[c] = min(best[c], median_ms(layer, *prepared[c], args.repeats, timer))
    rows = [{"size": s, "batch": b, "ms": round(best[(s, b)], 2), "ops": ops[(s, b)],
             "share_of_896": round(best[(s, b)] / best[(896, b)], 3) if (896, b) in best else None}
            for s, b in configs]
    clock = "wall" if args.wall else "process CPU time"
    print(f"the pass, {torch.get_num_threads()} thread(s), {clock} clock, lowest of {args.rounds} medians of "
          f"{args.repeats}")
    print("| size | batch | ms per batch | aten ops (here) | of the 896 px pass |")
    print("|---|---|---|---|---|")
    for r in rows:
        share = "" if r["share_of_896"] is None else f"{100 * r['share_of_896']:.0f}%"
        print(f"| {r['size']} px | {r['batch']} | {r['ms']:.2f} | {r['ops']} | {share} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "threads": torch.get_num_threads(), "rounds": args.rounds,
                       "repeats": args.repeats, "clock": clock}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
