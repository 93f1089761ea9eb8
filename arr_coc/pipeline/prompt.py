"""The unpruned prompt as the pipeline sees it: visual units, their grids and rows, whatever the backend.

A request's visuals reach the pipeline as **units**: every image is one unit, and every temporal group of a
video is one (a video's tower attends within one temporal group at a time, so a clip of t groups is t
pictures of grid (h, w) made of its own patches; `arr_coc.qwen.prompt` reads them from a Qwen-VL prompt).
Everything after the prompt (selection, the tower on chosen cells, the rewrite, the trace) works per unit;
what ties a video's units together is `clip` and `group`, which a selector that allocates over space and
time (ARR-COC) reads and one that does not ignores.

`Prompt.native` is the backend's own state for the batch (a Qwen backend keeps its host and device tensors,
the unpruned M-RoPE positions and the patch grids there); the pipeline never reads it, only hands it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .tokens import VisualRows

IMAGE, VIDEO = 1, 2   # what a unit is: an image, or a video's temporal group


def clip_members(clips: Sequence[int], groups: Sequence[int]) -> list[list[int]]:
    """Per video (clip id >= 0, in id order), the indices of its temporal groups in group order."""
    out: dict[int, list[int]] = {}
    for i, c in enumerate(clips):
        if c >= 0:
            out.setdefault(c, []).append(i)
    return [sorted(out[c], key=lambda i: groups[i]) for c in sorted(out)]


@dataclass
class Prompt:
    """One batch before selection: per unit (prompt order, row-major) its row, grid and place in a video.

    rows          questions in the batch
    item_of_image per unit: its batch row
    grid_hw       per unit: its merged-cell grid (h, w); n_i = h * w visual tokens
    kind          per unit: IMAGE or VIDEO (a temporal group)
    clip          per unit: -1 for an image, else its video's index in the batch
    group         per unit: its temporal group in that video (0 for an image)
    visual_index  per unit: its image's or video's place among its row's visuals (a video's groups share one)
    visual        after mode: the tower's tokens of every cell (`VisualRows`); None until encoded
    feats / side  per-unit views of `visual` [n_i, D] (and, per layer, of its side features: what the backend's
                  LM reads beside each token, e.g. Qwen3-VL's deepstack; opaque to the pipeline)
    vision_s      seconds the tower took on this prompt so far
    native        the backend's own state (never read by the pipeline)
    """

    rows: int
    item_of_image: list[int]
    grid_hw: list[tuple[int, int]]
    kind: list[int]
    clip: list[int]
    group: list[int]
    visual_index: list[int]
    native: Any
    visual: VisualRows | None = None
    feats: tuple[torch.Tensor, ...] | None = None
    side: list[tuple[torch.Tensor, ...]] | None = None
    vision_s: float = 0.0
    pixels: Any = None        # the units' pictures for the texture (`VLMBackend.pixels`), made on first use

    @property
    def n_tokens(self) -> list[int]:
        return [h * w for h, w in self.grid_hw]

    @property
    def has_video(self) -> bool:
        return VIDEO in self.kind

    @property
    def clips(self) -> list[list[int]]:
        """Per video, its units in group order."""
        return clip_members(self.clip, self.group)

    def units_of(self, row: int) -> list[int]:
        """The units of batch row `row`, in prompt order."""
        return [i for i, r in enumerate(self.item_of_image) if r == row]


__all__ = ["IMAGE", "VIDEO", "Prompt", "clip_members"]
