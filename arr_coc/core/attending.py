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

import numpy as np
import torch
import torch.nn as nn

from ..budget import Budget, BudgetError, BudgetMode, check_mode, count_of, resolve_count
from .config import AttendingConfig
from .grid import GridBatch, masked_median, upload


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
    """What the allocator decided for a batch of B images (padded grids Hm x Wm), on the host."""

    kept_indices: list[torch.Tensor]  # per image LongTensor[K_i], raster indices into h_i*w_i, ascending
    keep_mask: torch.Tensor  # BoolTensor[B, Hm, Wm]
    budgets: torch.Tensor  # LongTensor[B]: K_i
    fallback: list[str | None]  # per image: None or "grid" (low-structure image)


@dataclass
class Decision:
    """The allocator's answer on the device, before anything is read back (`finish` reads it).

    keep [B, N] over each item's padded cells (raster over (t, h, w)); a void item's row is only a placeholder:
    its grid depends on its count, so `finish` draws it on the host.
    """

    keep: torch.Tensor  # BoolTensor[B, N]
    counts: torch.Tensor  # LongTensor[B]: K_i
    void: torch.Tensor  # BoolTensor[B]: low-structure items, covered by an even grid (`grid_indices`)


@dataclass(frozen=True)
class Plan:
    """A batch's budgets before the device decides: host [3, B] float64 on the device (each item's fixed count,
    its number of cells, whether it is adaptive), the budget mode, and whether any item is adaptive."""

    host: torch.Tensor
    mode: BudgetMode
    adaptive: bool


