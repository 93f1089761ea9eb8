"""The batch's visuals as a tool counts them, whatever the backend: which picture or clip is where, how many cells.

A tool that reports on a batch (the evaluation's token counts and box coverage, the clip oracle, `downscale`)
reads the processor's layout through these typed objects, never the backend's tensors:
`arr_coc.pipeline.backend.visual_grids` asks a backend with `LaysOutVisuals` (the processor's grids, without
reading the prompt), and reads the prompt itself (`VLMBackend.read_prompt`, no tower) of a core-only backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from .prompt import IMAGE


@dataclass(frozen=True)
class VisualGrid:
    """One picture or clip of a batch as the backend's processor made it.

    row      its batch row
    kind     IMAGE, or VIDEO (a clip)
    groups   its temporal groups (1 for an image; a clip's units are its groups)
    grid_hw  merged cells (h, w) of each group: h * w visual tokens per group
    """

    row: int
    kind: int
    groups: int
    grid_hw: tuple[int, int]

    @property
    def cells(self) -> int:
        """Its visual tokens, every temporal group's."""
        h, w = self.grid_hw
        return self.groups * h * w


@dataclass(frozen=True)
class ImageScale:
    """How the backend's processor turns an image into cells (what resizing an image for a budget needs).

    cell_px    pixels of the processed picture per cell side (28 for Qwen2-VL / 2.5-VL, 32 for Qwen3-VL)
    min_cells  the fewest cells the processor makes of any image (its minimum size)
    """

    cell_px: int
    min_cells: int = 1


def image_cells(grids: list[VisualGrid]) -> list[tuple[int, int]]:
    """The merged grids of the images among `grids`, in order."""
    return [g.grid_hw for g in grids if g.kind == IMAGE]


__all__ = ["ImageScale", "VisualGrid", "image_cells"]
