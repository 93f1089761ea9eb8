"""One look: the unpruned prompt -> (a gist) -> the selector's choice -> the tower on it -> the rewrite -> traces.

    prompt   backend.read_prompt: units, grids; encode="after": the tower on every cell
    gist     encode="before" with a gist: the tower on a downscaled copy (`fovea.gist_or_zeros`)
    choose   the selector on the whole batch (`choose.run_selector`), budgets resolved per unit (`Pruning`)
    adapter  per row, whether a backend's adapter runs: only where tokens were pruned (`adapter_rows`)
    encode   encode="before": the tower on the chosen cells (+ context) only (`fovea.foveate`), the adapter on for
             the rows it runs for
    rewrite  backend.rewrite: the kept tokens at their unpruned positions
    trace    one `Trace` per row (`trace.item_traces`)

Nothing here knows a model family; every model-specific step is a call of the backend. A look is the whole of
encode="after" and of a one-look encode="before"; `looks.py` builds further looks on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..budget import Budget, BudgetMode
from ..cancel import checkpoint
from ..encode import EncodeConfig
from ..stopwatch import Stopwatch
from .backend import PrunedPrompt, VLMBackend
from ..buckets import fill, relevance_of
from .choose import Choice, context, run_selector, validate_kept
from .fovea import Foveated, Gist, foveate, gist_or_zeros
from .prompt import Prompt
from .request import Pruning
from .selection import Selector, reads_tower_attention
from .tokens import VisualRows
from .trace import Trace, item_traces

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer


@dataclass
class Prepared:
    """One look's result: the pruned prompt and traces, and what a further look builds on."""

    pruned: PrunedPrompt
    traces: list[Trace]
    batch: Prompt
    choice: Choice
    fovea: Foveated | None               # encode="before": the encoded cells and their tokens
    gist: Gist | None
    encoding: EncodeConfig
    budgets: list[Budget | None]
    budget_mode: BudgetMode | None = None
    selector: Selector | None = None      # what chose (None: given cells or every cell)


@torch.no_grad()
def prepare(backend: VLMBackend, inputs: Mapping[str, Any], pruning: Pruning, layer: Callable[[], ARRCOCLayer],
            seed: int = 0, clock: Stopwatch | None = None) -> Prepared:
    """One look over the processor's tensors `inputs` (module docstring)."""
    t_start = time.perf_counter()
    clock = (clock or Stopwatch()).start()
    encoding, fn = pruning.encode, pruning.selector
    backend.check_encode(encoding)      # e.g. whole windows on a tower without windows: before any work
    before = encoding.mode == "before"
    prompt = backend.read_prompt(inputs, encode_all=not before, clock=clock, record_attention=reads_tower_attention(fn))
    pruning.check_prompt(prompt)
    budgets, mode = pruning.unit_budgets(prompt, layer), pruning.unit_mode(layer)
    gist, gist_failed, gist_s = None, {}, 0.0
    if before and fn is not None and encoding.gist > 0:
        t0 = time.perf_counter()
        gist, gist_failed = gist_or_zeros(backend, prompt, encoding.gist, pruning.strict)
        gist_s = time.perf_counter() - t0
        prompt.vision_s += gist_s
        clock.lap("gist")
        checkpoint("gist")

    t0 = time.perf_counter()
    choice = _choose(backend, prompt, pruning, layer, gist, budgets, mode, seed, clock)
    for i, why in gist_failed.items():   # no coarse view, no informed choice: this unit keeps every token
        choice.keep_all(i, prompt.n_tokens[i], f"gist failed: {why}")
    choice.kept, choice.fallback, choice.errors = validate_kept(choice.kept, prompt.n_tokens, choice.fallback,
                                                                choice.errors)
    if pruning.buckets is not None and fn is not None:   # fixed shapes: filled with the next most relevant cells
        choice.kept = fill(choice.kept, prompt.grid_hw, pruning.buckets, relevance_of(choice.arr_out, prompt.grid_hw))
    select_s = time.perf_counter() - t0
    clock.lap("select")
    checkpoint("selection")

    visual, lm_cells, fovea = prompt.visual, choice.kept, None
    adapted = adapter_rows(backend, prompt, choice.kept, pruning.adapter)      # known here, before the tower runs on the chosen cells
    if before:
        fovea = foveate(backend, prompt, choice.kept, encoding, gist, clock,
                        None if adapted is None else [adapted[b] for b in prompt.item_of_image])
        visual, lm_cells = fovea.visual, fovea.lm_cells
        prompt.vision_s += clock.seconds["vision"]
        checkpoint("vision")
    elif any(r is not None for r in choice.replaced):   # the selector replaced some tokens (VisionZip)
        visual = VisualRows.every_cell(choice.replacing(prompt.feats), prompt.deep)
    pruned = backend.rewrite(prompt, visual, lm_cells,
                             pruning.buckets.prompt_for if pruning.buckets is not None else None)
    pruned.adapted = adapted                                  # prefill and decode switch the adapter by it
    clock.lap("packing")
    timing = {"vision_s": prompt.vision_s, "gist_s": gist_s, "select_s": select_s,
              "arr_coc_s": select_s + clock.seconds["packing"], "total_s": time.perf_counter() - t_start,
              "stages_s": dict(clock.seconds)}
    traces = item_traces(pruning.method, budgets, mode, prompt, choice, lm_cells, pruned, encoding.mode, fovea, gist,
                         timing)
    for b, tr in enumerate(traces):
        tr.adapter = backend.adapter_name if adapted is not None and adapted[b] else ""
        if pruning.buckets is not None:
            tr.bucket = {"cells": [int(lm_cells[i].numel()) for i in prompt.units_of(b)], "prompt": int(pruned.width)}
    return Prepared(pruned, traces, prompt, choice, fovea, gist, encoding, budgets, mode, fn)


def adapter_rows(backend: VLMBackend, prompt: Prompt, kept: Sequence[torch.Tensor], use: bool = True
                 ) -> list[bool] | None:
    """Per batch row, whether the backend's adapter runs for it: it has one, the request allows it (`use`:
    `Pruning.adapter`), and some unit of the row lost tokens. A row that keeps every token runs the stock model
    (tower and language model), so keep-all stays exact; None without an adapter. The one place this is decided
    (docs/DESIGN.md, "Adapters")."""
    if not backend.adapter_name or not use:
        return None
    return [any(int(kept[i].numel()) < prompt.n_tokens[i] for i in prompt.units_of(b)) for b in range(prompt.rows)]


def _choose(backend: VLMBackend, prompt: Prompt, pruning: Pruning, layer: Callable[[], ARRCOCLayer],
            gist: Gist | None, budgets: list[Budget], mode: BudgetMode | None, seed: int,
            clock: Stopwatch | None) -> Choice:
    """Every unit's kept cells: given, all of them (no selector), or the selector's on the whole batch."""
    n = len(prompt.grid_hw)
    if pruning.kept is not None:
        return Choice.of([torch.as_tensor(k, dtype=torch.long) for k in pruning.kept], n)
    if pruning.selector is None:
        return Choice.of([torch.arange(k) for k in prompt.n_tokens], n)
    tokens = list(prompt.feats) if prompt.feats is not None else gist.on_full_grid if gist is not None else None
    ctx = context(backend, prompt, layer, tokens, budgets, mode, seed, clock)
    return run_selector(pruning.selector, ctx, pruning.method, strict=pruning.strict)


__all__ = ["Prepared", "adapter_rows", "prepare"]
