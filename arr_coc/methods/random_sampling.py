"""`random`: keep K visual tokens drawn uniformly at random, without replacement.

The floor every allocator has to beat, and the blind baseline in every token-pruning
paper (e.g. FastV, Chen et al. 2024, and DivPrune, Alvar et al. 2025, report it). On
ShapesVQA it almost never keeps every token of the queried object (docs/RESULTS.md).

The draw is seeded per image by (seed, image pixels) (`SelectionContext.generator`), so
an image draws the same tokens alone or in a batch.
"""

from __future__ import annotations

import torch

from ..pipeline.selection import Selection, SelectionContext, register_selector


def random_indices(n: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k of n raster indices uniformly without replacement, ascending."""
    return torch.randperm(n, generator=generator)[: max(1, min(k, n))].sort().values


@register_selector("random")
def select(ctx: SelectionContext) -> Selection:
    """One draw per image from its own generator, ascending."""
    return Selection(kept=[random_indices(h * w, k, ctx.generator(i))
                           for i, ((h, w), k) in enumerate(zip(ctx.grid_hw, ctx.counts))])


__all__ = ["random_indices", "select"]
