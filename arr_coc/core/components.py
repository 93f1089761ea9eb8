"""Connected foreground components and what shape each one has: the texture array's `object` group.

A cell-level channel sees at most a cell (28 px) of an object, so a layer that reads no visual token
(encode="before") sees three cells of a triangle's edge, not a triangle. Here every foreground pixel
learns the shape of the whole object it belongs to: the 4-connected component of the foreground mask,
described by numbers that do not depend on where the object is or how big it is (its silhouette
resampled to its own bounding box, its fill ratio, its aspect), and the texture array then gives every
cell the mean description over its foreground pixels. On the ShapesVQA test split's shapes (mean fill
at the mask's 8 pixels per cell) the descriptions differ plainly: a square fills its box (0.99, every
thumbnail bin full), a circle 0.78 with faint corners, an upright triangle 0.56 with an empty top row
but its middle and a full base row, a diamond 0.55 with four empty corners, a cross 0.56 with a full
middle row and column, a star 0.45.

Everything is batched torch with no loop over objects. It runs over a list of pixels (`_pixels`): on the
CPU the mask's pixels alone (a foreground is often a few percent of them: 3.8% on a bench scene at 896 px), on a
GPU or while compiling every pixel of the batch, so that the shapes are fixed by the batch and nothing is read
back to the host (queued work). Both give the same labels and channels bit for bit (`tests/test_exact_speed.py`):

- labels (`label_components`): every pixel of a component gets the smallest flat index in it. A step
  gives every horizontal run of foreground the smallest label in it, then every vertical run, then
  jumps each label to its own label (a label is the index of a pixel of the same component). A fixed
  STEPS steps run; on the ShapesVQA test split and its hold-out of every canvas size (900 scenes) the
  labels stop changing after 2 or 3 steps (the 4-neighbour spreading this replaced needed up to 25).
  Whether the last step still changed something is returned as a flag, read with the layer's result:
  a mask that needs more steps (a long winding object, a photo's foreground: 7 or 8) is redone to convergence
  then (`ARRCOCLayer`). On the eager CPU, where the flag costs nothing to read, the layer's pass steps on to
  convergence at once instead (`settles_at_once`): the same channels, one pass instead of two.
- descriptions (`object_channels`): the components of each image are numbered in the order of their first
  pixel (at most CAP per image: tables of a size fixed by the batch), described by scatter reductions
  (area, bounding box, a 5 x 5 silhouette histogram), and a cell's value is a [cells, components] table of
  pixel counts times the components' descriptions, divided by its foreground pixels.
"""

from __future__ import annotations

import torch

from .grid import eager_cpu

THUMB = 5  # thumbnail bins per side of an object's bounding box
# Channel names, in order: fill, aspect, size, then the thumbnail row by row.
OBJECT_CHANNELS = ("obj_fill", "obj_aspect", "obj_size") + tuple(f"obj_t{y}{x}" for y in range(THUMB) for x in range(THUMB))
MIN_AREA = 6  # pixels of the mask (PX_PER_CELL to a cell side, about 3.5 image px): smaller components are ignored
PX_PER_CELL = 8  # the mask's resolution: 8 x 8 pixels per cell (a 448 px image: 128 x 128)
STEPS = 4  # label steps run without looking (the test split and its hold-out converge within 3)
CAP = 64  # components numbered per image (ShapesVQA has at most 24 of MIN_AREA pixels or more)


def _run_ids(mask: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, H, W] bool -> long [B * H * W] (row-major): an id shared by the pixels of each maximal run of the
    mask along `dim` (1: vertical, 2: horizontal), unique over the batch; 0 outside the mask."""
    along = mask if dim == 2 else mask.transpose(1, 2)                # runs along the last dim
    before = torch.zeros_like(along)
    before[..., 1:] = along[..., :-1]
    start = along & ~before                                            # the first pixel of each run
    ids = start.reshape(-1).cumsum(0).reshape(along.shape) * along     # contiguous in `along`'s order
    return (ids if dim == 2 else ids.transpose(1, 2)).reshape(-1)


def _spread(label: torch.Tensor, runs: torch.Tensor, big: int) -> torch.Tensor:
    """Every run's pixels get the smallest label in the run. label [B * N] (big outside), runs [B * N]."""
    best = torch.full((label.numel() + 1,), big, dtype=label.dtype, device=label.device)
    best.scatter_reduce_(0, runs, label, "amin")                       # slot 0 (outside) collects big
    return best.index_select(0, runs)


