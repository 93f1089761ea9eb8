"""`random`: keep K visual tokens drawn uniformly at random, without replacement.

The floor every allocator has to beat, and the blind baseline in every token-pruning
paper (e.g. FastV, Chen et al. 2024, and DivPrune, Alvar et al. 2025, report it). On
ShapesVQA it almost never keeps every token of the queried object (FINDINGS.md).

The draw is seeded per image by (seed, image pixels) (`SelectionContext.generator`), so
an image draws the same tokens alone or in a batch. The registered selector "random"
lives in `arr_coc.model`; `select` here is the same draw with the indices sorted
ascending, like every method of this package returns them.
"""

from __future__ import annotations

import torch

from ..model import SELECTORS, Selection, SelectionContext


def select(ctx: SelectionContext) -> Selection:
    """`arr_coc.model`'s random draw per image, ascending."""
    drawn = SELECTORS["random"](ctx)
    kept = drawn.kept if isinstance(drawn, Selection) else list(drawn)
    return Selection(kept=[torch.as_tensor(k).sort().values for k in kept])


def random_indices(n: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k of n raster indices uniformly without replacement, ascending. Same draw as `select`."""
    return torch.randperm(n, generator=generator)[: max(1, min(k, n))].sort().values


__all__ = ["random_indices", "select"]
