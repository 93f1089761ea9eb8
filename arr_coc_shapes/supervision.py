"""What the embedded model trains on: training items, the vision tower's dense per-cell labels (whole
scenes, tiles, letter tiles), answer and centre cells, and the visual tokens a sequence keeps.
"""

from __future__ import annotations

import numpy as np
import torch

from arr_coc.geometry import box_cells, centre_cells
from .cells import cell_labels
from .items import make_item
from .questions import questions_for_scene
from .vlm_config import VLMTrainConfig
from .vocabulary import CELL_PX, P_LETTER


def training_item(cfg: VLMTrainConfig, index: int, letter_rate: float = P_LETTER):
    """(image, scene, questions) for training item `index`: the planned, balanced question first."""
    rng = np.random.default_rng([cfg.seed, 7, index])
    canvas = "random" if rng.random() < cfg.random_canvas_p else (448, 448)
    image, record, scene = make_item(cfg.seed, "train", index, canvas=canvas, letter_rate=letter_rate)
    first = record["question"]
    extra = [q for q in questions_for_scene(scene, rng, cfg.questions_per_image) if q.text != first]
    questions = [(first, record["answers"][0], record["type"], [tuple(b) for b in record["boxes"]])]
    questions += [(q.text, q.answers[0], q.type, list(q.boxes)) for q in extra[: cfg.questions_per_image - 1]]
    return image, scene, questions


def centre_mask(scene, gh: int, gw: int) -> np.ndarray:
    """float32 [gh, gw]: 1 at the cell holding each object's centre (`arr_coc.geometry.centre_cells`)."""
    out = np.zeros(gh * gw, dtype=np.float32)
    out[centre_cells([o.box for o in scene.objects], (gh, gw), CELL_PX)] = 1.0
    return out.reshape(gh, gw)


def answer_cells(boxes, gh: int, gw: int) -> set[int]:
    """Raster indices of the cells of a gh x gw grid of 28 px cells under any of `boxes` (pixels).

    The cells are `arr_coc.geometry.box_cells`'; they are added box by box in raster order because
    the attention loss sums its targets in this set's iteration order, which depends on the order
    of insertion (so training stays bit-identical to the recipe that made the shipped checkpoint).
    """
    return {c for cells in box_cells(boxes, (gh, gw), (gw * CELL_PX, gh * CELL_PX)) for c in sorted(cells)}


def dense_labels(scene, gh: int, gw: int) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(a[:gh, :gw]).reshape(-1)) for k, a in _label_maps(scene, gh, gw).items()}


def crops_for_vision(image, scene, cells: int, rng: np.random.Generator):
    """Cell-aligned `cells` x `cells` tiles of a scene (random grid offset) and their dense labels.

    The vision tower attends over all patches, so its cost grows with the square of the
    image's patch count; shape and letter recognition are local. Tiling a 448 px scene into
    four 224 px crops costs the tower about a quarter of the full image and reuses the scene
    (generation is ~10 ms of CPU per scene). Whole images come back in the language and
    joint stages.
    """
    gh, gw = image.height // CELL_PX, image.width // CELL_PX
    ch, cw = min(cells, gh), min(cells, gw)
    r_off, c_off = int(rng.integers(0, gh % ch + 1)), int(rng.integers(0, gw % cw + 1))
    maps = _label_maps(scene, gh, gw)
    return [_tile(image, maps, r0, c0, ch, cw)
            for r0 in range(r_off, gh - ch + 1, ch) for c0 in range(c_off, gw - cw + 1, cw)]


def letter_tiles(image, scene, cells: int, rng: np.random.Generator):
    """One `cells` x `cells` tile around each lettered object (random placement), with dense labels.

    Letters are what the tower learns slowest: in whole scenes or 8 x 8 tiles most cells are
    background or unlettered, so each step carries few letter cells. A 4 x 4 tile per lettered
    object costs the tower 1/16 of a 448 px scene and is mostly glyph.
    """
    gh, gw = image.height // CELL_PX, image.width // CELL_PX
    maps = _label_maps(scene, gh, gw)
    out = []
    for o in scene.objects:
        x0, y0, x1, y1 = o.box
        # First / last cell the box touches (x1, y1 exclusive); every tile placement that holds both.
        c_lo, c_hi = max(0, int((x1 - 1) // CELL_PX) - cells + 1), min(gw - cells, int(x0 // CELL_PX))
        r_lo, r_hi = max(0, int((y1 - 1) // CELL_PX) - cells + 1), min(gh - cells, int(y0 // CELL_PX))
        if o.letter and c_lo <= c_hi and r_lo <= r_hi:
            r0, c0 = int(rng.integers(r_lo, r_hi + 1)), int(rng.integers(c_lo, c_hi + 1))
            out.append(_tile(image, maps, r0, c0, cells, cells))
    return out


def _label_maps(scene, gh: int, gw: int) -> dict[str, np.ndarray]:
    lab = cell_labels(scene, CELL_PX, min_cover=0.15)
    return {"color": lab.color, "shape": lab.shape, "letter": lab.letter, "centre": centre_mask(scene, gh, gw)}


def _tile(image, maps: dict[str, np.ndarray], r0: int, c0: int, ch: int, cw: int):
    crop = image.crop((c0 * CELL_PX, r0 * CELL_PX, (c0 + cw) * CELL_PX, (r0 + ch) * CELL_PX))
    return crop, {k: torch.from_numpy(np.ascontiguousarray(a[r0 : r0 + ch, c0 : c0 + cw]).reshape(-1)) for k, a in maps.items()}


def choose_kept(questions, gh: int, gw: int, gen: torch.Generator, cfg: VLMTrainConfig) -> torch.Tensor:
    """All cells, or the questions' answer cells plus a random share of the rest (ascending)."""
    n = gh * gw
    if torch.rand((), generator=gen) < cfg.full_p:
        return torch.arange(n)
    must = set().union(*(answer_cells(q[3], gh, gw) for q in questions))
    share = cfg.keep_min + (1 - cfg.keep_min) * float(torch.rand((), generator=gen))
    rand = torch.rand(n, generator=gen) < share
    keep = rand.clone()
    keep[list(must)] = True
    if not keep.any():
        keep[int(torch.randint(n, (1,), generator=gen))] = True
    return keep.nonzero()[:, 0]
