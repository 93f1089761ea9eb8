"""Time in ARR-COC: the temporal channels of a clip and one budget spread over its groups and cells.

A clip reaches the layer as its temporal groups, each a frame of the padded batch (`grid.py`); the spatial
stages (texture, scorers, balancer) score every group as they score an image. This module adds what only
time has, on the layer's device, a fixed number of ops per clip:

- **motion** [t, h, w]: per cell, the mean absolute colour change from the previous group (1 in the first
  group: everything there is new);
- **scene cut** [t]: the group's colour histogram (4 levels per channel over its cells) moved more than
  `cut_threshold` in L1 from the previous group's; a pan moves the cells but keeps the histogram, a cut
  replaces it;
- **carried relevance** inside a scene, reset at its first group (the design's mitigation for "the allocation
  jumps around, answers change frame to frame"): by default the decayed maximum, max(r_g, a r~_(g-1)), which
  never lowers the current group's relevance; smoothing (r~_g = a r~_(g-1) + (1 - a) r_g) everywhere or only
  where a cell's content did not change are the other two `carry` modes (measured in docs/RESULTS.md);
- **static cells** (motion under `static_threshold` after a scene's first group) are paid once: their
  score is scaled by `static_weight`, so the earlier token of the same content stands in for them;
- **the question's place in time**: words about the start ("first", "beginning", ...) or the end ("last",
  "end", "finally", ...) tilt the scores towards those groups by exp(+-`time_cue` * position), position in
  [-1, 1] over the clip. This is a rule on the question's words, the one untrained part; a learned
  temporal coupling would replace it.

`allocate` then keeps the top-K cells of the whole clip (K resolved against its t * h * w cells), at least
`min_per_group` in each group, so one budget covers the clip and a question about its end spends it there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import TemporalConfig

EARLY = re.compile(r"\b(first|start|starts|beginning|begin|begins|initially|opening|earliest)\b", re.I)
LATE = re.compile(r"\b(last|end|ends|ending|final|finally|latest|lastly)\b", re.I)


@dataclass
class ClipSignals:
    """One clip's temporal channels, on the layer's device."""

    motion: torch.Tensor     # [t, h, w] in [0, 1]
    cut: torch.Tensor        # [t] bool: the group starts a new scene (group 0 always does)
    carried: torch.Tensor    # [t, h, w] relevance carried from group to group
    score: torch.Tensor      # [t, h, w] what the clip's top-K ranks
    time_weight: torch.Tensor  # [t] the question's tilt in time


def cell_colours(pixels: torch.Tensor, px: int) -> torch.Tensor:
    """Work images [t, 3, h * px, w * px] -> mean colour per cell [t, 3, h, w]."""
    return F.avg_pool2d(pixels, px)


def motion_of(colours: torch.Tensor) -> torch.Tensor:
    """[t, 3, h, w] -> [t, h, w]: mean absolute change from the previous group, 1 in the first."""
    change = (colours[1:] - colours[:-1]).abs().mean(1)
    return torch.cat([torch.ones_like(colours[:1, 0]), change]).clamp(0.0, 1.0)


def scene_cuts(colours: torch.Tensor, threshold: float, levels: int = 4) -> torch.Tensor:
    """[t, 3, h, w] -> [t] bool: the group's colour histogram moved more than `threshold` (L1) from the last."""
    t = colours.shape[0]
    q = (colours.clamp(0, 1) * (levels - 1e-6)).long()                           # [t, 3, h, w]
    bins = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]                        # [t, h, w]
    flat = bins.reshape(t, -1)
    hist = torch.zeros(t, levels ** 3, device=colours.device).scatter_add_(   # [t, levels**3]; one_hot would read
        1, flat, torch.full(flat.shape, 1.0 / flat.shape[1], device=colours.device))   # its indices back (a sync)
    moved = (hist[1:] - hist[:-1]).abs().sum(-1) > threshold
    return torch.cat([torch.ones(1, dtype=torch.bool, device=colours.device), moved])


def carry_matrix(cut: torch.Tensor, decay: float) -> torch.Tensor:
    """[t] scene starts -> [t, t] weights W with r~ = W @ r: exponential smoothing that restarts at a cut."""
    t = cut.shape[0]
    idx = torch.arange(t, device=cut.device)
    scene = cut.long().cumsum(0)
    same = (scene[:, None] == scene[None, :]) & (idx[None, :] <= idx[:, None])
    age = (idx[:, None] - idx[None, :]).clamp(min=0).float()
    weights = decay ** age * torch.where(cut[None, :], 1.0, 1.0 - decay)       # a scene's first group: a**age
    return torch.where(same, weights, torch.zeros_like(weights))


