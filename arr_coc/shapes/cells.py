"""Cell-level labels of a scene on the merged-token grid (for training / analysing allocators),
and boxes -> cells with ShapesVQA's 28 px cell as the default (the mapping itself is
`arr_coc.geometry`'s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .drawing import object_index_map
from .scene import Scene
from .vocabulary import CELL_PX, COLOR_NAMES, LETTERS, SHAPES, Size


@dataclass(frozen=True)
class CellLabels:
    """Per-cell ids on a grid of ``cell_px`` cells; each array is int64 [h, w].

    h = ceil(H / cell_px), w = ceil(W / cell_px). A cell takes the labels of the
    object that covers most of its pixels (ties -> lower object index); 0 means
    background. Ids are 1-based positions in COLOR_NAMES / SHAPES / LETTERS and
    ``object`` is the 1-based index into ``scene.objects``.
    """

    color: np.ndarray
    shape: np.ndarray
    letter: np.ndarray
    object: np.ndarray
    coverage: np.ndarray  # float32 [h, w]: winner's pixels / cell pixels


def _grid_hw(size: Size, cell_px: int) -> tuple[int, int]:
    if cell_px <= 0:
        raise ValueError(f"cell_px must be positive, got {cell_px}")
    return math.ceil(size[1] / cell_px), math.ceil(size[0] / cell_px)


def cell_labels(scene: Scene, cell_px: int = CELL_PX, min_cover: float = 0.0) -> CellLabels:
    """Rasterise the scene to per-cell colour / shape / letter / object ids.

    The grid is ceil(H / cell_px) x ceil(W / cell_px) (partial edge cells are
    padded with background). A cell is labelled with the object covering the
    most of its pixels, provided that object covers more than ``min_cover`` of
    the cell; otherwise it is background (0).
    """
    index = object_index_map(scene)  # [H, W]
    gh, gw = _grid_hw(scene.size, cell_px)
    padded = np.zeros((gh * cell_px, gw * cell_px), dtype=np.int64)
    padded[: scene.height, : scene.width] = index
    n = len(scene.objects) + 1  # +1 for background id 0
    # [gh, cell, gw, cell] -> cell id per pixel, then one bincount for all cells.
    cell_id = (np.arange(gh)[:, None, None, None] * gw + np.arange(gw)[None, None, :, None])
    cell_id = np.broadcast_to(cell_id, (gh, cell_px, gw, cell_px))
    flat = (cell_id * n + padded.reshape(gh, cell_px, gw, cell_px)).ravel()
    counts = np.bincount(flat, minlength=gh * gw * n).reshape(gh * gw, n)[:, 1:]  # [cells, objects]
    if counts.shape[1] == 0:
        winner = np.zeros(gh * gw, dtype=np.int64)
        cover = np.zeros(gh * gw, dtype=np.float32)
    else:
        winner = counts.argmax(axis=1)  # ties -> lower object index
        cover = (counts[np.arange(gh * gw), winner] / float(cell_px * cell_px)).astype(np.float32)
    keep = cover > min_cover
    obj_id = np.where(keep, winner + 1, 0)
    # Lookup tables indexed by object id (0 = background).
    color_lut = np.array([0] + [COLOR_NAMES.index(o.color) + 1 for o in scene.objects], dtype=np.int64)
    shape_lut = np.array([0] + [SHAPES.index(o.shape) + 1 for o in scene.objects], dtype=np.int64)
    letter_lut = np.array(
        [0] + [LETTERS.index(o.letter) + 1 if o.letter else 0 for o in scene.objects], dtype=np.int64
    )
    as_grid = lambda a: a.reshape(gh, gw)  # noqa: E731
    return CellLabels(
        color=as_grid(color_lut[obj_id]),
        shape=as_grid(shape_lut[obj_id]),
        letter=as_grid(letter_lut[obj_id]),
        object=as_grid(obj_id),
        coverage=as_grid(np.where(keep, cover, 0).astype(np.float32)),
    )


def boxes_to_cell_shares(boxes: Sequence[Sequence[float]], image_size: Size, cell_px: int = CELL_PX) -> np.ndarray:
    """float32 [h, w]: how much of each box's area falls in each cell (of ``cell_px``), summed over boxes.

    Every box spreads a weight of 1 over the cells it overlaps (less if it reaches past the
    image), so an object's centre cell outweighs its edge cells and every counted instance
    weighs the same whatever its size. ``image_size`` is (width, height); h = ceil(H /
    cell_px), w = ceil(W / cell_px). Boxes are (x0, y0, x1, y1) px with x1/y1 exclusive;
    empty boxes are ignored.
    """
    gh, gw = _grid_hw(image_size, cell_px)
    shares = np.zeros((gh, gw), dtype=np.float32)
    edges_x, edges_y = np.arange(gw + 1) * cell_px, np.arange(gh + 1) * cell_px
    for x0, y0, x1, y1 in boxes:
        if x1 <= x0 or y1 <= y0:
            continue
        ix = np.clip(np.minimum(x1, edges_x[1:]) - np.maximum(x0, edges_x[:-1]), 0, None)
        iy = np.clip(np.minimum(y1, edges_y[1:]) - np.maximum(y0, edges_y[:-1]), 0, None)
        shares += (np.outer(iy, ix) / ((x1 - x0) * (y1 - y0))).astype(np.float32)
    return shares


def boxes_to_cell_mask(boxes: Sequence[Sequence[float]], image_size: Size, cell_px: int = CELL_PX) -> np.ndarray:
    """bool [h, w]: cells (of ``cell_px``) that share area with any box (`boxes_to_cell_shares` > 0).

    Touching a cell's edge does not count.
    """
    return boxes_to_cell_shares(boxes, image_size, cell_px) > 0
