"""encode="before": a gist of the whole image for the selector, then full resolution where it chose.

1. gist: the VLM's own vision tower on a downscaled copy of the resized image (`EncodeConfig.gist`
   of the tokens: side factor sqrt(gist)); each full-grid cell reads the gist token under its
   centre, so the selector sees one coarse token per full-resolution cell;
2. the selector chooses full-resolution cells exactly as in "after" mode (budgets, modes, fallbacks);
3. `encode_cells` encodes the chosen cells (+ context dropped before the language model: `margin`
   rings, and with `windows` the rest of each Qwen2.5-VL attention window they are in) at their true
   positions;
4. periphery (optional): every gist cell whose footprint holds no chosen cell is passed to the
   language model as its gist token, at the full-grid cell under its centre. That position keeps
   the language model's 2-D layout: a coarse token stands where the middle of its region stands,
   and never on a cell that is also encoded at full resolution.

The result is the tower's tokens and which cell each is (`VisualRows`), as the after-mode encoding is, so
one rewrite builds the prompt in both modes. The cell bookkeeping is host work on the kept indices; the
tower runs once on the batch's chosen patches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from PIL import Image

from .encoding import EncodeConfig, cells_to_encode, encode_packed
from .processing import image_processor_of
from .rewrite import VisualRows
from ..stopwatch import Stopwatch, lap

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Gist:
    """The coarse view of each image: its own grid and its tokens mapped onto the full grid."""

    grid_hw: list[tuple[int, int]]                  # (h_g, w_g) per image
    tokens: list[torch.Tensor]                      # per image [h_g * w_g, D]
    on_full_grid: list[torch.Tensor]                # per image [n_i, D]: the gist token under each cell
    deepstack: list[list[torch.Tensor]] | None      # Qwen3-VL: per image, per layer [h_g * w_g, D]


def gist_grid(grid_hw: tuple[int, int], share: float) -> tuple[int, int]:
    """The gist's merged grid: each side scaled by sqrt(share), at least 2 cells (the processors' minimum)."""
    f = math.sqrt(share)
    return max(2, round(grid_hw[0] * f)), max(2, round(grid_hw[1] * f))


def nearest_cells(full_hw: tuple[int, int], coarse_hw: tuple[int, int]) -> torch.Tensor:
    """LongTensor[h * w]: the coarse cell under each full cell's centre."""
    (h, w), (hg, wg) = full_hw, coarse_hw
    rows = ((torch.arange(h) + 0.5) * hg / h).floor().long().clamp_max(hg - 1)
    cols = ((torch.arange(w) + 0.5) * wg / w).floor().long().clamp_max(wg - 1)
    return (rows[:, None] * wg + cols[None, :]).reshape(-1)


def coarse_centres(full_hw: tuple[int, int], coarse_hw: tuple[int, int]) -> torch.Tensor:
    """LongTensor[h_g * w_g]: the full cell under each coarse cell's centre (inside that coarse cell's footprint)."""
    (h, w), (hg, wg) = full_hw, coarse_hw
    rows = ((torch.arange(hg) + 0.5) * h / hg).floor().long().clamp_max(h - 1)
    cols = ((torch.arange(wg) + 0.5) * w / wg).floor().long().clamp_max(w - 1)
    return (rows[:, None] * w + cols[None, :]).reshape(-1)


