"""The shipped before-mode layer's device pass, eager against compiled (inductor), on one thread (docs/GPU.md 8.1).

    OMP_NUM_THREADS=1 python scripts/experiments/fast_layer.py [--size 896] [--batches 1,8] [--out fast_layer.json]

ShapesVQA scenes resized to --size, decide + read per image, medians of 7 runs side by side (alternating order);
whether both keep the same cells; the compile time of each shape; and the kernels the compiled pass launches per
forward (the calls in inductor's generated code) against the eager pass's aten ops (`OpCounter`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)



def kernels_of_compiled(layer, batch, plan) -> dict[str, int]:
    """Fused loops and library calls in the code inductor generates for one forward."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    know = getattr(layer.participatory, "know_weights", None)   # as compile_device_pass does: no read-back inside
    if know is not None:
        know()
    fn = torch.compile(layer._captured_pass, fullgraph=True, dynamic=False)
    _, codes = run_and_get_code(fn, batch, plan)
    call = "\n".join(codes)
    call = call[call.index("def call("):]
    fused = len(re.findall(r"^\s+cpp_fused_\w+\(|^\s+triton_\w+\.run\(", call, re.M))
    library = len(re.findall(r"extern_kernels\.\w+\(|aten\.\w+(?:\.\w+)?\(|torch\.ops\.aten\.\w+", call))
    return {"fused": fused, "library": library}


def main() -> None:
    from arr_coc.buckets import Buckets
    from arr_coc.evaluation.opcount import OpCounter
    from arr_coc.execution import Execution
    from arr_coc.core.layer import ARRCOCLayer
    from arr_coc.paths import default_layer_path
    from arr_coc_shapes import make_item

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=896)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--out", default="fast_layer.json")
    args = p.parse_args()
    folder = default_layer_path("before")
    eager, fast = (ARRCOCLayer.from_pretrained(folder).eval() for _ in range(2))
    fast.compile_device_pass(Execution.fast("cpu", fallback=False).compile, Buckets().question_for)
    cells, d = args.size // 28, eager.config.knowing.query_dim
    out = {}
    for b in (int(x) for x in args.batches.split(",")):
        images = [make_item(11, "test", i)[0].resize((args.size, args.size)) for i in range(b)]
        query = [torch.randn(16, d, generator=torch.Generator().manual_seed(i)) for i in range(b)]
        batch = eager.batch(images, [(cells, cells)] * b, query)
        with torch.no_grad():
            t0 = time.perf_counter()
            got = fast.run(batch, 0.1)
            compile_s = time.perf_counter() - t0
            want = eager.run(batch, 0.1)
            times = {"eager": [], "compiled": []}
            for r in range(7):
                for name, layer in (("eager", eager), ("compiled", fast))[:: 1 if r % 2 else -1]:
                    t0 = time.perf_counter()
                    layer.run(batch, 0.1)
                    times[name].append(time.perf_counter() - t0)
            with OpCounter() as ops:
                eager.decide(batch, 0.1)
            kernels = kernels_of_compiled(eager, batch, eager.allocator.plan(batch.grid, 0.1))
        ms = {k: statistics.median(v) * 1e3 / b for k, v in times.items()}
        out[b] = {"ms_per_image": ms, "compiled_over_eager": ms["compiled"] / ms["eager"],
                  "same_kept": all(torch.equal(x, y) for x, y in zip(got.kept_indices, want.kept_indices)),
                  "compile_s": compile_s, "eager_ops": ops.total, "eager_kernels": ops.kernels,
                  "compiled_calls": kernels}
        print(b, json.dumps(out[b]), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
