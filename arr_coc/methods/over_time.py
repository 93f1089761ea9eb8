"""Query-blind video anchors: `evs` (drop what did not change) and `uniform_frames` (fewer frames).

Both spend a clip's one budget (K resolved against its t * h * w cells, like ARR-COC's) and keep at least
one cell in every temporal group, as ARR-COC does, so every method keeps each group's place in the prompt.
An image in the same batch is pruned as `grid` would (both methods are about time).

- `evs`, after vLLM's Efficient Video Sampling: the first group is new everywhere; after it, a cell scores by
  how much its token changed since the previous group (1 - cosine of the merger's tokens, as EVS compares
  the encoder's outputs), and the clip keeps its top-K, the first group first (ties by raster order).
  It reads encoded tokens, so it runs after the tower.
- `uniform_frames`: keep whole groups, evenly spaced over the clip (as many as the budget pays for beside one
  centre cell of every other group: floor((K - t) / (h * w - 1)), none when it pays for none), and one centre
  cell of every other group. It never keeps more than the budget (the clip's minimum aside: one cell per group).
  It needs no tokens and runs before the tower too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..budget import count_of
from ..pipeline.selection import Selection, SelectionContext, register_selector
from ..core.temporal import allocate
from .grid import select as grid_select


def _clip_count(ctx: SelectionContext, units: list[int]) -> int:
    h, w = ctx.grid_hw[units[0]]
    return count_of(ctx.budgets[units[0]], len(units) * h * w)


def _images_as_grid(ctx: SelectionContext) -> list[torch.Tensor | None]:
    images = [i for i, c in enumerate(ctx.clips or [-1] * len(ctx)) if c < 0]
    kept: list[torch.Tensor | None] = [None] * len(ctx)
    if images:
        for i, k in zip(images, grid_select(ctx.subset(images)).kept):
            kept[i] = k
    return kept


def token_change(tokens: torch.Tensor) -> torch.Tensor:
    """[t, n, D] -> [t, n]: 1 - cosine similarity with the same cell's token in the previous group (1 in group 0)."""
    x = F.normalize(tokens.float(), dim=-1)
    change = 1.0 - (x[1:] * x[:-1]).sum(-1)
    first = torch.full_like(x[:1, :, 0], 2.0)           # group 0 is new everywhere (a one-group clip: all of it)
    return torch.cat([first, change])


@register_selector("evs")
def select_evs(ctx: SelectionContext) -> Selection:
    if ctx.visual_tokens is None:
        raise ValueError("evs compares the tower's tokens from group to group; run it with encode='after'")
    kept = _images_as_grid(ctx)
    for units in ctx.clip_units():
        h, w = ctx.grid_hw[units[0]]
        score = token_change(torch.stack([ctx.visual_tokens[i] for i in units])).reshape(len(units), h, w)
        keep = allocate(score, _clip_count(ctx, units)).reshape(len(units), -1).cpu().numpy()
        for g, i in enumerate(units):
            kept[i] = torch.from_numpy(np.flatnonzero(keep[g]))
    return Selection(kept=kept)


@register_selector("uniform_frames")
def select_uniform_frames(ctx: SelectionContext) -> Selection:
    kept = _images_as_grid(ctx)
    for units in ctx.clip_units():
        h, w = ctx.grid_hw[units[0]]
        t, k = len(units), _clip_count(ctx, units)
        whole = min(t, (k - t) // max(1, h * w - 1)) if k > t else 0   # the whole groups the budget pays for
        chosen = set(np.unique(np.round(np.linspace(0, t - 1, whole)).astype(int)).tolist()) if whole else set()
        centre = (h // 2) * w + w // 2
        for g, i in enumerate(units):
            kept[i] = torch.arange(h * w) if g in chosen else torch.tensor([centre])
    return Selection(kept=kept)


__all__ = ["select_evs", "select_uniform_frames", "token_change"]
