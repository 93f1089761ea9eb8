"""`python -m arr_coc bench --layer`: the ARR-COC layer's pass alone, stage by stage, with its aten ops.

    OMP_NUM_THREADS=1 python -m arr_coc bench --layer --arr-coc checkpoints/arr-coc-shapes-before \
        --sizes 448,896 --batches 1,8 --repeats 7 --out layer_stages.json --markdown layer_stages.md

The pass is `ARRCOCLayer.device_pass` (what `decide` queues and `--fast` compiles): texture -> knowing ->
balancing -> attending, on ShapesVQA scenes of each size (--sizes) in batches of each size (--batches), with
seeded random question embeddings of the layer's width (the layer alone has no VLM to embed a question; the
budget and the extent head read them, nothing else differs). Its sub-stages, as the layer laps them:

- texture.pixels: the full-resolution maps most groups summarise (luminance, foreground, gradients, blur; one
  buffer, one pooling: `arr_coc.core.pixel_maps`);
- texture.<group>: each channel group of the layer's texture array, in config order (an intermediate that several
  groups share, the luminance, the foreground, the gradients, the k-means, counts for the first that needs it);
  texture: stacking the groups into the array;
- scorers.information / .perspectival / .participatory: the three ways of knowing; scorers.balancing: the balancer;
  scorers: the finiteness checks after them;
- allocator: attending (extent head, budgets, top-k).

Times are medians over --repeats passes after one warm-up pass, ms per batch (on a GPU the device is synchronised
at each lap); --cpu-time times them with this process's CPU clock instead of the wall clock, which other jobs on a
shared machine disturb less (their cache and memory traffic still shows). Aten ops are counted on one more pass by
an `OpCounter` (a `TorchDispatchMode`) as a GPU runs it (`arr_coc.core.grid.as_on_a_gpu`: the CPU's own paths
off): deterministic, the same on any machine and load, and on a GPU one kernel launch each (views aside). The ops
of the pass as it runs here (on the CPU, with the CPU's own paths) are given below the table.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

KNOWING = {"scorers.information": "knowing: information", "scorers.perspectival": "knowing: perspectival",
           "scorers.participatory": "knowing: participatory", "scorers.balancing": "balancing",
           "scorers": "checks (finite scores)", "allocator": "attending (extent, budgets, top-k)"}


def layer_inputs(layer: Any, size: int, batch: int, budget: Any, seed: int = 0) -> tuple[Any, Any]:
    """(LayerBatch, Plan): `batch` bench scenes (`scenes.bench_scene`) of size x size px on the layer's device, one
    cell per 28 px."""
    from .scenes import bench_scene

    images = [bench_scene(seed, i, size)[0] for i in range(batch)]
    width = layer.config.knowing.query_dim
    query = [torch.randn(16, width, generator=torch.Generator().manual_seed(seed * 1000 + i)) for i in range(batch)]
    cells = size // 28
    work = layer.batch(images, [(cells, cells)] * batch, query)
    return work, layer.allocator.plan(work.grid, budget)


def _timed(layer: Any, batch: Any, plan: Any, timer: Callable[[], float]) -> tuple[dict[str, float], float]:
    """One pass: (seconds per sub-stage, seconds in all)."""
    from ..stopwatch import Stopwatch

    clock = Stopwatch(layer.device, sync=True, timer=timer).start()
    t0 = timer()
    layer.device_pass(batch, plan, clock=clock)
    if layer.device.type == "cuda":
        torch.cuda.synchronize(layer.device)
    return dict(clock.seconds), timer() - t0


def _counted(layer: Any, batch: Any, plan: Any) -> dict[str, Any]:
    """Aten ops (and kernels, syncs) per sub-stage of one pass as a GPU runs it, and in all; and the ops of the pass
    as it runs here (on the CPU, its CPU-only paths: `arr_coc.core.grid.eager_cpu`)."""
    from ..core.grid import as_on_a_gpu
    from ..stopwatch import Stopwatch
    from .opcount import OpCounter

    with as_on_a_gpu(), OpCounter(record_stacks=False) as ops:
        clock = Stopwatch(counter=ops).start()
        layer.device_pass(batch, plan, clock=clock)
    with OpCounter(record_stacks=False) as here:
        layer.device_pass(batch, plan)
    return {"ops": dict(clock.ops), "kernels": dict(clock.kernels), "total_ops": ops.total,
            "total_kernels": ops.kernels, "syncs": ops.syncs, "ops_here": here.total, "syncs_here": here.syncs}


@torch.no_grad()
def measure_layer(layer: Any, size: int, batch: int, budget: Any = 0.1, repeats: int = 7, seed: int = 0,
                  timer: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One row: median ms per sub-stage and for the whole pass (on `timer`'s clock), and the pass's aten ops."""
    inputs, plan = layer_inputs(layer, size, batch, budget, seed)
    layer.device_pass(inputs, plan)                                     # warm-up: constants, buffers
    runs = [_timed(layer, inputs, plan, timer) for _ in range(repeats)]
    stages = sorted({s for r, _ in runs for s in r}, key=list(runs[0][0]).index)
    ms = {s: 1e3 * statistics.median(r.get(s, 0.0) for r, _ in runs) for s in stages}
    return {"size": size, "batch": batch, "budget": budget, "ms": ms,
            "pass_ms": 1e3 * statistics.median(t for _, t in runs), **_counted(layer, inputs, plan)}


