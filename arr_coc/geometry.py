"""Boxes and the merged-token grid: the one place that maps pixel boxes to grid cells.

A merged visual token covers a `cell_px` x `cell_px` square of the resized image (28 px on
Qwen2-VL / Qwen2.5-VL, 32 px on Qwen3-VL); the grid is ceil(H / cell_px) x ceil(W / cell_px),
raster order. Boxes are (x0, y0, x1, y1) pixels with x1 / y1 exclusive. The ShapesVQA generator,
the training targets, the oracle selector and the evaluation's coverage all use these functions.
numpy only at import: no torch import at module level (`dilate`, the cells around chosen ones, returns a
tensor for the pipeline and the backends and imports torch when called).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

Box = Sequence[float]
Size = tuple[int, int]   # (width, height) in pixels


def grid_shape(image_size: Size, cell_px: int) -> tuple[int, int]:
    """(h, w) cells covering an image of (width, height) pixels; partial edge cells count."""
    if cell_px <= 0:
        raise ValueError(f"cell_px must be positive, got {cell_px}")
    return math.ceil(image_size[1] / cell_px), math.ceil(image_size[0] / cell_px)


def scale_boxes(boxes: Sequence[Box], original_size: Size | None, image_size: Size) -> list[tuple[float, ...]]:
    """Boxes in pixels of the original image (width, height) -> pixels of the resized image
    (None: the boxes are already in the resized image's pixels)."""
    if original_size is None:
        return [tuple(float(v) for v in b) for b in boxes]
    sx, sy = image_size[0] / original_size[0], image_size[1] / original_size[1]
    return [(b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy) for b in boxes]


def boxes_to_cell_shares(boxes: Sequence[Box], image_size: Size, cell_px: int) -> np.ndarray:
    """float32 [h, w]: how much of each box's area falls in each cell, summed over boxes.

    Every box spreads a weight of 1 over the cells it overlaps (less if it reaches past the
    image), so an object's centre cell outweighs its edge cells and every counted instance
    weighs the same whatever its size. Empty boxes are ignored.
    """
    gh, gw = grid_shape(image_size, cell_px)
    shares = np.zeros((gh, gw), dtype=np.float32)
    edges_x, edges_y = np.arange(gw + 1) * cell_px, np.arange(gh + 1) * cell_px
    for x0, y0, x1, y1 in boxes:
        if x1 <= x0 or y1 <= y0:
            continue
        ix = np.clip(np.minimum(x1, edges_x[1:]) - np.maximum(x0, edges_x[:-1]), 0, None)
        iy = np.clip(np.minimum(y1, edges_y[1:]) - np.maximum(y0, edges_y[:-1]), 0, None)
        shares += (np.outer(iy, ix) / ((x1 - x0) * (y1 - y0))).astype(np.float32)
    return shares


def boxes_to_cell_mask(boxes: Sequence[Box], image_size: Size, cell_px: int) -> np.ndarray:
    """bool [h, w]: cells that share area with any box (touching a cell's edge does not count)."""
    return boxes_to_cell_shares(boxes, image_size, cell_px) > 0


def box_cells(boxes: Sequence[Box], grid_hw: tuple[int, int], image_size: Size,
              original_size: Size | None = None) -> list[list[int]]:
    """Per box, the raster indices of the grid cells under it, ordered from the box centre outwards.

    image_size = (W', H') is the resized image the VLM saw and grid_hw = (h, w) its merged grid;
    boxes are in pixels of the original image of original_size = (W, H) (None: already resized).
    A box entirely outside the grid gives no entry.
    """
    h, w = grid_hw
    cell = image_size[1] / h                                   # pixels per merged token (28 / 32)
    out = []
    for x0, y0, x1, y1 in scale_boxes(boxes, original_size, image_size):
        mask = boxes_to_cell_mask([(x0, y0, x1, y1)], image_size, int(round(cell)))[:h, :w]
        ys, xs = mask.nonzero()
        if ys.size == 0:
            continue
        cy, cx = (y0 + y1) / 2 / cell - 0.5, (x0 + x1) / 2 / cell - 0.5
        order = np.argsort((ys - cy) ** 2 + (xs - cx) ** 2, kind="stable")
        out.append([int(ys[o]) * w + int(xs[o]) for o in order])
    return out


def box_cell_set(boxes: Sequence[Box], grid_hw: tuple[int, int], image_size: Size,
                 original_size: Size | None = None) -> set[int]:
    """Raster indices of every grid cell under any box (the union of `box_cells`)."""
    return {c for cells in box_cells(boxes, grid_hw, image_size, original_size) for c in cells}


def centre_cells(boxes: Sequence[Box], grid_hw: tuple[int, int], cell_px: int) -> list[int]:
    """The raster index of the cell holding each box's centre (clamped to the grid)."""
    h, w = grid_hw
    return [min(h - 1, int((y0 + y1) / 2 // cell_px)) * w + min(w - 1, int((x0 + x1) / 2 // cell_px))
            for x0, y0, x1, y1 in boxes]
def dilate(cells: torch.Tensor, grid_hw: tuple[int, int], rings: int) -> torch.Tensor:
    """Raster cells within `rings` cells (Chebyshev distance) of any of `cells`, ascending. Host work (numpy)."""
    import torch

    chosen = np.asarray(cells.cpu().numpy(), dtype=np.int64)
    if rings <= 0:
        return torch.from_numpy(np.sort(chosen))
    h, w = grid_hw
    mask = np.zeros((h + 2 * rings, w + 2 * rings), dtype=bool)
    ys, xs = np.divmod(chosen, w)
    for dy in range(2 * rings + 1):
        for dx in range(2 * rings + 1):
            mask[ys + dy, xs + dx] = True
    return torch.from_numpy(np.flatnonzero(mask[rings: rings + h, rings: rings + w]).astype(np.int64))