def _pixels(mask: torch.Tensor) -> torch.Tensor:
    """long [P]: the flat batch indices (b * N + y * W + x), ascending, that the components are computed over:
    the mask's pixels alone where `over_mask_pixels`, else every pixel (see the module's docstring)."""
    flat = mask.reshape(-1)
    if over_mask_pixels(flat.device):
        return flat.nonzero()[:, 0]
    return torch.arange(flat.numel(), device=flat.device)


def settles_at_once(device: torch.device) -> bool:
    """Whether the layer's object group steps its labels to convergence in its one pass (`object_channels`'s settle)
    instead of STEPS steps and a redo of the whole pass by the layer when they had not converged (a photo's mask
    often needs 7 or 8): on the CPU, eager, where the flag read after each step costs nothing."""
    return eager_cpu(device)


def over_mask_pixels(device: torch.device) -> bool:
    """Whether the components run over the mask's pixels alone (reading their count back): on the CPU, eager."""
    return eager_cpu(device)


def _positions(pix: torch.Tensor, total: int) -> torch.Tensor | None:
    """Where each flat batch index sits in `pix` (long [total], meaningful at pix's entries); None: pix is them all."""
    if pix.numel() == total:
        return None
    return torch.empty(total, dtype=torch.long, device=pix.device).index_copy_(
        0, pix, torch.arange(pix.numel(), device=pix.device))


def _per_image_any(flag: torch.Tensor, image: torch.Tensor, b: int) -> torch.Tensor:
    """bool [B]: whether any of the pixels of each image (image [P], their image) has flag [P] set."""
    return torch.zeros(b, dtype=torch.long, device=flag.device).index_add_(0, image, flag.long()) > 0


