"""`oracle`: keep the tokens under the answer's boxes first, then fill the budget by grid.

The ceiling of any allocator on data that says where the answer is (ShapesVQA's JSONL
`boxes`, docs/SHAPESVQA.md): with the right tokens kept, whatever accuracy is lost comes from
the budget itself, not from choosing badly. Not a published method; it is drawn on
every plot as the upper reference.

Order of preference inside the budget K:
1. the centre cell of every box (so each counted instance keeps a token even when K is
   smaller than the objects' cells);
2. the other box cells, nearest to their box centre first;
3. cells spread by `grid_indices` over the rest of the image (the question may still
   need context, e.g. "Is there a red star?" when there is none: boxes are []).

Boxes are in the ORIGINAL image's pixels; they are scaled to the processor's resized
image and mapped to merged-token cells with `arr_coc.geometry.box_cells`. The boxes
reach the selector through a closure (`make_selector(boxes, image_sizes)`), one entry
per batch row; rows with several images are filled by grid only (boxes do not say
which image they belong to).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.attending import grid_indices
from ..geometry import Box, box_cells
from ..pipeline.selection import Selection, SelectionContext, choose_before_encoding
from ._common import check_count


def oracle_indices(cells: Sequence[Sequence[int]], h: int, w: int, k: int) -> torch.Tensor:
    """Box cells first (box centres, then the rest nearest-centre first), then grid: LongTensor[k] ascending.

    cells: per box, its raster indices ordered centre-outwards (see `arr_coc.geometry.box_cells`).
    """
    n = h * w
    k = check_count(k, n)
    chosen: list[int] = []
    seen: set[int] = set()

    def add(i: int) -> None:
        if len(chosen) < k and i not in seen:
            seen.add(i)
            chosen.append(i)

    for box in cells:                                                    # 1. one centre per box
        if box:
            add(box[0])
    for box in cells:                                                    # 2. the rest of the boxes
        for i in box[1:]:
            add(i)
    rest = k - len(chosen)                                               # 3. grid over the rest
    if rest > 0:
        m = rest
        while True:  # densify the grid until it offers enough cells outside the boxes
            sites = [int(i) for i in grid_indices(h, w, m) if int(i) not in seen]
            if len(sites) >= rest or m >= n:
                break
            m = min(n, m + rest - len(sites))
        if len(sites) > rest:  # thin evenly (a step >= 1 keeps the rounded picks distinct)
            sites = [sites[j] for j in torch.linspace(0, len(sites) - 1, rest).round().long().tolist()]
        for i in sites:
            add(i)
    for i in range(n):                                                   # safety net: exactly k
        if len(chosen) >= k:
            break
        add(i)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def make_selector(boxes: Sequence[Sequence[Box] | None], image_sizes: Sequence[tuple[int, int] | None] | None = None):
    """An oracle selector for one batch: boxes[b] and image_sizes[b] = (W, H) of row b's original image."""
    boxes = [list(b or []) for b in boxes]
    sizes = list(image_sizes) if image_sizes is not None else [None] * len(boxes)
    if len(sizes) != len(boxes):
        raise ValueError(f"got {len(boxes)} box lists but {len(sizes)} image sizes; pass one of each per batch row")

    def select(ctx: SelectionContext) -> Selection:
        kept = []
        per_row = {b: ctx.item_of_image.count(b) for b in set(ctx.item_of_image)}
        for i, ((h, w), k) in enumerate(zip(ctx.grid_hw, ctx.counts)):
            row = ctx.item_of_image[i]
            if row >= len(boxes):
                raise ValueError(f"the oracle got boxes for {len(boxes)} rows but the batch has row {row}; "
                                 "build it with make_selector(boxes) for this batch")
            cells = []
            if per_row[row] == 1 and boxes[row]:
                height, width = ctx.images[i].shape[-2:]
                cells = box_cells(boxes[row], (h, w), (int(width), int(height)), sizes[row])
            kept.append(oracle_indices(cells, h, w, k))
        return Selection(kept=kept)

    select.__name__ = "oracle"
    return choose_before_encoding(select)


__all__ = ["make_selector", "oracle_indices"]