def carry(relevance: torch.Tensor, cut: torch.Tensor, decay: float, mode: str = "max",
          changed: torch.Tensor | None = None) -> torch.Tensor:
    """relevance [t, h, w] carried over the groups of each scene (reset at a cut):

    "mean"    exponential smoothing, r~_g = a r~_(g-1) + (1 - a) r_g (one [t, t] matmul): steady between near
              ties, but a moving object's new cells start low (it lags);
    "max"     the decayed maximum, r~_g = max(r_g, a r~_(g-1)): the current relevance is never lowered, what was
              relevant fades, but a near tie still flips;
    "motion"  both, per cell: smoothing where the cell's content did not change since the last group (a static
              object's relevance is noise around one value: hold the choice), the decayed maximum where it
              changed (`changed` [t, h, w] bool: follow what moves, a pan included). A loop over the groups, a
              few elementwise ops each.
    """
    t = relevance.shape[0]
    flat = relevance.reshape(t, -1)
    if mode == "mean":
        return (carry_matrix(cut, decay) @ flat).reshape(relevance.shape)
    if mode == "max":
        idx = torch.arange(t, device=cut.device)
        scene = cut.long().cumsum(0)
        same = (scene[:, None] == scene[None, :]) & (idx[None, :] <= idx[:, None])
        weights = torch.pow(decay, (idx[:, None] - idx[None, :]).clamp(min=0).float()) * same
        return (weights[:, :, None] * flat[None]).amax(1).reshape(relevance.shape)
    moved = torch.ones_like(flat, dtype=torch.bool) if changed is None else changed.reshape(t, -1)
    out = [flat[0]]
    for g in range(1, t):
        held = decay * out[-1]
        step = torch.where(moved[g], torch.maximum(flat[g], held), held + (1.0 - decay) * flat[g])
        out.append(torch.where(cut[g], flat[g], step))
    return torch.stack(out).reshape(relevance.shape)


def time_weights(question: str | None, t: int, cue: float, device: torch.device) -> torch.Tensor:
    """[t]: exp(cue * s * position), position from -1 (first group) to 1 (last), s = +1 for a question about the
    end, -1 about the start, 0 otherwise (or both)."""
    s = 0.0
    if question:
        s = float(bool(LATE.search(question))) - float(bool(EARLY.search(question)))
    position = torch.linspace(-1.0, 1.0, t, device=device) if t > 1 else torch.zeros(1, device=device)
    return torch.exp(cue * s * position)


def clip_signals(relevance: torch.Tensor, colours: torch.Tensor, question: str | None,
                 config: TemporalConfig) -> ClipSignals:
    """relevance [t, h, w] (the spatial scorers' per group) and cell colours [t, 3, h, w] -> the clip's signals."""
    t = relevance.shape[0]
    motion = motion_of(colours)
    cut = scene_cuts(colours, config.cut_threshold)
    fresh = cut[:, None, None] | (motion >= config.static_threshold)
    carried = carry(relevance, cut, config.decay, config.carry, fresh)
    weight = time_weights(question, t, config.time_cue, relevance.device)
    paid = fresh.float() * (1.0 - config.static_weight) + config.static_weight       # 1 if fresh, else static_weight
    score = carried * paid * weight[:, None, None]
    return ClipSignals(motion, cut, carried, score, weight)


def allocate(score: torch.Tensor, k: int, min_per_group: int = 1) -> torch.Tensor:
    """score [t, h, w] -> keep mask [t, h, w]: the top-k cells of the clip, at least `min_per_group` per group
    (those first: each group's best), ties broken by raster order over (t, h, w).

    The clip's minimum is one cell per group whatever `min_per_group` and `k` say (a temporal group keeps its place
    in the prompt: a unit the language model reads holds at least one token), so a budget below it keeps exactly
    that minimum, never more (`minimum_count`; the trace says so)."""
    t = score.shape[0]
    flat = score.reshape(t, -1).float()
    n = flat.shape[1]
    floor = max(1, min(int(min_per_group), n))
    k = max(floor * t, min(int(k), t * n))
    forced = torch.zeros_like(flat, dtype=torch.bool)
    if floor > 0:
        forced.scatter_(1, flat.topk(floor, dim=1, sorted=False).indices, True)
    ranked = torch.where(forced, torch.full_like(flat, float("inf")), flat).reshape(-1)
    top = torch.sort(ranked, descending=True, stable=True).indices[:k]
    return torch.zeros_like(ranked, dtype=torch.bool).index_fill_(0, top, True).reshape(score.shape)


def minimum_count(t: int, n: int, min_per_group: int = 1) -> int:
    """The fewest cells a clip of t groups of n cells keeps: `allocate`'s floor (at least one per group)."""
    return t * max(1, min(int(min_per_group), n))


def spread_clip(relevance: torch.Tensor, colours: torch.Tensor, question: str | None, k: int,
                config: TemporalConfig) -> tuple[torch.Tensor, ClipSignals]:
    """One clip's decision: relevance [t, h, w] per group and cell colours [t, 3, h, w] -> (keep mask [t, h, w]
    with k cells, at least `config.min_per_group` per group; the signals behind it). Queued on the device."""
    signals = clip_signals(relevance, colours, question, config)
    return allocate(signals.score, k, config.min_per_group), signals


__all__ = ["ClipSignals", "TemporalConfig", "allocate", "minimum_count", "carry_matrix", "cell_colours", "clip_signals",
           "motion_of", "scene_cuts", "spread_clip", "time_weights"]
