"""The prompt's visual inputs as units: every image, and every temporal group of every video.

A Qwen-VL vision tower attends within one temporal group at a time (its `cu_seqlens` has one segment per
group, and its 2-D positions, Qwen2.5-VL's windows and Qwen3-VL's position table repeat per group), so a
video of grid (t, h, w) is encoded exactly as t pictures of grid (1, h, w) made of the same patch rows
(tests/test_video.py checks it on the three families). The pruning path therefore works on units: an
image is one unit, a video's temporal group is one unit, each a (1, h, w) grid with its own run of pads in
the prompt, and everything downstream (selection, the tower on chosen cells, the rewrite) is the image
path's. What ties a video's units together is `clip` and `group`: a selector that allocates over space and
time (ARR-COC) reads them, one that does not prunes each group as a picture.

Pads: Qwen2-VL and Qwen2.5-VL put one run of t * h * w / merge**2 `<|video_pad|>` per video (raster over
(t, h, w), so group g is the g-th slice of h * w / merge**2); Qwen3-VL one run per group, each after its
timestamp text. Either way each unit owns one contiguous span.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..grid import upload
from ..selection import clip_members

IMAGE, VIDEO = 1, 2   # mm_token_type_ids' values


@dataclass(frozen=True)
class Units:
    """The batch's visual units in prompt order (row-major over the prompt), all on the host.

    kind      per unit: IMAGE or VIDEO (a video's temporal group)
    grid_thw  LongTensor [N, 3] patch grid per unit, t = 1
    spans     per unit (row, start, end): its pads in input_ids
    clip      per unit: -1 for an image, else the video's index in `video_grid_thw`
    group     per unit: its temporal group in the clip (0 for an image)
    rows      patch rows of each unit, in unit order, into cat(pixel_values, pixel_values_videos); None when
              the batch holds images only (then `pixel_values` is already in unit order)
    """

    kind: list[int]
    grid_thw: torch.Tensor
    spans: list[tuple[int, int, int]]
    clip: list[int]
    group: list[int]
    rows: np.ndarray | None

    @property
    def has_video(self) -> bool:
        return VIDEO in self.kind

    @property
    def visual_index(self) -> list[int]:
        """Per unit, its image's or video's place among its row's visuals (a video's groups share one)."""
        out, seen = [], {}
        for (row, _, _), kind, group in zip(self.spans, self.kind, self.group):
            if kind == IMAGE or group == 0:
                seen[row] = seen.get(row, -1) + 1
            out.append(seen[row])
        return out

    @property
    def clips(self) -> list[list[int]]:
        """Per video, its units in group order."""
        return clip_members(self.clip, self.group)


def pad_runs(mm: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Runs of equal non-zero `mm_token_type_ids` per row, row-major: [(row, start, end, kind)]."""
    runs = []
    for b in range(mm.shape[0]):
        kind = np.where(mask[b] != 0, mm[b], 0)
        change = np.flatnonzero(np.diff(np.concatenate([[0], kind, [0]])) != 0)
        for s, e in zip(change[:-1], change[1:]):
            if kind[s] != 0:
                runs.append((b, int(s), int(e), int(kind[s])))
    return runs


def visual_units(mm_token_type_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                 video_grid_thw: torch.Tensor | None, merge: int) -> Units:
    """The units of a batch from its host tensors (mm_token_type_ids, attention_mask [B, S]; grids [N, 3])."""
    images = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    videos = [] if video_grid_thw is None else [tuple(int(v) for v in g) for g in video_grid_thw.tolist()]
    image_rows = np.cumsum([0] + [t * h * w for t, h, w in images])
    video_rows = image_rows[-1] + np.cumsum([0] + [t * h * w for t, h, w in videos])
    kind, grid, spans, clip, group, rows = [], [], [], [], [], []
    next_image, next_video, groups_seen = 0, 0, 0
    for b, s, e, k in pad_runs(mm_token_type_ids.numpy(), attention_mask.numpy()):
        if k == IMAGE:
            if next_image >= len(images):
                raise ValueError(f"the prompts hold more image-pad runs than the {len(images)} images passed")
            t, h, w = images[next_image]
            if e - s != t * h * w // merge ** 2:
                raise ValueError(f"image {next_image}'s pad run has {e - s} tokens, its grid {t}x{h}x{w} makes "
                                 f"{t * h * w // merge ** 2}; build inputs with this model's processor")
            kind.append(IMAGE), grid.append((t, h, w)), spans.append((b, s, e)), clip.append(-1), group.append(0)
            rows.append(np.arange(image_rows[next_image], image_rows[next_image + 1]))
            next_image += 1
            continue
        if next_video >= len(videos):
            raise ValueError(f"the prompts hold more video-pad runs than the {len(videos)} videos passed")
        t, h, w = videos[next_video]
        per_group = h * w // merge ** 2
        if (e - s) % per_group or groups_seen + (e - s) // per_group > t:
            raise ValueError(f"video {next_video}'s pads do not match its grid {t}x{h}x{w}; build inputs with this "
                             "model's processor")
        for g in range(groups_seen, groups_seen + (e - s) // per_group):
            at = s + (g - groups_seen) * per_group
            kind.append(VIDEO), grid.append((1, h, w)), spans.append((b, at, at + per_group))
            clip.append(next_video), group.append(g)
            first = video_rows[next_video] + g * h * w
            rows.append(np.arange(first, first + h * w))
        groups_seen += (e - s) // per_group
        if groups_seen == t:
            next_video, groups_seen = next_video + 1, 0
    if next_image != len(images) or next_video != len(videos) or groups_seen:
        raise ValueError(f"{len(images)} images and {len(videos)} videos were passed but the prompts hold pads for "
                         f"{next_image} and {next_video}; build inputs with this model's processor")
    return Units(kind, torch.tensor(grid, dtype=torch.long).reshape(-1, 3), spans, clip, group,
                 np.concatenate(rows).astype(np.int64) if videos else None)


def unit_pixels(inputs: dict[str, torch.Tensor], units: Units) -> torch.Tensor:
    """The units' patch rows on the VLM's device, in unit order: `pixel_values` itself for images only, else one
    gather from the images' and videos' rows."""
    if units.rows is None:
        return inputs["pixel_values"]
    parts = [inputs[k] for k in ("pixel_values", "pixel_values_videos") if inputs.get(k) is not None]
    source = parts[0] if len(parts) == 1 else torch.cat(parts)
    return source.index_select(0, upload(units.rows, source.device))


__all__ = ["IMAGE", "VIDEO", "Units", "pad_runs", "unit_pixels", "visual_units"]
