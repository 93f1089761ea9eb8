"""Cell-level labels of a scene on the merged-token grid (for training / analysing allocators),
and boxes -> cells with ShapesVQA's 28 px cell as the default (the mapping itself is
`arr_coc.geometry`'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from arr_coc import geometry
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


def cell_labels(scene: Scene, cell_px: int = CELL_PX, min_cover: float = 0.0) -> CellLabels:
    """Rasterise the scene to per-cell colour / shape / letter / object ids.

    The grid is ceil(H / cell_px) x ceil(W / cell_px) (partial edge cells are
    padded with background). A cell is labelled with the object covering the
    most of its pixels, provided that object covers more than ``min_cover`` of
    the cell; otherwise it is background (0).
    """
    index = object_index_map(scene)  # [H, W]
    gh, gw = geometry.grid_shape(scene.size, cell_px)
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
    """`arr_coc.geometry.boxes_to_cell_shares` with ShapesVQA's 28 px cell as the default."""
    return geometry.boxes_to_cell_shares(boxes, image_size, cell_px)


def boxes_to_cell_mask(boxes: Sequence[Sequence[float]], image_size: Size, cell_px: int = CELL_PX) -> np.ndarray:
    """`arr_coc.geometry.boxes_to_cell_mask` with ShapesVQA's 28 px cell as the default."""
    return geometry.boxes_to_cell_mask(boxes, image_size, cell_px)
