"""Deterministic batched k-means over the cells of padded frames (the texture array's `clusters` group)."""

from __future__ import annotations

from typing import Callable

import torch

from .grid import eager_cpu, masked_median


def _distance(x: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """[B, N, D], [B, D] -> [B, N] Euclidean distances (computed directly, as a norm of the difference)."""
    return torch.cdist(x, points[:, None], compute_mode="donot_use_mm_for_euclid_dist")[..., 0]


MM_ABOVE = 25   # torch.cdist's default mode takes the matrix-product route with more than this many points or centroids


def _distances_to(x: torch.Tensor, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [B, N, D] -> a function: centroids [B, K, D] -> [B, N, K] Euclidean distances, `torch.cdist(x, centroids)`
    bit for bit. Above MM_ABOVE points or centroids cdist runs `_euclidean_dist`: the points written as
    [-2 x, |x|^2, 1] times the centroids written as [c, 1, |c|^2], clamped and square-rooted. The points' half is the
    same at every step, so it is built once here and each step makes the centroids' half and the product, the same
    ops on the same numbers (tests/test_exact_speed.py); at or below, cdist's direct route as it is."""
    if x.shape[1] <= MM_ABOVE and k <= MM_ABOVE:
        return lambda centroids: torch.cdist(x, centroids)
    norm = x.pow(2).sum(-1, keepdim=True)                                                 # [B, N, 1]
    points = torch.cat([x.mul(-2), norm, torch.ones_like(norm)], dim=-1)                 # [B, N, D + 2]
    ones = norm.new_ones(x.shape[0], k, 1)                                                # [B, K, 1]

    def distances(centroids: torch.Tensor) -> torch.Tensor:
        c_norm = centroids.pow(2).sum(-1, keepdim=True)                                   # [B, K, 1]
        sides = torch.cat([centroids, ones, c_norm], dim=-1)                              # [B, K, D + 2]
        return torch.bmm(points, sides.mT).clamp_min_(1e-30).sqrt_()

    return distances


def kmeans(x: torch.Tensor, k: int, iters: int, valid: torch.Tensor | None = None,
           n_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, N, D] points, valid [B, N] (None: all) -> labels [B, N], centroids [B, K, D], K = min(k, N).

    Initialised by farthest-point sampling from the median point (no randomness), so the same image
    always yields the same clusters; a frame with fewer valid points than k (n_valid [B]) uses only its
    first n_valid centroids, the rest never win a point. Padded points are never chosen and never
    counted, so a frame clusters exactly as it would alone. At most `iters` steps: a GPU runs them all without
    looking; the CPU stops at the first step that assigns every point as the step before did (the same result,
    `stops_at_a_fixed_point`).
    """
    b, n, d = x.shape
    k = min(k, n)
    padding = None if valid is None else ~valid                                            # [B, N]
    start = masked_median(x.transpose(1, 2), None if valid is None else valid[:, None])   # [B, D]
    dist = _distance(x, start)                                                            # [B, N]
    if padding is not None:
        dist = dist.masked_fill(padding, float("inf"))
    chosen = [dist.argmin(1)]
    dist = _distance(x, x.gather(1, chosen[0][:, None, None].expand(b, 1, d))[:, 0])
    if padding is not None:
        dist = dist.masked_fill(padding, -1.0)         # distances are >= 0: a padded point is never the farthest
    for _ in range(k - 1):
        chosen.append(dist.argmax(1))
        dist = torch.minimum(dist, _distance(x, x.gather(1, chosen[-1][:, None, None].expand(b, 1, d))[:, 0]))
    centroids = x.gather(1, torch.stack(chosen, dim=1)[..., None].expand(b, k, d))       # [B, K, D]
    slots = torch.arange(k, device=x.device)
    unused = None if n_valid is None else (slots[None, :] >= n_valid[:, None])[:, None, :]   # [B, 1, K]
    with_ones = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)                      # [B, N, D + 1]
    distances = _distances_to(x, k)

    def assign(centroids: torch.Tensor) -> torch.Tensor:
        dist = distances(centroids)                                                       # [B, N, K]
        labels = (dist if unused is None else dist.masked_fill(unused, float("inf"))).argmin(-1)
        return labels if padding is None else labels.masked_fill(padding, k)             # padding: no cluster

    settle = stops_at_a_fixed_point(x.device)
    labels = None
    for _ in range(iters):
        new = assign(centroids)
        if settle and labels is not None and torch.equal(new, labels):
            break   # a fixed point: each further step would give these labels and centroids again, bit for bit
        labels = new
        onehot = (labels[..., None] == slots).to(x.dtype)                                # [B, N, K]
        totals = torch.bmm(onehot.transpose(1, 2), with_ones)                             # [B, K, D + 1]
        counts = totals[..., d:]                                                          # [B, K, 1]
        # An emptied cluster keeps its old centroid (its 0 / 0 is never taken; a count is a whole number >= 1 else).
        centroids = torch.where(counts > 0, totals[..., :d] / counts, centroids)
    else:
        labels = assign(centroids)
    return (labels if valid is None else labels.clamp(max=k - 1)), centroids


def stops_at_a_fixed_point(device: torch.device) -> bool:
    """Whether k-means stops when an assignment repeats the one before (reading back whether it does): on the CPU,
    eager. The centroids are the means of the same points then, so every further step repeats the step before bit
    for bit, and stopping returns what the fixed `iters` steps return; a GPU runs them all without looking."""
    return eager_cpu(device)


__all__ = ["kmeans", "stops_at_a_fixed_point"]
