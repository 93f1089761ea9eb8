"""The processor's patches as pictures: the texture's input, built where the VLM holds its pixels.

A Qwen-VL image processor resizes an image to a multiple of the merged cell (28 px on Qwen2-VL / 2.5-VL,
32 px on Qwen3-VL), normalises it and cuts it into patches, laid out so that merged cell c of an image
owns the `merge**2` consecutive rows starting at `merge**2 * c`, cells in raster order, images one after
the other (`Qwen2VLImageProcessorPil.patchify`). So the texture's input can be read cell by cell from
`pixel_values` without rebuilding any image:

    rows -> [cells, merge, merge, C, T, p, p] -> temporal copy 0 -> [cells, C, merge * p, merge * p]
         -> undo the normalisation -> each cell area-resampled to the texture's px x px
         -> cells placed on the batch's padded grid, frames' edges repeated (`grid.fill_edges`)

A fixed number of ops on the VLM's device for the whole batch. Each cell's area resampling is the same
arithmetic as resampling the whole image (a cell's output pixels read only its own input pixels when the
cell's size is a whole multiple of px's ratio: 28 -> 16 and 32 -> 16 are), so the texture equals the one
computed from the rebuilt image (`unpatchify_images`, still there for what needs a picture on the host): bit for
bit on an accelerator; on the CPU the patches are pooled as one channels-last picture (`_pooled_planes_last`,
2.5 -> 0.15 ms for a 532 x 560 image), whose sums round differently in 5% of the pixels (by at most 6e-8), with
the same kept cells (tests/test_pure_choice.py; docs/RESULTS.md on 7,700 decisions).
"""

from __future__ import annotations

from dataclasses import dataclass
from ..lazy import cached
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..core.grid import GridBatch, constant, fill_edges, on_cpu
from ..core.texture import WorkImages, work_images
from .processing import image_processor_of, unpatchify_images