def _resolve(share: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`resolve_count` of float64 shares [B] against n [B] cells: round half up, in [1, n]."""
    return torch.minimum(torch.floor(share * n + 0.5), n).clamp_min(1.0)


def adaptive_counts(rel: torch.Tensor, ok: torch.Tensor, n: torch.Tensor, cfg: AttendingConfig) -> torch.Tensor:
    """`adaptive_budget` of every item at once: rel, ok [B, N] -> float64 counts [B] (n [B] float64 cells)."""
    p = rel.double().clamp_min(0).masked_fill(~ok, 0.0)
    total = p.sum(1, keepdim=True)
    p = p / total.clamp_min(1e-300)
    entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(1) / torch.log(n.clamp_min(2.0))
    entropy = torch.where((n < 2) | (total[:, 0] <= 0), torch.ones_like(entropy), entropy)
    spread = ((entropy - 0.5) / 0.5).clamp(0.0, 1.0) ** 2
    ratio = cfg.min_ratio + (cfg.max_ratio - cfg.min_ratio) * spread
    lo, hi = _resolve(torch.full_like(n, cfg.min_ratio), n), _resolve(torch.full_like(n, cfg.max_ratio), n)
    return torch.maximum(lo, torch.minimum(hi, _resolve(ratio, n)))


def perplexity_cells(rel: torch.Tensor, ok: torch.Tensor, tau: float) -> torch.Tensor:
    """`relevant_cells` of every item at once: rel, ok [B, N] -> float64 [B]."""
    logp = torch.log_softmax((rel.double() / tau).masked_fill(~ok, float("-inf")), dim=1)
    return torch.exp(-(logp.exp() * logp).masked_fill(~ok, 0.0).sum(1))


def spread_counts(k: torch.Tensor, cells: torch.Tensor, n: torch.Tensor, cfg: AttendingConfig) -> torch.Tensor:
    """`spread_count` of every item at once, then capped at its n cells: float64 [B] each."""
    scaled = torch.round(k * (cells / cfg.spread_reference).clamp(cfg.spread_min, cfg.spread_max))
    capped = torch.maximum(k, torch.minimum(scaled, torch.round(cfg.spread_per_cell * cells)))
    return torch.minimum(torch.where(scaled > k, capped, scaled).clamp_min(1.0), n)


def keep_top(rel: torch.Tensor, ok: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`topk_indices` of every item at once, as a mask: rel, ok [B, N], counts [B] -> BoolTensor[B, N].
    Ties go to the lower raster index (a stable sort); padding never wins."""
    order = torch.sort((-rel.detach().double()).masked_fill(~ok, float("inf")), dim=1, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return (rank < counts[:, None]) & ok


class TokenAllocator(nn.Module):
    """Relevance + budgets -> kept tokens. No parameters.

    `decide` runs on the relevance's device over the whole batch at once (per-image budgets, modes and the
    void fallback are masks, nothing is read back); `finish` reads its answer in one transfer and draws the
    grids of void images; calling the allocator does both.
    """

    def __init__(self, config: AttendingConfig):
        super().__init__()
        self.config = config

    def default_mode(self) -> BudgetMode:
        """How budgets are met when the caller does not say: "mean" for a layer with a calibrated spread."""
        return "mean" if self.config.spread_tau > 0 else "exact"

    def resolve_mode(self, budget_mode: BudgetMode | None) -> BudgetMode:
        mode = check_mode(budget_mode) or self.default_mode()
        if mode == "mean" and self.config.spread_tau <= 0:
            raise BudgetError("budget_mode='mean' needs a trained layer with a calibrated spread "
                              "(attending.spread_tau > 0); this layer keeps exact budgets: use 'exact'")
        return mode

    def check(self, budget: Budget | Sequence[Budget | None] | None, budget_mode: BudgetMode | None, b: int) -> None:
        """Refuse what a caller asked for wrong (a budget per image that does not match, an impossible mode)."""
        self.resolve_mode(budget_mode)
        _per_image(budget, b)

    def plan(self, grid: GridBatch, budget: Budget | Sequence[Budget | None] | None = None,
             budget_mode: BudgetMode | None = None) -> Plan:
        """The budgets of a batch, worked out on the host and uploaded once (see `Plan`)."""
        cfg = self.config
        mode = self.resolve_mode(budget_mode)
        budgets = _per_image(budget, len(grid))
        n_host = grid.cells
        fixed = [count_of(cfg.budget if b is None else b, n) for b, n in zip(budgets, n_host)]
        adaptive = [mode == "adaptive" or (b is None and cfg.mode == "adaptive") for b in budgets]
        host = upload(np.array([fixed, n_host, adaptive], dtype=np.float64), grid.device)   # [3, B]
        return Plan(host, mode, any(adaptive))

    def decide(self, relevance: torch.Tensor, grid: GridBatch, budget: Budget | Sequence[Budget | None] | None = None,
               structure: torch.Tensor | None = None, budget_mode: BudgetMode | None = None,
               cells: torch.Tensor | None = None) -> Decision:
        """relevance [B, ...] (each item's padded cells); structure: the same, the bottom-up map that finds
        low-structure items (defaults to relevance); budget: one for all or one per item (None: the layer's
        default); cells [B]: what "mean" budgets scale by (the layer's `ExtentHead`; None: the perplexity)."""
        return self.decide_planned(relevance, grid, self.plan(grid, budget, budget_mode), structure, cells)

    def decide_planned(self, relevance: torch.Tensor, grid: GridBatch, plan: Plan,
                       structure: torch.Tensor | None = None, cells: torch.Tensor | None = None) -> Decision:
        """`decide` on budgets already planned: device work only (what a compiled pass captures; the budgets
        are its input, so a new budget is new data, not a new graph)."""
        cfg, mode, host = self.config, plan.mode, plan.host
        k, n = host[0], host[1]
        rel = relevance.detach().flatten(1).float()
        ok = grid.item_valid if not grid.uniform else torch.ones_like(rel, dtype=torch.bool)
        void = torch.zeros(len(grid), dtype=torch.bool, device=rel.device)
        if cfg.void_threshold > 0:
            s = (rel if structure is None else structure.detach().flatten(1).float())
            spread = s.masked_fill(~ok, float("-inf")).amax(1) - masked_median(s, None if grid.uniform else ok)
            void = spread.double() < cfg.void_threshold   # compared in float64, as `is_void` does
        if mode == "mean":
            need = perplexity_cells(rel, ok, cfg.spread_tau) if cells is None else cells.double()
            k = torch.where(void, k, spread_counts(k, need, n, cfg))
        if plan.adaptive:
            k = torch.where(host[2] > 0, adaptive_counts(rel, ok, n, cfg), k)
        counts = k.long()
        return Decision(keep_top(rel, ok, counts), counts, void)

    @staticmethod
    def finish(decision: Decision, grid: GridBatch) -> Allocation:
        """Read a decision (one transfer) and turn it into per-image indices; void images get their grid."""
        flat = torch.cat([decision.keep.reshape(-1).to(torch.long), decision.counts, decision.void.long()]).cpu()
        return finish_on_host(flat, grid)

    def forward(self, relevance: torch.Tensor, grid_hw: Sequence[tuple[int, int]],
                budget: Budget | Sequence[Budget | None] | None = None, structure: torch.Tensor | None = None,
                budget_mode: BudgetMode | None = None, cells: Sequence[float] | torch.Tensor | None = None) -> Allocation:
        """relevance [B, Hm, Wm] (image i valid in its top-left h_i x w_i) -> `Allocation` on the host."""
        grid = GridBatch.of_images(grid_hw, relevance.device)
        if cells is not None:
            cells = torch.as_tensor(cells, dtype=torch.float64).to(relevance.device)
        return self.finish(self.decide(relevance, grid, budget, structure, budget_mode, cells), grid)


def finish_on_host(flat: torch.Tensor, grid: GridBatch) -> Allocation:
    """The host side of `TokenAllocator.finish`: flat = [keep (B * N) | counts (B) | void (B)] on the CPU, read
    with numpy (host work: no tensor op)."""
    b = len(grid)
    t_max, hm, wm = grid.shape
    n = t_max * hm * wm
    values = flat.numpy()
    keep = values[: b * n].reshape(b, t_max, hm, wm) != 0
    counts, void = values[b * n: b * n + b], values[b * n + b:] != 0
    kept, fallback = [], []
    for i, (t, h, w) in enumerate(grid.thw):
        if void[i]:
            idx, why = grid_indices(t * h, w, int(counts[i])).numpy(), "grid"   # frames stacked: one even grid
            mask = np.zeros(t * h * w, dtype=bool)
            mask[idx] = True
            keep[i, :t, :h, :w] = mask.reshape(t, h, w)
        else:
            idx, why = np.flatnonzero(keep[i, :t, :h, :w]), None
        kept.append(torch.from_numpy(idx.astype(np.int64)))
        fallback.append(why)
    budgets = torch.from_numpy(np.array([len(k) for k in kept], dtype=np.int64))
    mask = torch.from_numpy(keep[:, 0] if t_max == 1 else keep)
    return Allocation(kept, mask, budgets, fallback)


def _per_image(budget: Budget | Sequence[Budget | None] | None, b: int) -> list[Budget | None]:
    if budget is None or isinstance(budget, (int, float)):
        return [budget] * b
    budget = list(budget)
    if len(budget) != b:
        raise ValueError(f"got {len(budget)} budgets for {b} images; pass one budget or one per image")
    return budget
