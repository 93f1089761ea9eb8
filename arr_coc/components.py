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

Everything is batched torch, no loop over objects: labels spread by repeated minimum over the four
neighbours inside the mask, with pointer jumping (a label is the flat index of a pixel of the same
component, so the label's own label is also one), which converges in 14 steps on a 448 px
ShapesVQA scene. Per-component statistics are scatter reductions over the labels.
"""

from __future__ import annotations

import torch

THUMB = 5  # thumbnail bins per side of an object's bounding box
# Channel names, in order: fill, aspect, size, then the thumbnail row by row.
OBJECT_CHANNELS = ("obj_fill", "obj_aspect", "obj_size") + tuple(f"obj_t{y}{x}" for y in range(THUMB) for x in range(THUMB))
MIN_AREA = 6  # pixels of the mask (PX_PER_CELL to a cell side, about 3.5 image px): smaller components are ignored
PX_PER_CELL = 8  # the mask's resolution: 8 x 8 pixels per cell (a 448 px image: 128 x 128)


def label_components(mask: torch.Tensor, max_steps: int = 10_000) -> torch.Tensor:
    """4-connected components of a boolean mask.

    mask: [B, H, W] bool. Returns long [B, H * W]: for a pixel in the mask, the smallest flat index
    (y * W + x) of its component; -1 outside the mask.
    """
    b, h, w = mask.shape
    n = h * w
    big = n  # larger than every index
    index = torch.arange(n, device=mask.device).expand(b, n)
    inside = mask.reshape(b, n)
    label = torch.where(inside, index, torch.full_like(index, big)).reshape(b, h, w)
    right = mask[:, :, :-1] & mask[:, :, 1:]  # [B, H, W-1]: the pixel and its right neighbour are both inside
    down = mask[:, :-1, :] & mask[:, 1:, :]   # [B, H-1, W]
    for _ in range(max_steps):
        new = label.clone()
        new[:, :, :-1] = torch.minimum(new[:, :, :-1], torch.where(right, label[:, :, 1:], big))
        new[:, :, 1:] = torch.minimum(new[:, :, 1:], torch.where(right, label[:, :, :-1], big))
        new[:, :-1, :] = torch.minimum(new[:, :-1, :], torch.where(down, label[:, 1:, :], big))
        new[:, 1:, :] = torch.minimum(new[:, 1:, :], torch.where(down, label[:, :-1, :], big))
        flat = new.reshape(b, n)
        jumped = torch.where(inside, flat.gather(1, flat.clamp(max=n - 1)), flat)  # label of the label
        new = torch.minimum(flat, jumped).reshape(b, h, w)
        if torch.equal(new, label):
            break
        label = new
    return torch.where(inside, label.reshape(b, n), torch.full_like(index, -1))


def object_channels(mask: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
    """Each cell's mean, over its foreground pixels, of the description of the component they belong to.

    mask: [B, H, W] bool foreground, H and W multiples of the grid's (h, w). Returns float
    [B, len(OBJECT_CHANNELS), h, w] in [0, 1]; zero on cells without foreground. Components smaller than
    MIN_AREA pixels (specks, slivers) are left out, as if background.
      obj_fill    component area / bounding-box area
      obj_aspect  box width / (box width + box height): 0.5 for a square box
      obj_size    s / (s + PX_PER_CELL) with s the box's longer side in pixels (2 cells: 0.67)
      obj_tYX     the share of bin (Y, X) of the box's THUMB x THUMB split that the component covers
    """
    b, hh, ww = mask.shape
    h, w = grid_hw
    n = hh * ww
    label = label_components(mask)  # [B, N]
    inside = label >= 0
    slot = (label + torch.arange(b, device=mask.device)[:, None] * n)[inside]  # [P] a component id per pixel
    comps, comp = torch.unique(slot, return_inverse=True)  # comp: [P] in [0, K)
    k = len(comps)
    ys = torch.arange(hh, device=mask.device).repeat_interleave(ww).expand(b, n)[inside]  # [P]
    xs = torch.arange(ww, device=mask.device).repeat(hh).expand(b, n)[inside]
    ones = torch.ones_like(comp, dtype=torch.float32)

    def reduce(values: torch.Tensor, how: str) -> torch.Tensor:  # [P] -> [K]
        start = torch.full((k,), n if how == "amin" else -1, dtype=values.dtype, device=values.device)
        return start.scatter_reduce(0, comp, values, how, include_self=True)

    area = torch.zeros(k, device=mask.device).index_add_(0, comp, ones)  # [K]
    y0, x0 = reduce(ys, "amin"), reduce(xs, "amin")
    box_h, box_w = (reduce(ys, "amax") - y0 + 1).float(), (reduce(xs, "amax") - x0 + 1).float()  # [K]
    bin_y = ((ys - y0[comp]).float() * THUMB / box_h[comp]).long().clamp(max=THUMB - 1)  # [P]
    bin_x = ((xs - x0[comp]).float() * THUMB / box_w[comp]).long().clamp(max=THUMB - 1)
    bins = torch.zeros(k, THUMB * THUMB, device=mask.device).index_put_((comp, bin_y * THUMB + bin_x), ones, accumulate=True)
    # Pixels per bin: bin k of a side of L pixels holds the t in [0, L) with floor(t * THUMB / L) = k.
    edges = torch.ceil(torch.arange(THUMB + 1, device=mask.device) * torch.stack([box_h, box_w])[..., None] / THUMB)
    rows, cols = edges.diff(dim=-1)  # [K, THUMB] each
    bin_pixels = (rows[:, :, None] * cols[:, None, :]).reshape(k, THUMB * THUMB)
    thumb = bins / bin_pixels.clamp_min(1.0)  # [K, THUMB^2]; a bin with no pixel (a side under THUMB) reads 0
    side = torch.maximum(box_h, box_w)
    px_per_cell = hh / h
    described = torch.cat(
        [(area / (box_h * box_w))[:, None], (box_w / (box_w + box_h))[:, None], (side / (side + px_per_cell))[:, None], thumb],
        dim=1,
    )  # [K, C]
    kept = area >= MIN_AREA  # [K]
    # Cells: sum each (cell, component) pair's pixel count times the component's description.
    cell = (torch.arange(b, device=mask.device)[:, None] * (h * w)).expand(b, n)[inside] + (ys * h // hh) * w + xs * w // ww
    pairs, count = torch.unique(cell * k + comp, return_counts=True)
    pair_cell, pair_comp = pairs // k, pairs % k
    weight = count.float() * kept[pair_comp].float()  # [pairs]
    total = torch.zeros(b * h * w, len(OBJECT_CHANNELS), device=mask.device).index_add_(
        0, pair_cell, described[pair_comp] * weight[:, None]
    )
    pixels = torch.zeros(b * h * w, device=mask.device).index_add_(0, pair_cell, weight)
    out = total / pixels.clamp_min(1.0)[:, None]  # [B * h * w, C]
    return out.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous()
