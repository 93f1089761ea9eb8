"""`python -m arr_coc bench --stages`: ARR-COC's own work stage by stage, beside the tower and the LM prefill.

    python -m arr_coc bench --stages --preset qwen2-vl-2b --device cuda --dtype bfloat16 --out stages.json
    python -m arr_coc bench --stages --model checkpoints/shapes-qwen2vl --arr-coc checkpoints/arr-coc-shapes-before \
        --encode before --out stages_embedded.json

For every image size (ShapesVQA scenes, --sizes, default 448 and 896 px) and batch size (--batches, default 1
and 8), on the chosen device and dtype:

- the reference: every token (method none), the tower on every patch, the LM prefill of the whole prompt;
- ARR-COC at --budget: the pruning path with a `Stopwatch` that synchronises the device after every stage
  (`torch.cuda.synchronize()` on a GPU), so each stage's time is its kernels' time; medians over --repeats.
  Stages: question (one embedding call), unpatchify (the processor's patches -> the texture's working
  resolution), texture, scorers, allocator (extent head + budgets + top-k), read (the one transfer of the
  decision to the host, and turning it into indices), packing (chosen cells -> patch rows, the prompt's
  rewrite, the features' gather); vision (the tower on what it encodes) and gist apart; then the prefill;
- one more pass, not timed, under an `OpCounter` and as a GPU runs it (`arr_coc.core.grid.as_on_a_gpu`): aten
  ops (and of them the kernels: views excluded), host-synchronising ops and uploads per stage. The layer's are
  the stages question to read.

ARR-COC's own work is question + unpatchify + texture + scorers + allocator + read + packing; "per image" divides
a batch's time by its size. The tower and the LM run the preset's layers (the label says how many of how many);
their times are for those layers, not the real depth.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

OWN = ("question", "unpatchify", "texture", "scorers", "allocator", "read", "packing", "saccade")
LAYER = OWN[:-2]   # the layer's forward: what must be sync-free and batched
SHOWN = OWN + ("vision", "gist")


def _inputs(vlm: Any, size: int, batch: int, seed: int) -> dict[str, Any]:
    from .scenes import bench_scene

    scenes = [bench_scene(seed, i, size) for i in range(batch)]
    return vlm.backend.build_inputs([[image] for image, _ in scenes], [question for _, question in scenes])


def _pruning(budget: Any, method: str, encode: Any, budget_mode: Any = None) -> Any:
    from ..pipeline.request import Pruning

    return Pruning.of(method, None if method == "none" else budget, budget_mode, encode)


def _timed_pass(vlm: Any, inputs: dict[str, Any], budget: Any, method: str, encode: Any, sync: bool,
                budget_mode: Any = None) -> tuple[dict[str, float], float, Any]:
    """One request through the pipeline (stages timed, the device synchronised at each), answered with one token:
    -> (stage seconds, the language model's seconds (its prefill; with looks, every look's), the first trace)."""
    from ..stopwatch import Stopwatch

    clock = Stopwatch(vlm.device, sync=sync)
    done = vlm.answer(inputs, _pruning(budget, method, encode, budget_mode), clock=clock, max_new_tokens=1)
    stages = clock.folded()
    return stages, stages.pop("answer", 0.0), done.traces[0]


def _counted_pass(vlm: Any, inputs: dict[str, Any], budget: Any, method: str, encode: Any,
                  budget_mode: Any = None) -> dict[str, dict[str, int]]:
    """Aten ops, synchronising ops and uploads per stage of one request (no timing, no extra synchronisation)."""
    from ..core.grid import as_on_a_gpu
    from ..stopwatch import Stopwatch
    from .opcount import OpCounter

    # Counted as a GPU runs it (the CPU's own paths off: `as_on_a_gpu`); compiled stages run eagerly under it.
    with as_on_a_gpu(), OpCounter(record_stacks=False) as ops:
        clock = Stopwatch(counter=ops).start()
        vlm.answer(inputs, _pruning(budget, method, encode, budget_mode), clock=clock, max_new_tokens=1)
    return {field: clock.folded(field) for field in ("ops", "kernels", "syncs", "uploads")}


def measure(vlm: Any, size: int, batch: int, budget: Any, encode: Any, repeats: int, seed: int = 0,
            budget_mode: Any = None) -> dict[str, Any]:
    """One row: the reference's and ARR-COC's stage times (medians, ms), ARR-COC's op counts per stage."""
    sync = vlm.device.type == "cuda"
    inputs = _inputs(vlm, size, batch, seed)
    settings = {"none": (1.0, "after", None), "arr_coc": (budget, encode, budget_mode)}   # budget, encode, mode
    runs: dict[str, list[dict[str, float]]] = {"none": [], "arr_coc": []}
    trace = None
    for rep in range(repeats + 1):                                  # the first pass warms up (constants, kernels)
        for method, (b, enc, mode) in settings.items():             # side by side: drift hits both alike
            stages, prefill_s, tr = _timed_pass(vlm, inputs, b, method, enc, sync, mode)
            if rep:
                runs[method].append({**stages, "prefill": prefill_s})
                trace = tr if method == "arr_coc" else trace
    counts = _counted_pass(vlm, inputs, budget, "arr_coc", encode, budget_mode)

    def medians(rows: list[dict[str, float]]) -> dict[str, float]:
        keys = sorted({k for r in rows for k in r})
        return {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys}

    ref, own = medians(runs["none"]), medians(runs["arr_coc"])
    own_ms = sum(own.get(s, 0.0) for s in OWN)
    return {
        "size": size, "batch": batch, "budget": budget, "encode": getattr(encode, "mode", encode),
        "cells_per_image": sum(trace.total_per_image) if trace else None,
        "kept_per_image": sum(trace.kept_per_image) if trace else None,
        "reference_ms": ref, "arr_coc_ms": own,
        "own_ms": own_ms, "own_ms_per_image": own_ms / batch,
        "reference_total_ms": ref.get("vision", 0.0) + ref.get("prefill", 0.0),
        "arr_coc_total_ms": own_ms + own.get("vision", 0.0) + own.get("gist", 0.0) + own.get("prefill", 0.0),
        "layer_ops": sum(counts["ops"].get(s, 0) for s in LAYER),
        "layer_kernels": sum(counts["kernels"].get(s, 0) for s in LAYER),
        "layer_syncs": sum(counts["syncs"].get(s, 0) for s in LAYER),
        "layer_uploads": sum(counts["uploads"].get(s, 0) for s in LAYER),
        "counts": counts,
    }


