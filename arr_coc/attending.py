"""Attending: turn a relevance map and a budget into the visual tokens the VLM keeps.

Pure functions over one image (testable with no model), and `TokenAllocator`, a
thin parameter-free module that applies them to a padded batch (timm's
patch_dropout pattern). The seeds' rule: learn continuous scores, let top-k
select. Budgets are fixed (a share or a count) or adaptive: more tokens when
relevance is spread out (high entropy), fewer when it is concentrated. A
low-structure image (the seeds' "semantic void") gets systematic grid coverage
instead of top-k over noise.

Kept indices are raster indices into the image's merged-token grid, ascending,
so the kept tokens keep the VLM's reading order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from .config import AttendingConfig, Budget, check_budget


def resolve_budget(budget: Budget, n_tokens: int) -> int:
    """A share in (0, 1] or a count -> a token count in [1, n_tokens] (shares round half up)."""
    check_budget(budget)
    if isinstance(budget, float):
        k = int(math.floor(budget * n_tokens + 0.5))
    else:
        k = int(budget)
    return max(1, min(n_tokens, k))


def normalised_entropy(relevance: torch.Tensor) -> float:
    """Entropy of relevance [N] >= 0 read as a distribution, divided by log N: in [0, 1]."""
    n = relevance.numel()
    if n < 2:
        return 1.0
    p = relevance.clamp_min(0).double()
    total = p.sum()
    if total <= 0:
        return 1.0
    p = p / total
    return float(-(p * torch.log(p.clamp_min(1e-300))).sum() / math.log(n))


def adaptive_budget(relevance: torch.Tensor, min_ratio: float, max_ratio: float) -> int:
    """Token count between min_ratio and max_ratio of N, growing with the relevance entropy.

    The entropy is rescaled from [0.5, 1] to [0, 1] (a map with half its mass spread
    uniformly already reads ~0.9 in raw entropy), squared to spend tokens only where
    relevance is really spread.
    """
    n = relevance.numel()
    spread = min(1.0, max(0.0, (normalised_entropy(relevance) - 0.5) / 0.5)) ** 2
    ratio = min_ratio + (max_ratio - min_ratio) * spread
    lo, hi = resolve_budget(float(min_ratio), n), resolve_budget(float(max_ratio), n)
    return max(lo, min(hi, resolve_budget(ratio, n)))


def is_void(structure: torch.Tensor, threshold: float) -> bool:
    """Low-structure image: the bottom-up map's spread (max - median) is below threshold."""
    if threshold <= 0 or structure.numel() == 0:
        return False
    return float(structure.max() - structure.median()) < threshold


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k highest scores of [N]; ties go to the lower raster index; returned ascending."""
    k = max(1, min(int(k), scores.numel()))
    order = torch.sort(-scores.detach().double(), stable=True).indices  # stable: equal scores keep index order
    return order[:k].sort().values


def grid_indices(h: int, w: int, k: int) -> torch.Tensor:
    """k cells spread uniformly over an h x w grid (raster order, ascending).

    A sub-grid of cell centres with about the image's aspect ratio, thinned evenly
    to exactly k; if rounding collides, the remaining cells are filled with a
    deterministic stride over the grid.
    """
    n = h * w
    k = max(1, min(int(k), n))
    if k == n:
        return torch.arange(n)
    rows = max(1, min(h, round(math.sqrt(k * h / w))))
    cols = max(1, min(w, math.ceil(k / rows)))
    while rows * cols < k:  # clamping to h or w can leave too few sites
        if rows < h:
            rows += 1
        else:
            cols = min(w, cols + 1)
    ys = ((torch.arange(rows) + 0.5) * h / rows).long().clamp_max(h - 1)
    xs = ((torch.arange(cols) + 0.5) * w / cols).long().clamp_max(w - 1)
    sites = (ys[:, None] * w + xs[None, :]).flatten().unique()
    if sites.numel() > k:
        pick = torch.linspace(0, sites.numel() - 1, k).round().long()
        sites = sites[pick]
    if sites.numel() < k:
        taken = torch.zeros(n, dtype=torch.bool)
        taken[sites] = True
        stride = max(1, n // k)
        extra = [i for i in list(range(0, n, stride)) + list(range(n)) if not taken[i]]
        extra = list(dict.fromkeys(extra))[: k - sites.numel()]
        sites = torch.cat([sites, torch.tensor(extra, dtype=torch.long)])
    return sites.sort().values


@dataclass
class Allocation:
    """What the allocator decided for a batch of B images (padded grids Hm x Wm)."""

    kept_indices: list[torch.Tensor]  # per image LongTensor[K_i], raster indices into h_i*w_i, ascending
    keep_mask: torch.Tensor  # BoolTensor[B, Hm, Wm]
    budgets: torch.Tensor  # LongTensor[B]: K_i
    fallback: list[str | None]  # per image: None or "grid" (low-structure image)


class TokenAllocator(nn.Module):
    """Relevance [B, Hm, Wm] + budgets -> `Allocation`. No parameters."""

    def __init__(self, config: AttendingConfig):
        super().__init__()
        self.config = config

    def forward(
        self,
        relevance: torch.Tensor,
        grid_hw: Sequence[tuple[int, int]],
        budget: Budget | Sequence[Budget] | None = None,
        structure: torch.Tensor | None = None,
    ) -> Allocation:
        """relevance [B, Hm, Wm] (image i valid in its top-left h_i x w_i); structure: same shape,
        the bottom-up map used to detect low-structure images (defaults to relevance)."""
        cfg = self.config
        b, hm, wm = relevance.shape
        budgets = _per_image(budget if budget is not None else (cfg.budget if cfg.mode == "fixed" else None), b)
        structure = relevance if structure is None else structure
        kept, counts, fallback = [], [], []
        keep_mask = torch.zeros(b, hm, wm, dtype=torch.bool, device=relevance.device)
        for i, (h, w) in enumerate(grid_hw):
            rel = relevance[i, :h, :w].reshape(-1).detach().float()
            if budgets[i] is None:
                k = adaptive_budget(rel, cfg.min_ratio, cfg.max_ratio)
            else:
                k = resolve_budget(budgets[i], h * w)
            if is_void(structure[i, :h, :w].reshape(-1).detach().float(), cfg.void_threshold):
                idx, why = grid_indices(h, w, k), "grid"
            else:
                idx, why = topk_indices(rel, k), None
            idx = idx.to(relevance.device)
            keep_mask[i, idx // w, idx % w] = True
            kept.append(idx)
            counts.append(idx.numel())
            fallback.append(why)
        return Allocation(kept, keep_mask, torch.tensor(counts, dtype=torch.long), fallback)


def _per_image(budget: Budget | Sequence[Budget] | None, b: int) -> list[Budget | None]:
    if budget is None or isinstance(budget, (int, float)):
        return [budget] * b
    budget = list(budget)
    if len(budget) != b:
        raise ValueError(f"got {len(budget)} budgets for {b} images; pass one budget or one per image")
    return budget