def _labels(mask: torch.Tensor, pix: torch.Tensor, image: torch.Tensor, at: torch.Tensor | None,
            steps: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(label long [P]: for each of pix's pixels in the mask, the smallest flat batch index of its component, B * N
    outside; converged bool [B]; the steps run). image [P]: each pixel's image; at: `_positions(pix)`, given only
    when pix holds the mask's pixels alone (all inside). See `label_components`."""
    b, h, w = mask.shape
    big = b * h * w                                                    # larger than every flat batch index
    inside = mask.reshape(-1).index_select(0, pix)                     # [P]
    label = torch.where(inside, pix, big)
    rows, cols = _run_ids(mask, 2).index_select(0, pix), _run_ids(mask, 1).index_select(0, pix)
    changed = torch.ones(b, dtype=torch.bool, device=mask.device)
    step = 0
    while steps is None or step < steps:
        new = _spread(_spread(label, rows, big), cols, big)
        jump = new.clamp(max=big - 1) if at is None else at.index_select(0, new)
        new = torch.where(inside, torch.minimum(new, new.index_select(0, jump)), big)
        step += 1
        if steps is None or step == steps:   # whether the last step changed anything: the convergence flag
            changed = _per_image_any(new != label, image, b)
        label = new
        if steps is None and not bool(changed.any()):
            break
    return label, ~changed, step


def label_components(mask: torch.Tensor, steps: int | None = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """4-connected components of a boolean mask [B, H, W].

    Returns (labels long [B, H * W]: for a pixel in the mask, the smallest flat index y * W + x of its
    component, -1 outside; converged bool [B]: the last step changed no label). steps None: step until
    nothing changes (reads a flag back after every step: the exact fallback, not the fast path).
    """
    b, h, w = mask.shape
    n = h * w
    pix = _pixels(mask)
    image = pix.div(n, rounding_mode="floor")
    label, converged, _ = _labels(mask, pix, image, _positions(pix, b * n), steps)
    local = torch.where(label < b * n, label - image * n, -1)
    labels = torch.full((b * n,), -1, dtype=torch.long, device=mask.device).index_copy_(0, pix, local)
    return labels.reshape(b, n), converged


def object_channels(mask: torch.Tensor, grid_hw: tuple[int, int], steps: int | None = STEPS,
                    cap: int | None = CAP, *, settle: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each cell's mean, over its foreground pixels, of the description of the component they belong to.

    mask: [B, H, W] bool foreground, H = h * PX_PER_CELL, W = w * PX_PER_CELL (padding: False). Returns
    (float [B, len(OBJECT_CHANNELS), h, w] in [0, 1], zero on cells without foreground; ok [B]: the labels
    converged and the image had at most `cap` components, see below). Components smaller than MIN_AREA
    pixels (specks, slivers) are left out, as if background.
      obj_fill    component area / bounding-box area
      obj_aspect  box width / (box width + box height): 0.5 for a square box
      obj_size    s / (s + PX_PER_CELL) with s the box's longer side in pixels (2 cells: 0.67)
      obj_tYX     the share of bin (Y, X) of the box's THUMB x THUMB split that the component covers

    The components of an image are numbered 0 .. cap - 1 in the order of their first pixel, so every table
    has a size fixed by the batch; an image with more (never on ShapesVQA, which has at most 24) says so in
    `ok`, and steps=None / cap=None (reading sizes back) computes it exactly.

    settle: what the layer ends with, in one go (where reading back costs nothing: `settles_at_once`). The labels
    step until nothing changes, and the tables have `cap` columns where `steps` fixed steps would have converged
    with at most `cap` components in every image, else as many as the most numerous image's: the channels of the
    fixed steps where their `ok` holds, else those of the layer's redo (steps None, cap None), bit for bit; `ok`
    is then all True.
    """
    b, hh, ww = mask.shape
    h, w = grid_hw
    n = hh * ww
    dev = mask.device
    pix = _pixels(mask)                                                 # [P] the pixels computed over
    at = _positions(pix, b * n)
    image = pix.div(n, rounding_mode="floor")                           # [P] each pixel's image
    label, converged, taken = _labels(mask, pix, image, at, None if settle else steps)   # [P] root pixel, b * n outside
    inside = label < b * n
    root = torch.where(inside, label, pix)
    area = torch.zeros(b * n, device=dev).index_add_(0, root, inside.float())
    kept = (label == pix) & (area.index_select(0, pix) >= MIN_AREA)    # [P]: the roots of components that count
    many = torch.zeros(b, dtype=torch.long, device=dev).index_add_(0, image, kept.long())
    if settle:   # the fixed steps' tables where those steps converged (the loop stopped by then), else the redo's
        fixed = steps is not None and cap is not None and taken <= steps and int(many.max()) <= cap
        cap = cap if fixed else None
    if cap is None:
        cap = max(1, int(many.max()))
    earlier = (many.cumsum(0) - many).index_select(0, image)            # kept roots of the images before each pixel's
    rank = kept.long().cumsum(0) - 1 - earlier                          # each kept root's number in its image
    slots = b * cap                                                     # + 1: a dump slot for everything else
    number = torch.where(kept & (rank < cap), rank + image * cap, slots)
    comp = torch.where(inside, number.index_select(0, root if at is None else at.index_select(0, root)), slots)
    local = pix - image * n
    ys, xs = local.div(ww, rounding_mode="floor"), local.remainder(ww)             # [P]
    described = _descriptions(comp, ys, xs, slots + 1, n, hh / h)      # [S, C]
    # Each cell: the pixels of each component in it (a [cells, cap] table) times the components' descriptions.
    cell = ys.div(hh // h, rounding_mode="floor") * w + xs.div(ww // w, rounding_mode="floor") + image * (h * w)
    column = torch.where(comp < slots, comp - image * cap, cap)                     # the dump: column cap
    table = torch.zeros(b * h * w * (cap + 1), device=dev).index_add_(
        0, cell * (cap + 1) + column, torch.ones(pix.numel(), device=dev))
    table = table.reshape(b, h * w, cap + 1)[:, :, :cap]                             # [B, cells, cap]
    total = table @ described[:-1].reshape(b, cap, -1)                              # [B, cells, C]
    out = total / table.sum(-1, keepdim=True).clamp_min(1.0)
    ok = converged & (many <= cap)
    return out.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous(), ok


def _descriptions(comp: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor, slots: int, n: int,
                  px_per_cell: float) -> torch.Tensor:
    """[slots, C] the description of every component slot from its pixels (comp [P] slot per pixel)."""
    ones = torch.ones_like(comp, dtype=torch.float32)
    area = torch.zeros(slots, device=comp.device).index_add_(0, comp, ones)
    box = _boxes(comp, ys, xs, slots, n)                                # [S, 4]: y0, x0, box_h, box_w
    thumb = _thumbnails(comp, ys, xs, box, slots)                       # [S, THUMB^2]
    box_h, box_w = box[:, 2].float(), box[:, 3].float()
    side = torch.maximum(box_h, box_w)
    return torch.cat([(area / (box_h * box_w))[:, None], (box_w / (box_w + box_h))[:, None],
                      (side / (side + px_per_cell))[:, None], thumb], dim=1)


def _boxes(slot: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor, slots: int, n: int) -> torch.Tensor:
    """Bounding box of every slot's pixels: long [slots, 4] (y0, x0, height, width); empty slots read 1 x 1."""
    lo = torch.full((2, slots), n, dtype=torch.long, device=slot.device)
    hi = torch.full((2, slots), -1, dtype=torch.long, device=slot.device)
    where = torch.stack([ys, xs])                                       # [2, B * N]
    lo.scatter_reduce_(1, slot.expand(2, -1), where, "amin")
    hi.scatter_reduce_(1, slot.expand(2, -1), where, "amax")
    size = (hi - lo + 1).clamp_min(1)
    return torch.stack([lo[0], lo[1], size[0], size[1]], dim=1)


def _thumbnails(slot: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor, box: torch.Tensor, slots: int) -> torch.Tensor:
    """Each slot's silhouette resampled to a THUMB x THUMB split of its box: float [slots, THUMB^2], the share of
    each bin's pixels it covers (a bin with no pixel, on a side shorter than THUMB, reads 0)."""
    mine = box.index_select(0, slot)                                    # [B * N, 4] each pixel's component box
    bin_y = ((ys - mine[:, 0]).float() * THUMB / mine[:, 2].float()).long().clamp(max=THUMB - 1)
    bin_x = ((xs - mine[:, 1]).float() * THUMB / mine[:, 3].float()).long().clamp(max=THUMB - 1)
    counts = torch.zeros(slots * THUMB * THUMB, device=slot.device).index_add_(
        0, slot * THUMB * THUMB + bin_y * THUMB + bin_x, torch.ones_like(slot, dtype=torch.float32))
    # Pixels per bin: bin k of a side of L pixels holds the t in [0, L) with floor(t * THUMB / L) = k.
    steps = torch.arange(THUMB + 1, device=slot.device)
    edges = torch.ceil(steps * box[:, 2:].T.float()[..., None] / THUMB)       # [2, slots, THUMB + 1]
    rows, cols = edges.diff(dim=-1)                                            # [slots, THUMB] each
    bin_pixels = (rows[:, :, None] * cols[:, None, :]).reshape(slots, THUMB * THUMB)
    return counts.reshape(slots, THUMB * THUMB) / bin_pixels.clamp_min(1.0)


__all__ = ["CAP", "MIN_AREA", "OBJECT_CHANNELS", "PX_PER_CELL", "STEPS", "label_components", "object_channels",
           "over_mask_pixels"]