def stage_bench(vlm: Any, sizes=(448, 896), batches=(1, 8), budget: Any = 0.1, encode: Any = "before",
                repeats: int = 3, seed: int = 0, budget_mode: Any = None, note: str = "") -> dict[str, Any]:
    """Every (size, batch) row; the report dict (`markdown_stages` prints it)."""
    import torch

    t0 = time.perf_counter()
    rows = [measure(vlm, s, b, budget, encode, repeats, seed, budget_mode) for s in sizes for b in batches]
    return {"runtime": vlm.runtime.describe(), "execution": vlm.execution.label, "note": note, "rows": rows,
            "repeats": repeats,
            "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                     "machine": platform.machine(), "wall_s": time.perf_counter() - t0,
                     "device_name": torch.cuda.get_device_name(vlm.device) if vlm.device.type == "cuda"
                     else platform.processor() or platform.machine()}}


def markdown_stages(report: dict[str, Any]) -> str:
    """The stage table: ms per batch (and per image), ops and syncs of the layer's forward."""
    fast = report.get("execution") == "fast"
    how = ("fast (fixed-shape buckets, compiled; the layer's stages are one captured graph, timed as 'allocator'; "
           "op counts are the same shapes run eagerly)" if fast else "eager")
    lines = [f"bench --stages: {report['note']}; {report['runtime']} on {report['host']['device_name']}, "
             f"{report['host']['torch_threads']} thread(s); execution {how}; medians of {report['repeats']} runs, "
             "the reference and ARR-COC side by side; ms per batch.\n",
             "| size | batch | " + " | ".join(SHOWN) + " | ARR-COC own | own / image | LM prefill | whole | reference "
             "(tower + prefill) | layer ops (kernels) | syncs | uploads |",
             "|---|---|" + "---|" * (len(SHOWN) + 8)]
    for r in report["rows"]:
        own = r["arr_coc_ms"]
        lines.append(
            f"| {r['size']} | {r['batch']} | " + " | ".join(f"{own.get(s, 0.0):.1f}" for s in SHOWN)
            + f" | **{r['own_ms']:.1f}** | {r['own_ms_per_image']:.1f} | {own.get('prefill', 0.0):.1f} | "
            f"{r['arr_coc_total_ms']:.1f} | {r['reference_total_ms']:.1f} ({r['reference_ms'].get('vision', 0):.1f} + "
            f"{r['reference_ms'].get('prefill', 0):.1f}) | {r['layer_ops']} ({r['layer_kernels']}) | {r['layer_syncs']} | "
            f"{r['layer_uploads']} |")
    return "\n".join(lines) + "\n"


__all__ = ["OWN", "markdown_stages", "measure", "stage_bench"]
