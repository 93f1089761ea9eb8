"""`LayerBatch`: what the ARR-COC layer reads for one batch, padded, on one device.

Two ways to build one: `layer_batch` from Python lists (images of any type and size, one question
embedding and, optionally, one set of visual tokens per image: a few ops per image, the library's
convenience path and training's); or, in the wrapper, straight from the VLM's own tensors on its device
(`arr_coc.qwen.pixels`: the processor's patches, the batched question embeddings, the merger's output),
where the number of ops does not grow with the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .grid import GridBatch
from .texture import ImageLike, WorkImages, work_images


@dataclass
class LayerBatch:
    """B items on the layer's device, float32.

    work          frames at the texture's working resolution, padded (`texture.WorkImages`)
    query         [B, L, D] question-token embeddings, or None (question-free scoring)
    query_mask    [B, L] bool: the real tokens of each question
    visual_tokens [B, T * H * W, D] the VLM's tokens of each padded cell (raster over (t, h, w), zeros on
                  padding), or None
    """

    work: WorkImages
    query: torch.Tensor | None = None
    query_mask: torch.Tensor | None = None
    visual_tokens: torch.Tensor | None = None

    @property
    def grid(self) -> GridBatch:
        return self.work.grid

    def __len__(self) -> int:
        return len(self.work.grid)

    def item(self, i: int) -> LayerBatch:
        """Item i alone, cropped to its own grid (the layer retries a failing batch item by item)."""
        t, h, w = self.grid.thw[i]
        T, H, W = self.grid.shape
        grid = GridBatch((self.grid.thw[i],), self.grid.device)
        px = self.work.px
        pixels = self.work.pixels[i * T: i * T + t, :, : h * px, : w * px]
        vis = None
        if self.visual_tokens is not None:
            vis = self.visual_tokens[i: i + 1].reshape(1, T, H, W, -1)[:, :t, :h, :w].reshape(1, t * h * w, -1)
        query = mask = None
        if self.query is not None:
            n = int(self.query_mask[i].sum()) if self.query_mask is not None else self.query.shape[1]
            query, mask = self.query[i: i + 1, :n], torch.ones(1, n, dtype=torch.bool, device=self.query.device)
        return LayerBatch(WorkImages(pixels, grid, px), query, mask, vis)

    def with_query_length(self, length: int) -> LayerBatch:
        """The same batch with its question tokens padded to `length` (zeros, masked out): a fixed shape for a
        compiled pass. No question, or one as long already: itself."""
        if self.query is None or self.query.shape[1] >= length:
            return self
        b, n, _ = self.query.shape
        mask = self.query_mask if self.query_mask is not None else torch.ones(b, n, dtype=torch.bool,
                                                                                device=self.query.device)
        return dataclasses.replace(self, query=F.pad(self.query, (0, 0, 0, length - n)),
                                   query_mask=F.pad(mask, (0, length - n)))

    def to(self, device: torch.device | str) -> LayerBatch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        work = WorkImages(self.work.pixels.to(device), dataclasses.replace(self.grid, device=torch.device(device)),
                          self.work.px)
        return LayerBatch(work, move(self.query), move(self.query_mask), move(self.visual_tokens))


def pad_tokens(tokens: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """List of [L_i, D] -> ([B, Lm, D] float32, mask [B, Lm] bool) on `device`."""
    lm = max(t.shape[0] for t in tokens)
    out = torch.stack([F.pad(t.to(device, torch.float32), (0, 0, 0, lm - t.shape[0])) for t in tokens])
    mask = torch.stack([torch.arange(lm, device=device) < t.shape[0] for t in tokens])
    return out, mask


def layer_batch(images: Sequence[ImageLike], grid: GridBatch, px: int,
                query_embeds: Sequence[torch.Tensor] | torch.Tensor | None = None,
                visual_tokens: Sequence[torch.Tensor] | None = None) -> LayerBatch:
    """A `LayerBatch` from per-image lists (see `ARRCOCLayer.forward` for what each holds), on grid.device."""
    device = grid.device
    query = mask = None
    if query_embeds is not None:
        if isinstance(query_embeds, torch.Tensor) and query_embeds.dim() == 3:  # every row fully valid
            query = query_embeds.to(device, torch.float32)
            mask = torch.ones(query.shape[:2], dtype=torch.bool, device=device)
        else:
            query, mask = pad_tokens(list(query_embeds), device)
    vis = None
    if visual_tokens is not None:
        for i, (v, n) in enumerate(zip(visual_tokens, grid.cells)):
            if v.shape[0] != n:
                t, h, w = grid.thw[i]
                raise ValueError(f"image {i}: {v.shape[0]} visual tokens for a {h}x{w} grid" if t == 1 else
                                 f"item {i}: {v.shape[0]} visual tokens for a {t}x{h}x{w} grid")
        vis = grid.pad_cells(torch.cat([v.detach().to(device, torch.float32) for v in visual_tokens]))
    return LayerBatch(work_images(images, grid, px), query, mask, vis)


__all__ = ["LayerBatch", "layer_batch", "pad_tokens"]
