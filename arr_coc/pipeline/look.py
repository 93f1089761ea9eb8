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
from typing import Any, Mapping, Sequence

import torch

from ..budget import Budget, BudgetMode
from ..cancel import checkpoint
from ..encode import EncodeConfig
from ..stopwatch import Stopwatch
from .backend import (EncodesBefore, FixedShapes, PrunedPrompt, TowerAttention, VLMBackend, adapter_name,
                      require)
from ..buckets import fill, relevance_of
from .choose import Choice, context, every_token_units, keep_every_token, run_selector, validate_kept
from .context import RequestContext
from .fovea import Foveated, Gist, foveate, gist_or_zeros
from .prompt import Prompt
from .selection import Selector, reads_tower_attention
from .tokens import VisualRows
from .trace import Trace, item_traces


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

    @property
    def outputs(self) -> tuple[PrunedPrompt, list[Trace]]:
        """(the pruned prompt, the traces): what a caller that runs the language model itself reads."""
        return self.pruned, self.traces


@torch.no_grad()
def prepare(req: RequestContext, inputs: Mapping[str, Any]) -> Prepared:
    """One look over the processor's tensors `inputs` (module docstring)."""
    t_start = time.perf_counter()
    clock = req.clock.start()
    backend, pruning = req.backend, req.pruning
    encoding, fn = pruning.encode, pruning.selector
    before = encoding.mode == "before"
    if before:   # e.g. whole windows on a tower without windows: before any work
        require(backend, EncodesBefore, "encode before the vision tower (encode='before')").check_encode(encoding)
    prompt = read(backend, inputs, before, reads_tower_attention(fn), clock)
    pruning.check_prompt(prompt)
    budgets, mode = pruning.unit_budgets(prompt, req.layer), pruning.unit_mode(req.layer)
    full = every_token_units(budgets, prompt.grid_hw, prompt.clips)
    if fn is not None and pruning.kept is None and all(full):
        fn = None                          # every token asked for: nothing to choose, the stock model's request
    gist, gist_failed, gist_s = None, {}, 0.0
    if before and fn is not None and encoding.gist > 0:
        t0 = time.perf_counter()
        gist, gist_failed = gist_or_zeros(backend, prompt, encoding.gist, pruning.strict)
        gist_s = time.perf_counter() - t0
        prompt.vision_s += gist_s
        clock.lap("gist")
        checkpoint("gist")

    t0 = time.perf_counter()
    choice = _choose(req, prompt, gist, budgets, mode, fn, full)
    for i, why in gist_failed.items():   # no coarse view, no informed choice: this unit keeps every token
        choice.keep_all(i, prompt.n_tokens[i], f"gist failed: {why}")
    choice.kept, choice.fallback, choice.errors = validate_kept(choice.kept, prompt.n_tokens, choice.fallback,
                                                                choice.errors)
    chosen = [int(k.numel()) for k in choice.kept]       # what the method chose, before any filling
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
        visual = VisualRows.every_cell(choice.replacing(prompt.feats), prompt.side)
    pruned = rewrite(backend, prompt, visual, lm_cells, pruning)
    pruned.adapted = adapted                                  # prefill and decode switch the adapter by it
    clock.lap("packing")
    timing = {"vision_s": prompt.vision_s, "gist_s": gist_s, "select_s": select_s,
              "arr_coc_s": select_s + clock.seconds["packing"], "total_s": time.perf_counter() - t_start,
              "stages_s": clock.folded()}
    traces = item_traces(pruning.method, budgets, mode, prompt, choice, lm_cells, pruned, encoding.mode, fovea, gist,
                         timing)
    for b, tr in enumerate(traces):
        tr.adapter = adapter_name(backend) if adapted is not None and adapted[b] else ""
        if pruning.buckets is not None:
            units = prompt.units_of(b)   # per image: the cells chosen, the cells after filling, the padded prompt
            tr.bucket = {"chosen": [chosen[i] for i in units], "filled": [int(lm_cells[i].numel()) for i in units],
                         "prompt": int(pruned.width)}
    return Prepared(pruned, traces, prompt, choice, fovea, gist, encoding, budgets, mode, fn)


def read(backend: VLMBackend, inputs: Mapping[str, Any], before: bool, record_attention: bool,
         clock: Stopwatch) -> Prompt:
    """The unpruned prompt; after the tower, with the tower's last-block attention kept when the selector reads it
    (VisionZip: `TowerAttention`)."""
    if record_attention and not before:
        need = require(backend, TowerAttention, "give the tower's attention to a selector (VisionZip)")
        return need.read_prompt_recording(inputs, clock)
    return backend.read_prompt(inputs, encode_all=not before, clock=clock)


def rewrite(backend: VLMBackend, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor],
            pruning: Any) -> PrunedPrompt:
    """The backend's rewrite; with buckets, its rows padded to the bucket's length (`FixedShapes`)."""
    if pruning.buckets is None:
        return backend.rewrite(prompt, visual, lm_cells)
    fixed = require(backend, FixedShapes, "run fixed shapes (buckets, --fast)")
    return fixed.rewrite_fixed(prompt, visual, lm_cells, pruning.buckets.prompt_for)


def adapter_rows(backend: VLMBackend, prompt: Prompt, kept: Sequence[torch.Tensor], use: bool = True
                 ) -> list[bool] | None:
    """Per batch row, whether the backend's adapter runs for it: it has one, the request allows it (`use`:
    `Pruning.adapter`), and some unit of the row lost tokens. A row that keeps every token runs the stock model
    (tower and language model), so keep-all stays exact; None without an adapter. The one place this is decided
    (docs/DESIGN.md, "Adapters")."""
    if not adapter_name(backend) or not use:
        return None
    return [any(int(kept[i].numel()) < prompt.n_tokens[i] for i in prompt.units_of(b)) for b in range(prompt.rows)]


def _choose(req: RequestContext, prompt: Prompt, gist: Gist | None, budgets: list[Budget], mode: BudgetMode | None,
            selector: Selector | None, full: Sequence[bool]) -> Choice:
    """Every unit's kept cells: given, all of them (no selector), or the selector's on the whole batch (a unit
    whose budget is every token, `full`, keeps every token: `choose.every_token_units`)."""
    pruning, n = req.pruning, len(prompt.grid_hw)
    if pruning.kept is not None:
        return Choice.of([torch.as_tensor(k, dtype=torch.long) for k in pruning.kept], n)
    if selector is None:
        return Choice.of([torch.arange(k) for k in prompt.n_tokens], n)
    tokens = list(prompt.feats) if prompt.feats is not None else gist.on_full_grid if gist is not None else None
    ctx = context(req, prompt, tokens, budgets, mode)
    choice = run_selector(selector, ctx, pruning.method, strict=pruning.strict)
    return keep_every_token(choice, full, prompt.n_tokens)


__all__ = ["Prepared", "adapter_rows", "prepare"]