@torch.no_grad()
def encode_gist(model: PreTrainedModel, processor: Any, images: Sequence[torch.Tensor],
                grid_hw: Sequence[tuple[int, int]], share: float) -> Gist:
    """The vision tower on each image downscaled to `share` of its tokens. images: [3, H, W] in [0, 1]."""
    ip = image_processor_of(processor)
    unit = int(ip.patch_size) * int(ip.merge_size)
    grids = [gist_grid(g, share) for g in grid_hw]
    small = []
    for im, (hg, wg) in zip(images, grids):
        pixels = (im.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        small.append(Image.fromarray(pixels).resize((wg * unit, hg * unit), Image.BICUBIC))
    out = ip(images=small, return_tensors="pt")
    grid_thw = out["image_grid_thw"]
    merge = int(ip.merge_size)
    got = [(int(h) // merge, int(w) // merge) for _, h, w in grid_thw.tolist()]
    if got != grids:
        raise RuntimeError(f"the image processor resized the gist to {got}, not {grids}; check its min/max pixels")
    enc = model.model.get_image_features(out["pixel_values"].to(model.device), grid_thw.to(model.device),
                                         return_dict=True)
    tokens = list(enc.pooler_output)
    deep = getattr(enc, "deepstack_features", None)
    deep_per_image = [[layer[i] for layer in deep] for i in range(len(tokens))] if deep is not None else None
    mapped = [t[nearest_cells(full, g).to(t.device)] for t, full, g in zip(tokens, grid_hw, grids)]
    return Gist(grid_hw=grids, tokens=tokens, on_full_grid=mapped, deepstack=deep_per_image)


@dataclass
class Foveated:
    """The full-resolution encoding of the chosen cells (+ the periphery's gist tokens), as `VisualRows`."""

    visual: VisualRows
    lm_cells: list[torch.Tensor]                    # per image, what the language model reads (ascending)
    encoded: list[torch.Tensor]                     # per image, cells encoded at full resolution (chosen + context)
    periphery: list[torch.Tensor]                   # per image, cells carrying a gist token


@torch.no_grad()
def foveate(model: PreTrainedModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
            grid_hw: Sequence[tuple[int, int]], chosen: Sequence[torch.Tensor], config: EncodeConfig,
            gist: Gist | None, clock: Stopwatch | None = None) -> Foveated:
    """Encode the chosen cells (+ margin, + whole windows) in one tower pass and, with `config.periphery`,
    add the gist's uncovered regions. grid_thw and chosen on the host; pixel_values on the VLM's device."""
    encoded = cells_to_encode(model, grid_thw, grid_hw, chosen, config)
    lap(clock, "packing")
    tokens, deep = encode_packed(model, pixel_values, grid_thw, [e.numpy() for e in encoded], clock)
    sources, deep_sources = [tokens], None if deep is None else [[layer] for layer in deep]
    n_rows = tokens.shape[0]
    cells, rows, lm_cells, periphery = [], [], [], []
    start = 0
    for i, (c, g) in enumerate(zip(chosen, grid_hw)):
        mine = {int(cell): start + j for j, cell in enumerate(encoded[i].tolist())}
        start += len(encoded[i])
        extra = torch.from_numpy(np.empty(0, dtype=np.int64))
        if config.periphery and gist is not None:
            covered = torch.zeros(gist.grid_hw[i][0] * gist.grid_hw[i][1], dtype=torch.bool)
            covered[nearest_cells(g, gist.grid_hw[i])[c]] = True
            regions = (~covered).nonzero().squeeze(1)             # gist cells with no chosen cell inside
            extra = coarse_centres(g, gist.grid_hw[i])[regions]
            sources.append(gist.tokens[i])                         # a periphery cell reads its gist token
            if deep_sources is not None:
                for layer, per_layer in zip(deep_sources, gist.deepstack[i]):
                    layer.append(per_layer)
            mine.update({int(cell): n_rows + int(r) for cell, r in zip(extra.tolist(), regions.tolist())})
            n_rows += gist.tokens[i].shape[0]
        order = sorted(mine)
        cells.append(np.array(order, dtype=np.int64))
        rows.append(np.array([mine[k] for k in order], dtype=np.int64))
        periphery.append(torch.from_numpy(np.sort(extra.numpy())))
        lm_cells.append(torch.from_numpy(np.union1d(c.cpu().numpy(), extra.numpy()).astype(np.int64)))
    source = sources[0] if len(sources) == 1 else torch.cat([s.to(tokens.dtype) for s in sources])
    deep_source = None if deep_sources is None else \
        [layer[0] if len(layer) == 1 else torch.cat([s.to(layer[0].dtype) for s in layer]) for layer in deep_sources]
    visual = VisualRows(source, deep_source, cells, rows, [h * w for h, w in grid_hw])
    return Foveated(visual=visual, lm_cells=lm_cells, encoded=encoded, periphery=periphery)


def merge_gists(parts: Sequence[Gist | None], grid_hw: Sequence[tuple[int, int]], width: int) -> Gist:
    """One Gist from per-image ones; a missing image (its gist failed) gets a 2 x 2 gist of zeros."""
    grids, tokens, mapped, deep = [], [], [], []
    template = next((p for p in parts if p is not None), None)
    n_layers = len(template.deepstack[0]) if template is not None and template.deepstack else 0
    like = template.tokens[0] if template is not None else torch.zeros(0)   # the VLM's dtype and device
    for p, g in zip(parts, grid_hw):
        if p is None:
            zeros = like.new_zeros(4, width)
            grids.append((2, 2))
            tokens.append(zeros)
            mapped.append(zeros[nearest_cells(g, (2, 2))])
            deep.append([zeros] * n_layers)
        else:
            grids.append(p.grid_hw[0])
            tokens.append(p.tokens[0])
            mapped.append(p.on_full_grid[0])
            deep.append(p.deepstack[0] if p.deepstack else [])
    return Gist(grid_hw=grids, tokens=tokens, on_full_grid=mapped, deepstack=deep if n_layers else None)
