"""`ARRCOCOutput`: everything the layer decided for a batch and why.

The decisions (kept indices, budgets, fallbacks, errors, the keep mask) are on the host: they are the one
thing read back from the device. The maps (relevance, the three scorers, the texture) stay where the layer
ran, until someone draws or saves them (`cpu()`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

MAP_FIELDS = ("relevance", "valid", "information", "perspectival", "participatory", "texture")


@dataclass
class ARRCOCOutput:
    """Everything the layer decided and why, for B images.

    Grids are padded to the batch's largest (Hm, Wm); image i is valid in its top-left
    h_i x w_i (`valid`). Kept indices are raster indices into image i's own grid.
    """

    kept_indices: list[torch.Tensor]  # per image LongTensor[K_i], ascending (host)
    budgets: torch.Tensor  # LongTensor[B]: K_i (host)
    keep_mask: torch.Tensor  # BoolTensor[B, Hm, Wm] (host)
    relevance: torch.Tensor  # [B, Hm, Wm] in [0, 1] (the layer's device)
    grid_hw: list[tuple[int, int]]
    valid: torch.Tensor  # BoolTensor[B, Hm, Wm]
    fallback: list[str | None]  # None | "grid" (low-structure image) | "keep_all" (a stage failed)
    errors: list[str | None]
    information: torch.Tensor | None = None  # [B, Hm, Wm]
    perspectival: torch.Tensor | None = None  # [B, Hm, Wm]
    participatory: torch.Tensor | None = None  # [B, Hm, Wm]
    weights: torch.Tensor | None = None  # [B, 3]: information, perspectival, participatory
    texture: torch.Tensor | None = None  # [B, C, Hm, Wm] in [0, 1]
    channel_names: list[str] | None = None
    extent: torch.Tensor | None = None  # [B]: the cells each question needs, by the layer's ExtentHead (if it has one)
    temporal: list | None = None  # per video clip: (its images = temporal groups, `temporal.ClipSignals`)

    def __len__(self) -> int:
        return len(self.kept_indices)

    @property
    def positions(self) -> list[torch.Tensor]:
        """Per image LongTensor[K_i, 3]: the kept tokens' (t, h, w) grid positions (t = 0 for an image)."""
        return [torch.stack([torch.zeros_like(k), k // w, k % w], dim=1) for k, (_, w) in zip(self.kept_indices, self.grid_hw)]

    @property
    def kept_relevance(self) -> list[torch.Tensor]:
        """Per image Tensor[K_i]: the relevance of each kept token (read from the device when asked)."""
        rel = self.relevance.detach().cpu()
        return [rel[i, :h, :w].reshape(-1)[k] for i, (k, (h, w)) in enumerate(zip(self.kept_indices, self.grid_hw))]

    def cpu(self) -> ARRCOCOutput:
        """The same output with every map on the CPU (what drawing and saving read)."""
        moved = {f: getattr(self, f).cpu() for f in MAP_FIELDS + ("weights", "extent") if getattr(self, f) is not None}
        return dataclasses.replace(self, **moved)

    def item(self, i: int) -> ARRCOCOutput:
        """Image i alone (grids cropped to its own h x w)."""
        h, w = self.grid_hw[i]

        def crop(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[i : i + 1, ..., :h, :w]

        return ARRCOCOutput(
            kept_indices=[self.kept_indices[i]], budgets=self.budgets[i : i + 1], keep_mask=crop(self.keep_mask),
            relevance=crop(self.relevance), grid_hw=[self.grid_hw[i]], valid=crop(self.valid),
            fallback=[self.fallback[i]], errors=[self.errors[i]], information=crop(self.information),
            perspectival=crop(self.perspectival), participatory=crop(self.participatory),
            weights=None if self.weights is None else self.weights[i : i + 1], texture=crop(self.texture),
            channel_names=self.channel_names, extent=None if self.extent is None else self.extent[i : i + 1],
        )

    @classmethod
    def merge(cls, outs: Sequence[ARRCOCOutput]) -> ARRCOCOutput:
        """Concatenate single-image outputs into one padded batch output (maps on the first one's device)."""
        grid_hw = [o.grid_hw[0] for o in outs]
        hm, wm = max(h for h, _ in grid_hw), max(w for _, w in grid_hw)
        device = outs[0].relevance.device

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(o, name) for o in outs]
            if any(p is None for p in parts):
                return None
            return pad_grid([p[0].to(device) for p in parts], hm, wm)

        def rows(name: str) -> torch.Tensor | None:
            parts = [getattr(o, name) for o in outs]
            return None if any(p is None for p in parts) else torch.cat([p.to(device) for p in parts])

        return cls(
            kept_indices=[o.kept_indices[0] for o in outs], budgets=torch.cat([o.budgets for o in outs]),
            keep_mask=pad_grid([o.keep_mask[0] for o in outs], hm, wm), relevance=cat("relevance"), grid_hw=grid_hw,
            valid=cat("valid"), fallback=[o.fallback[0] for o in outs], errors=[o.errors[0] for o in outs],
            information=cat("information"), perspectival=cat("perspectival"), participatory=cat("participatory"),
            weights=rows("weights"), texture=cat("texture"), channel_names=outs[0].channel_names, extent=rows("extent"),
        )


def pad_grid(maps: Sequence[torch.Tensor], hm: int, wm: int) -> torch.Tensor:
    """List of [..., h_i, w_i] -> [B, ..., Hm, Wm], zero padded at the bottom/right."""
    return torch.stack([F.pad(m, (0, wm - m.shape[-1], 0, hm - m.shape[-2])) for m in maps])


__all__ = ["ARRCOCOutput", "pad_grid"]
