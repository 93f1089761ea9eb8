"""Attending: turn a relevance map and a budget into the visual tokens the VLM keeps.

Pure functions over one image (testable with no model), and `TokenAllocator`, a
thin parameter-free module that applies them to a padded batch (timm's
patch_dropout pattern). The seeds' rule: learn continuous scores, let top-k
select. Budgets are fixed (a share or a count), at most the budget on average (a trained
layer scales each image's budget by how many cells its relevance points at, calibrated on
its training data to average 1, and raises it no further than those cells need), or
adaptive: more tokens when relevance is spread out (high entropy), fewer when it is
concentrated. A low-structure image (the seeds' "semantic void") gets systematic grid
coverage instead of top-k over noise.

Kept indices are raster indices into the image's merged-token grid, ascending,
so the kept tokens keep the VLM's reading order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from .budget import Budget, BudgetError, BudgetMode, check_mode, resolve_count
from .config import AttendingConfig


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
    lo, hi = resolve_count(float(min_ratio), n), resolve_count(float(max_ratio), n)
    return max(lo, min(hi, resolve_count(ratio, n)))


def relevant_cells(relevance: torch.Tensor, tau: float) -> float:
    """How many cells the map points at: the perplexity of softmax(relevance [N] / tau), in [1, N].

    Stage 1 trains softmax(relevance / its tau) to spread like the answer's area over the cells,
    so one object reads a few cells and "How many stars?" over eight stars a few dozen.
    """
    logp = torch.log_softmax(relevance.detach().double().reshape(-1) / tau, dim=0)
    return float(torch.exp(-(logp.exp() * logp).sum()))


def spread_scale(cells: float, reference: float, low: float, high: float) -> float:
    """The factor an image's budget is multiplied by: cells / reference, clipped to [low, high]."""
    return min(high, max(low, cells / reference))


def spread_count(k: int, cells: float, cfg: AttendingConfig) -> int:
    """An image's budget of k tokens scaled by `spread_scale`, raised to at most spread_per_cell x cells.

    The cap: a question about eight stars needs their cells, not twice the budget; tokens
    beyond them add other objects to what the VLM counts.
    """
    scaled = round(k * spread_scale(cells, cfg.spread_reference, cfg.spread_min, cfg.spread_max))
    if scaled > k:
        scaled = max(k, min(scaled, round(cfg.spread_per_cell * cells)))
    return max(1, scaled)


def calibrate_spread(cells: Sequence[float], low: float, high: float) -> float:
    """The reference for which `spread_scale` averages 1 over `cells` (the relevant cells of a data set).

    The mean scale does not grow with the reference, so bisection (in log space) finds it.
    """
    if not cells:
        raise ValueError("calibrate_spread needs the relevant-cell counts of at least one image")
    if not low <= 1.0 <= high:
        raise ValueError(f"need low <= 1 <= high for a scale that can average 1, got [{low}, {high}]")
    lo, hi = min(cells) / high / 2, max(cells) / low * 2  # mean scale is `high` at lo, `low` at hi
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if sum(spread_scale(c, mid, low, high) for c in cells) / len(cells) > 1.0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


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

    def default_mode(self) -> BudgetMode:
        """How budgets are met when the caller does not say: "mean" for a layer with a calibrated spread."""
        return "mean" if self.config.spread_tau > 0 else "exact"

    def forward(
        self,
        relevance: torch.Tensor,
        grid_hw: Sequence[tuple[int, int]],
        budget: Budget | Sequence[Budget | None] | None = None,
        structure: torch.Tensor | None = None,
        budget_mode: BudgetMode | None = None,
        cells: Sequence[float] | torch.Tensor | None = None,
    ) -> Allocation:
        """relevance [B, Hm, Wm] (image i valid in its top-left h_i x w_i); structure: same shape,
        the bottom-up map used to detect low-structure images (defaults to relevance).

        budget: one for all images or one per image; None (or a None entry) means this layer's
        default: its configured budget, or adaptive when the config's mode is "adaptive".
        budget_mode: "exact" | "mean" | "adaptive" | None (`default_mode`), see arr_coc.budget.
        cells: [B] how many cells each image's question needs, which "mean" budgets scale by (the
            layer's `ExtentHead`); None: the perplexity of the relevance map (`relevant_cells`).
        """
        cfg = self.config
        mode = check_mode(budget_mode) or self.default_mode()
        if mode == "mean" and cfg.spread_tau <= 0:
            raise BudgetError("budget_mode='mean' needs a trained layer with a calibrated spread "
                              "(attending.spread_tau > 0); this layer keeps exact budgets: use 'exact'")
        b, hm, wm = relevance.shape
        budgets = _per_image(budget, b)
        structure = relevance if structure is None else structure
        kept, counts, fallback = [], [], []
        keep_mask = torch.zeros(b, hm, wm, dtype=torch.bool, device=relevance.device)
        for i, (h, w) in enumerate(grid_hw):
            rel = relevance[i, :h, :w].reshape(-1).detach().float()
            void = is_void(structure[i, :h, :w].reshape(-1).detach().float(), cfg.void_threshold)
            if mode == "adaptive" or (budgets[i] is None and cfg.mode == "adaptive"):
                k = adaptive_budget(rel, cfg.min_ratio, cfg.max_ratio)
            else:
                k = resolve_count(cfg.budget if budgets[i] is None else budgets[i], h * w)
                if mode == "mean" and not void:
                    need = relevant_cells(rel, cfg.spread_tau) if cells is None else float(cells[i])
                    k = resolve_count(spread_count(k, need, cfg), h * w)
            if void:
                idx, why = grid_indices(h, w, k), "grid"
            else:
                idx, why = topk_indices(rel, k), None
            idx = idx.to(relevance.device)
            keep_mask[i, idx // w, idx % w] = True
            kept.append(idx)
            counts.append(idx.numel())
            fallback.append(why)
        return Allocation(kept, keep_mask, torch.tensor(counts, dtype=torch.long), fallback)


def _per_image(budget: Budget | Sequence[Budget | None] | None, b: int) -> list[Budget | None]:
    if budget is None or isinstance(budget, (int, float)):
        return [budget] * b
    budget = list(budget)
    if len(budget) != b:
        raise ValueError(f"got {len(budget)} budgets for {b} images; pass one budget or one per image")
    return budget
