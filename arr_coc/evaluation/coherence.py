"""Temporal coherence of ARR-COC's video allocation, measured at the layer on ShapesVQA-video clips.

For one clip and one question, every temporal group's picture (its first frame, at the processor's size) goes
through the layer as an image does; the clip's budget is then spread over time (`temporal.spread_clip`), the
same function the wrapper's selector runs. Per group it reports how much of the target the kept cells cover
(the record's boxes over time: the objects the answer needs) and how much the kept set changes from one group
to the next (jitter: 1 - IoU of consecutive kept sets, over groups inside one scene), with the temporal
settings given, so carry-over and its absence are compared on the same relevance.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..budget import Budget, resolve_count
from ..core.config import TemporalConfig
from ..geometry import box_cell_set
from ..core.temporal import cell_colours, spread_clip


@dataclass
class ClipCoherence:
    coverage: list[float | None]   # per group: share of the target's cells kept (None: no target visible)
    covered: list[float | None]    # the same, counting a cell whose earlier kept token stands in (unchanged since)
    jitter: list[float]            # per consecutive pair of groups inside one scene: 1 - IoU of the kept sets
    kept_per_group: list[int]


def group_pictures(frames: np.ndarray, temporal_patch: int = 2) -> tuple[np.ndarray, list[int]]:
    """[N, H, W, 3] frames -> (the first frame of each temporal group, their frame indices); the last group
    is padded with the last frame, as Qwen's processors pad a clip."""
    starts = list(range(0, len(frames), temporal_patch))
    return frames[starts], starts


@torch.no_grad()
def clip_coherence(layer: Any, frames: np.ndarray, boxes_over_time: Sequence[Sequence[Sequence[float]]],
                   question: str, query: torch.Tensor, budget: Budget, config: TemporalConfig,
                   cell_px: int = 28) -> ClipCoherence:
    """frames [N, H, W, 3] uint8 with H, W multiples of `cell_px`; query [L, D] the question's embeddings."""
    pictures, starts = group_pictures(frames)
    t, (height, width) = len(pictures), pictures.shape[1:3]
    h, w = height // cell_px, width // cell_px
    batch = layer.batch(list(pictures), [(h, w)] * t, [query] * t)
    out = layer.run(batch)
    colours = cell_colours(batch.work.pixels, batch.work.px)
    keep, signals = spread_clip(out.relevance[:, :h, :w], colours[..., :h, :w], question,
                                resolve_count(budget, t * h * w), config)
    keep = keep.reshape(t, -1).cpu().numpy()
    cuts = signals.cut.cpu().numpy()
    static = (signals.motion < config.static_threshold).reshape(t, -1).cpu().numpy() & ~cuts[:, None]
    coverage: list[float | None] = []
    covered: list[float | None] = []
    standing = np.zeros_like(keep[0])
    for g, f in enumerate(starts):
        standing = keep[g] | (standing & static[g])          # kept now, or kept before and unchanged since
        target = box_cell_set(boxes_over_time[f], (h, w), (width, height)) if boxes_over_time[f] else set()
        kept = set(np.flatnonzero(keep[g]).tolist())
        coverage.append(len(kept & target) / len(target) if target else None)
        covered.append(len(set(np.flatnonzero(standing).tolist()) & target) / len(target) if target else None)
    jitter = []
    for g in range(1, t):
        if cuts[g]:
            continue
        a, b = keep[g - 1], keep[g]
        jitter.append(1.0 - float((a & b).sum()) / max(1, float((a | b).sum())))
    return ClipCoherence(coverage, covered, jitter, keep.sum(1).tolist())


def target_over_time(track: Any, boxes_over_time: Sequence[Sequence[Sequence[float]]]) -> list[list[tuple]]:
    """The answer's objects in every frame they are in (a record marks a start / end question's object in one
    frame only): the actors whose box is among the record's boxes in some frame, boxed wherever present."""
    ids = {i for t, boxes in enumerate(boxes_over_time) for i in range(len(track.actors))
           if track.present(i, t) and list(track.box_at(i, t)) in [list(b) for b in boxes]}
    return [[tuple(track.box_at(i, t)) for i in sorted(ids) if track.present(i, t)] for t in range(track.n_frames)]


def named_object(rec: dict[str, Any], track: Any) -> tuple[list[list[tuple]], str] | None:
    """(the target in every frame, a question naming it) for a panning clip whose answer is one object seen from
    the first frame, asked as the image set asks ("Is there a <color> <shape>?", no word about time); else None."""
    target = target_over_time(track, rec["boxes_over_time"])
    if rec["pan"] is None or len(target[0]) != 1 or rec["n_frames"] < 6:
        return None
    actor = next(a for i, a in enumerate(track.actors)
                 if track.present(i, 0) and tuple(track.box_at(i, 0)) == target[0][0])
    return target, f"Is there a {actor.color} {actor.shape}?"


def summary(results: Sequence[ClipCoherence]) -> dict[str, float]:
    cov = [c for r in results for c in r.coverage if c is not None]
    stand = [c for r in results for c in r.covered if c is not None]
    jit = [j for r in results for j in r.jitter]
    return {"coverage": float(np.mean(cov)) if cov else float("nan"),
            "covered": float(np.mean(stand)) if stand else float("nan"),
            "jitter": float(np.mean(jit)) if jit else float("nan"), "clips": len(results)}


def without_carry(config: TemporalConfig) -> TemporalConfig:
    """The same settings with nothing carried from group to group (per-group selection)."""
    return dataclasses.replace(config, decay=0.0)


__all__ = ["ClipCoherence", "clip_coherence", "group_pictures", "named_object", "summary", "target_over_time", "without_carry"]
