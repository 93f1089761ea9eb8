"""`arr_coc`, `arr_coc_adaptive` and `arr_coc_trained`: the project's own allocator as methods.

ARR-COC (arr_coc/layer.py, docs/DESIGN.md): texture of the resized image -> three scorers
(information, perspectival, participatory = the question) -> tension balancing -> top-K
relevance, with a grid fallback for low-structure images.

- `arr_coc` runs the wrapper's layer (untrained, default config, unless the wrapper was given
  weights) with the caller's budgets and budget mode, passed through untouched: the layer
  decides what a missing budget or mode means (arr_coc.budget).
- `arr_coc_adaptive` is the same layer with budget_mode="adaptive" for every image.
- `arr_coc_trained` runs a layer loaded from a folder written by `ARRCOCLayer.save_pretrained`
  (config.json + model.safetensors) on the SAME VLM, through a second wrapper that shares the
  model (no copy). It has no default: without weights the evaluation skips it and says so.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from ..budget import BudgetMode
from ..selection import Selection, SelectionContext, Selector, choose_before_encoding, register_selector

if TYPE_CHECKING:
    from ..qwen.wrapper import ARRCOCQwen


# Where the layer runs, whatever the VLM's device and dtype: the CPU, in float32. Its texture array is
# computed from the processor's resized image, which `unpatchify_images` returns on the CPU; its stages
# build their constants there; and its scores must not depend on the VLM's precision (a bfloat16 VLM gets
# the same scorers). What crosses over is small: the question embeddings [L, D] and the visual tokens
# [n, D] of each image. Only kept indices come back, so the VLM's activations keep their own dtype.
LAYER_DEVICE, LAYER_DTYPE = torch.device("cpu"), torch.float32


def _for_layer(t):
    """A tensor on LAYER_DEVICE in LAYER_DTYPE (anything else, e.g. a PIL image, as it is)."""
    return t.detach().to(device=LAYER_DEVICE, dtype=LAYER_DTYPE) if isinstance(t, torch.Tensor) else t


def run_layer(ctx: SelectionContext, budget_mode: BudgetMode | None) -> Selection:
    """The wrapper's ARR-COC layer on every image of the context (on LAYER_DEVICE, in LAYER_DTYPE)."""
    budgets = ctx.budgets if any(b is not None for b in ctx.budgets) else None
    out = ctx.wrapper.arr_coc_layer(
        [_for_layer(im) for im in ctx.images],
        [tuple(g) for g in ctx.grid_hw],
        query_embeds=[_for_layer(q) for q in ctx.query_embeds],
        visual_tokens=[_for_layer(v) for v in ctx.visual_tokens] if ctx.visual_tokens is not None else None,
        budget=budgets,
        budget_mode=budget_mode,
    )
    return Selection(kept=list(out.kept_indices), arr_coc=out, fallback=list(out.fallback), errors=list(out.errors))


@register_selector("arr_coc")
@choose_before_encoding
def select(ctx: SelectionContext) -> Selection:
    return run_layer(ctx, ctx.budget_mode)


@register_selector("arr_coc_adaptive")
@choose_before_encoding
def select_adaptive(ctx: SelectionContext) -> Selection:
    """ARR-COC with the allocator's adaptive budget for every image, whatever the configured mode."""
    return run_layer(ctx, "adaptive")


def trained_selector(wrapper: ARRCOCQwen, weights: str | os.PathLike) -> Selector:
    """A selector running the ARR-COC layer saved in `weights` on `wrapper`'s VLM."""
    from ..qwen.wrapper import ARRCOCQwen

    folder = os.fspath(weights)
    if not os.path.isfile(os.path.join(folder, "config.json")) or \
            not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise FileNotFoundError(
            f"{folder} holds no trained ARR-COC layer (config.json + model.safetensors); pass the folder that "
            "ARRCOCLayer.save_pretrained wrote, or leave arr_coc_trained out")
    trained = ARRCOCQwen(wrapper.model, wrapper.processor, arr_coc=folder, seed=wrapper.seed)
    trained.arr_coc_layer  # load now, so a bad folder fails before the evaluation starts

    def select_trained(ctx: SelectionContext) -> Selection:
        return select(dataclasses.replace(ctx, wrapper=trained))

    select_trained.__name__ = "arr_coc_trained"
    return choose_before_encoding(select_trained)


__all__ = ["run_layer", "select", "select_adaptive", "trained_selector"]