@dataclass
class PatchImages:
    """A batch's images as the processor left them: pixel_values [P, C * T * p * p] on the VLM's device,
    the patch grid of each image (host), and the processor settings that undo its normalisation."""

    pixel_values: torch.Tensor
    grid_thw: list[tuple[int, int, int]]
    image_processor: Any

    @classmethod
    def of(cls, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence, processor: Any) -> PatchImages:
        thw = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
        return cls(pixel_values, [tuple(int(v) for v in g) for g in thw], image_processor_of(processor))

    @property
    def merge(self) -> int:
        return int(self.image_processor.merge_size)

    @property
    def unit(self) -> int:
        """Pixels per merged cell side."""
        return int(self.image_processor.patch_size) * self.merge

    def grid(self, device: torch.device | None = None) -> GridBatch:
        """The merged-cell grids, (t, h, w) per image."""
        m = self.merge
        return GridBatch(tuple((1, h // m, w // m) for _, h, w in self.grid_thw),
                         self.pixel_values.device if device is None else device)

    @cached
    def images(self) -> list[torch.Tensor]:
        """The resized images on the host, [3, H, W] in [0, 1] each (rebuilt once, when something asks)."""
        return unpatchify_images(self.pixel_values, torch.tensor(self.grid_thw), self.image_processor)

    def subset(self, which: Sequence[int]) -> PatchImages:
        rows = [sum(t * h * w for t, h, w in self.grid_thw[:i]) for i in range(len(self.grid_thw) + 1)]
        pieces = [self.pixel_values[rows[i]:rows[i + 1]] for i in which]
        # one unit's rows are a view of the batch's (torch.cat would copy them: 2.6 ms for a 448 px picture)
        kept = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else self.pixel_values[:0]
        out = PatchImages(kept, [self.grid_thw[i] for i in which], self.image_processor)
        if "images" in self.__dict__:
            out.__dict__["images"] = [self.images[i] for i in which]
        return out

    def work(self, px: int, grid: GridBatch | None = None) -> WorkImages:
        """The images at `px` pixels per cell, padded, on the pixels' device: a fixed number of ops."""
        grid = grid or self.grid()
        if any(t != 1 for t, _, _ in grid.thw):
            raise ValueError("PatchImages.work reads images (one temporal patch each)")
        if self.unit < px:  # cells smaller than the texture's: resample each image whole (bilinear needs neighbours)
            return work_images([im.to(grid.device) for im in self.images], grid, px)
        ip, m = self.image_processor, self.merge
        p, tp = int(ip.patch_size), int(ip.temporal_patch_size)
        c = self.pixel_values.shape[-1] // (tp * p * p)
        patches = self.pixel_values.detach().float().reshape(-1, c, tp, p, p)[:, :, 0]    # [P, C, p, p]: copy t = 0
        q = px // m
        if getattr(ip, "do_normalize", True):
            std = constant(f"std{tuple(ip.image_std)}", lambda: torch.tensor(ip.image_std).view(1, -1, 1, 1), patches)
            mean = constant(f"mean{tuple(ip.image_mean)}", lambda: torch.tensor(ip.image_mean).view(1, -1, 1, 1),
                            patches)
            patches = torch.mul(patches, std).add_(mean)
        else:
            patches = patches.clone()
        if not getattr(ip, "do_rescale", True):
            patches = patches.div_(255.0)       # in place: `patches` is this call's own tensor on every path
        patches = torch.nan_to_num_(patches, nan=0.0, posinf=1.0, neginf=0.0).clamp_(0.0, 1.0)
        _, hm, wm = grid.shape
        b = len(grid)
        if px % m == 0:
            # A cell's px x px output pixels read only their own patch's input pixels when px splits evenly over
            # the merge x merge patches: resample each patch to px / merge (the same windows, the same sums).
            if q != p:                                                              # [P, C, q, q]
                patches = (_pooled_planes_last(patches, q) if pool_planes_last(patches.device)
                           else F.adaptive_avg_pool2d(patches, (q, q)))
            cells = patches.reshape(-1, m * m * c * q * q)                          # [N, (mh, mw, C, q, q)]
            if grid.cell_rows is not None:
                cells = cells.index_select(0, grid.cell_rows)                       # on the padded grid
            pixels = cells.reshape(b, hm, wm, m, m, c, q, q).permute(0, 5, 1, 3, 6, 2, 4, 7)
        else:
            cells = patches.reshape(-1, m, m, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(-1, c, m * p, m * p)
            cells = F.adaptive_avg_pool2d(cells, (px, px))                          # [N, C, px, px]
            if grid.cell_rows is not None:
                cells = cells.index_select(0, grid.cell_rows)
            pixels = cells.reshape(b, hm, wm, c, px, px).permute(0, 3, 1, 4, 2, 5)
        pixels = pixels.reshape(b, c, hm * px, wm * px)                             # [B, C, H * px, W * px]
        return WorkImages(fill_edges(pixels, grid, px), grid, px)


def pool_planes_last(device: torch.device) -> bool:
    """Whether `PatchImages.work` pools the patches as one channels-last picture (`_pooled_planes_last`): on the CPU."""
    return on_cpu(device)


def _pooled_planes_last(patches: torch.Tensor, q: int) -> torch.Tensor:
    """patches [P, C, p, p] -> [P, C, q, q], area-pooled as one picture of P * C planes, channels last (memory
    [p, p, P * C]): the CPU's adaptive average pooling of such a picture runs vectorised over its planes (0.15
    against 2.5 ms for 1,520 patches 14 -> 8 px; the NCHW kernel loops over every output of every plane). Its sums
    may round differently from the NCHW kernel's (within float32 rounding; docs/RESULTS.md, the kept cells). The
    patches move in and out as two 2D transposes (blocked copies), where writing the normalisation into the planes
    and reading the pooled planes back element by element scattered every access."""
    n, c, p, _ = patches.shape
    planes = torch.empty(1, n * c, p, p, dtype=patches.dtype, device=patches.device, memory_format=torch.channels_last)
    planes.permute(0, 2, 3, 1).view(p * p, n * c).copy_(patches.reshape(n * c, p * p).t())
    pooled = F.adaptive_avg_pool2d(planes, (q, q))                        # [1, P * C, q, q], channels last
    return pooled.permute(0, 2, 3, 1).reshape(q * q, n * c).t().contiguous().view(n, c, q, q)


__all__ = ["PatchImages"]