def layer_stage_bench(layer: Any, sizes=(448, 896), batches=(1, 8), budget: Any = 0.1, repeats: int = 7,
                      seed: int = 0, note: str = "", cpu_time: bool = False) -> dict[str, Any]:
    """Every (size, batch) row; the report dict (`markdown_layer_stages` prints it). cpu_time: this process's CPU
    time (`time.process_time`) instead of the wall clock (CPU only: a GPU's kernels run outside it)."""
    import os
    import platform

    timer = time.process_time if cpu_time else time.perf_counter
    rows = [measure_layer(layer, s, b, budget, repeats, seed, timer) for s in sizes for b in batches]
    return {"note": note, "rows": rows, "repeats": repeats, "device": str(layer.device),
            "clock": "process CPU time" if cpu_time else "wall",
            "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                     "machine": platform.machine()}}


def _label(stage: str) -> str:
    if stage == "texture.pixels":
        return "texture: full-resolution maps"
    if stage.startswith("texture."):
        return f"texture: {stage.split('.', 1)[1]}"
    return "texture: stacking" if stage == "texture" else KNOWING.get(stage, stage)


def markdown_layer_stages(report: dict[str, Any]) -> str:
    """Stages down, (size, batch) across: ms per batch and aten ops of each sub-stage, then the whole pass."""
    rows = report["rows"]
    stages: list[str] = []
    for r in rows:
        stages += [s for s in r["ms"] if s not in stages]
    head = " | ".join(f"{r['size']} px x {r['batch']}: ms | ops" for r in rows)
    lines = [f"bench --layer: {report['note']}; {report['device']}, {report['host']['torch_threads']} torch "
             f"thread(s), medians of {report['repeats']} passes, ms per batch ({report.get('clock', 'wall')} clock); "
             "aten ops per forward as a GPU runs it (`OpCounter`).\n", f"| stage | {head} |",
             "|---|" + "---|---|" * len(rows)]
    for s in stages:
        cells = " | ".join(f"{r['ms'].get(s, 0.0):.2f} | {r['ops'].get(s, 0)}" for r in rows)
        lines.append(f"| {_label(s)} | {cells} |")
    total = " | ".join(f"**{r['pass_ms']:.2f}** | **{r['total_ops']}**" for r in rows)
    lines.append(f"| **the layer's pass** | {total} |")
    here = ", ".join(f"{r['size']} px x {r['batch']}: {r['ops_here']} ops, {r['syncs_here']} syncs" for r in rows
                     if "ops_here" in r)
    if here and report["device"] == "cpu":
        lines.append(f"\nAs the pass runs here (the CPU's own paths: `arr_coc.core.grid.eager_cpu`): {here}.")
    return "\n".join(lines) + "\n"


__all__ = ["layer_inputs", "layer_stage_bench", "markdown_layer_stages", "measure_layer"]
