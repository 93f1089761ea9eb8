"""The Qwen backend's `LaysOutVisuals`: a batch's pictures and clips read from the processor's tensors (grids, pads),
and how Qwen's image processor scales an image to cells. Only this backend reads Qwen's tensor keys for it."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..pipeline.layout import ImageScale, VisualGrid
from ..pipeline.prompt import IMAGE
from .prompt import PromptTokens, visual_units


def visual_grids(inputs: Mapping[str, Any], tokens: PromptTokens, merge: int) -> list[VisualGrid]:
    """Per picture or clip of the batch, in prompt order (`build_inputs`' tensors; host or device)."""
    ids = inputs["input_ids"].cpu()
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.cpu()
    mm = inputs.get("mm_token_type_ids")
    mm = (ids == tokens.image).long() + 2 * (ids == tokens.video).long() if mm is None else mm.cpu()
    grids = {k: None if inputs.get(k) is None else inputs[k].cpu() for k in ("image_grid_thw", "video_grid_thw")}
    units = visual_units(mm, mask, grids["image_grid_thw"], grids["video_grid_thw"], merge)
    out: list[VisualGrid] = []
    for i, (row, _, _) in enumerate(units.spans):
        if units.kind[i] != IMAGE and units.group[i] != 0:
            continue                                   # a clip's later temporal group: counted with its first
        _, h, w = (int(v) for v in units.grid_thw[i].tolist())
        groups = 1 if units.kind[i] == IMAGE else units.clip.count(units.clip[i])
        out.append(VisualGrid(row, units.kind[i], groups, (h // merge, w // merge)))
    return out


def image_scale(processor: Any) -> ImageScale:
    """Pixels per merged cell side (patch size x merge size) and the fewest merged cells of any image (the image
    processor's min_pixels)."""
    ip = getattr(processor, "image_processor", processor)
    unit = int(ip.patch_size) * int(ip.merge_size)
    size = getattr(ip, "size", None)
    lo = getattr(size, "shortest_edge", None) if size is not None and not isinstance(size, dict) else \
        (size or {}).get("shortest_edge")
    lo = lo or getattr(ip, "min_pixels", None) or 0
    return ImageScale(unit, max(1, math.ceil(int(lo) / unit ** 2)))


__all__ = ["image_scale", "visual_grids"]
