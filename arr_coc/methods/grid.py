"""`grid`: keep K visual tokens spread uniformly over the merged-token grid.

The spatially uniform subsample: a sub-grid of cell centres with the image's aspect
ratio, thinned to exactly K (`arr_coc.attending.grid_indices`). It is what a
query-blind allocator does when it knows only geometry, and the fill rule of `oracle`.
The selector lives in `arr_coc.model` (registered there as "grid").
"""

from __future__ import annotations

from ..attending import grid_indices
from ..model import SELECTORS

select = SELECTORS["grid"]

__all__ = ["grid_indices", "select"]
