"""`arr_coc`, `arr_coc_adaptive` and `arr_coc_trained`: the project's own allocator as methods.

ARR-COC (arr_coc/core/layer.py, docs/DESIGN.md): texture of the resized image -> three scorers
(information, perspectival, participatory = the question) -> tension balancing -> top-K
relevance, with a grid fallback for low-structure images.

- `arr_coc` runs the wrapper's layer (untrained, default config, unless the wrapper was given
  weights) with the caller's budgets and budget mode, passed through untouched: the layer
  decides what a missing budget or mode means (arr_coc.budget).
- `arr_coc_adaptive` is the same layer with budget_mode="adaptive" for every image.
- `arr_coc_trained` runs a layer loaded from a folder written by `ARRCOCLayer.save_pretrained`
  (config.json + model.safetensors) or a hub id, on the SAME VLM (no copy of the model). It has no
  default: without weights the evaluation skips it and says so.

The layer runs on the VLM's device in float32 over the whole batch at once (`ARRCOCLayer.run`); what it
reads of the VLM comes through the context (`ctx.layer()`, the question embeddings), never a backend's internals.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..core.batch import LayerBatch
from ..budget import BudgetMode, count_of
from ..core.grid import GridBatch, upload
from ..stopwatch import lap
from ..core.layer import build_layer
from ..pipeline.selection import Selection, SelectionContext, Selector, register_selector
from ..core.temporal import cell_colours, spread_clip

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer
    from ..core.output import ARRCOCOutput
    from ..pipeline.backend import VLMBackend


def layer_batch_of(ctx: SelectionContext, layer: ARRCOCLayer) -> LayerBatch:
    """The layer's padded batch from a selection context, on the layer's device (the VLM's: the wrapper puts it
    there), in float32 whatever the VLM's dtype: built from the processor's patches, the batched question
    embeddings and the merger's output with a fixed number of ops, whatever the batch's size. The VLM's own
    tensors are read, never moved or cast in place."""
    device = layer.device
    grid = GridBatch.of_images(ctx.grid_hw, device)
    work = ctx.pixels.work(layer.config.texture.work_px, grid)     # the backend's pictures (`UnitPixels`)
    if work.pixels.device != device:
        work = dataclasses.replace(work, pixels=work.pixels.to(device))
    query, mask = ctx.query.detach().to(device, torch.float32), ctx.query_mask.to(device)
    vis = None
    if ctx.visual_tokens is not None:
        vis = grid.pad_cells(torch.cat([v.detach() for v in ctx.visual_tokens]).to(device, torch.float32))
    return LayerBatch(work, query, mask, vis)


def run_layer(ctx: SelectionContext, budget_mode: BudgetMode | None) -> Selection:
    """The context's ARR-COC layer on every image of the context, in one batched pass on its device; a video's
    temporal groups are scored as pictures, then share one budget over space and time (`spread_over_time`)."""
    layer = ctx.layer()
    budgets = ctx.budgets if any(b is not None for b in ctx.budgets) else None
    batch = layer_batch_of(ctx, layer)
    lap(ctx.clock, "unpatchify")
    out = layer.run(batch, budgets, budget_mode, ctx.clock)
    if ctx.has_video:
        out = spread_over_time(ctx, layer, batch, out)
        lap(ctx.clock, "time")
    return Selection(kept=list(out.kept_indices), arr_coc=out, fallback=list(out.fallback), errors=list(out.errors))


def spread_over_time(ctx: SelectionContext, layer: ARRCOCLayer, batch: LayerBatch, out: ARRCOCOutput) -> ARRCOCOutput:
    """Each clip's kept cells from one budget over its t * h * w cells (`arr_coc.core.temporal`): the groups' relevance
    carried over time, unchanged cells paid once, the question's place in time; one transfer for all clips. A clip
    any of whose groups fell back (non-finite scores) keeps the per-group result."""
    clips, masks, signals = decide_over_time(ctx, layer, batch, out)
    if not clips:
        return out
    flat = torch.cat(masks).cpu().numpy()                              # the one transfer
    at = 0
    kept, budgets, keep_mask = list(out.kept_indices), out.budgets.clone(), out.keep_mask.clone()
    for units in clips:
        h, w = ctx.grid_hw[units[0]]
        for i in units:
            cells = np.flatnonzero(flat[at: at + h * w])
            kept[i], budgets[i] = torch.from_numpy(cells), len(cells)
            keep_mask[i] = False
            keep_mask[i, :h, :w] = torch.from_numpy(flat[at: at + h * w].reshape(h, w))
            at += h * w
    return dataclasses.replace(out, kept_indices=kept, budgets=budgets, keep_mask=keep_mask,
                               temporal=[(units, sig) for units, sig in zip(clips, signals)])


def decide_over_time(ctx: SelectionContext, layer: ARRCOCLayer, batch: LayerBatch, out: ARRCOCOutput
                     ) -> tuple[list[list[int]], list[torch.Tensor], list]:
    """The clips' decisions queued on the layer's device, nothing read back: (each clip's images, its keep mask
    flattened over (t, h, w), its `temporal.ClipSignals`)."""
    config = layer.config.temporal
    clips = [u for u in ctx.clip_units() if all(out.fallback[i] != "keep_all" for i in u)]
    if not clips:
        return [], [], []
    colours = cell_colours(batch.work.pixels, batch.work.px)           # [F, 3, Hm, Wm] (frame = unit)
    masks, signals = [], []
    for units in clips:
        h, w = ctx.grid_hw[units[0]]
        rows = upload(np.asarray(units, dtype=np.int64), colours.device)
        budget = ctx.budgets[units[0]]
        k = count_of(layer.config.attending.budget if budget is None else budget, len(units) * h * w)
        keep, sig = spread_clip(out.relevance.index_select(0, rows)[:, :h, :w],
                                colours.index_select(0, rows)[..., :h, :w],
                                ctx.questions[units[0]] if ctx.questions else None, k, config)
        masks.append(keep.reshape(-1))
        signals.append(sig)
    return clips, masks, signals


@register_selector("arr_coc")
def select(ctx: SelectionContext) -> Selection:
    return run_layer(ctx, ctx.budget_mode)


@register_selector("arr_coc_adaptive")
def select_adaptive(ctx: SelectionContext) -> Selection:
    """ARR-COC with the allocator's adaptive budget for every image, whatever the configured mode."""
    return run_layer(ctx, "adaptive")


def trained_selector(vlm: VLMBackend, weights: str | os.PathLike,
                     prepare: Callable[[ARRCOCLayer], None] | None = None) -> Selector:
    """A selector running the ARR-COC layer saved in `weights` (a folder or a hub id) on the same VLM (`vlm`: a
    backend, or anything with its `text_hidden_size` and `device`); prepare: what the caller does to the layer
    once built (`ARRCOC.compile_layer`: its execution's compiled pass)."""
    layer = build_layer(os.fspath(weights), vlm.text_hidden_size).to(vlm.device)  # a bad folder fails now
    if prepare is not None:
        prepare(layer)

    def select_trained(ctx: SelectionContext) -> Selection:
        return select(dataclasses.replace(ctx, layer=lambda: layer))

    select_trained.__name__ = "arr_coc_trained"
    select_trained.selects_before_encoding = select_trained.handles_video = True  # type: ignore[attr-defined]
    select_trained.runs_layer = True  # type: ignore[attr-defined]
    return select_trained


__all__ = ["layer_batch_of", "run_layer", "select", "select_adaptive", "trained_selector"]
