"""`grid`: keep K visual tokens spread uniformly over the merged-token grid.

The spatially uniform subsample: a sub-grid of cell centres with the image's aspect
ratio, thinned to exactly K (`arr_coc.core.attending.grid_indices`). It is what a
query-blind allocator does when it knows only geometry, and the fill rule of `oracle`.
"""

from __future__ import annotations

from ..core.attending import grid_indices
from ..pipeline.selection import Selection, SelectionContext, register_selector


@register_selector("grid")
def select(ctx: SelectionContext) -> Selection:
    return Selection(kept=[grid_indices(h, w, k) for (h, w), k in zip(ctx.grid_hw, ctx.counts)])


__all__ = ["grid_indices", "select"]
