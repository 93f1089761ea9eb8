"""k-means as it was before its distances were built once (issue 64, ea29d4d): torch.cdist at every step, the sums
by `@`, the counts clamped before dividing. The reference `tests/test_exact_speed.py` holds `arr_coc.core.kmeans`
against, bit for bit."""

from __future__ import annotations

import torch

from arr_coc.core.grid import masked_median
from arr_coc.core.kmeans import _distance, stops_at_a_fixed_point


def kmeans(x: torch.Tensor, k: int, iters: int, valid: torch.Tensor | None = None,
           n_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The code of ea29d4d, unchanged."""
    b, n, d = x.shape
    k = min(k, n)
    start = masked_median(x.transpose(1, 2), None if valid is None else valid[:, None])   # [B, D]
    dist = _distance(x, start)                                                            # [B, N]
    if valid is not None:
        dist = dist.masked_fill(~valid, float("inf"))
    chosen = [dist.argmin(1)]
    dist = _distance(x, x.gather(1, chosen[0][:, None, None].expand(b, 1, d))[:, 0])
    if valid is not None:
        dist = dist.masked_fill(~valid, -1.0)          # distances are >= 0: a padded point is never the farthest
    for _ in range(k - 1):
        chosen.append(dist.argmax(1))
        dist = torch.minimum(dist, _distance(x, x.gather(1, chosen[-1][:, None, None].expand(b, 1, d))[:, 0]))
    centroids = x.gather(1, torch.stack(chosen, dim=1)[..., None].expand(b, k, d))       # [B, K, D]
    slots = torch.arange(k, device=x.device)
    unused = None if n_valid is None else (slots[None, :] >= n_valid[:, None])[:, None, :]   # [B, 1, K]
    with_ones = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)                      # [B, N, D + 1]

    def assign(centroids: torch.Tensor) -> torch.Tensor:
        dist = torch.cdist(x, centroids)                                                  # [B, N, K]
        labels = (dist if unused is None else dist.masked_fill(unused, float("inf"))).argmin(-1)
        return labels if valid is None else labels.masked_fill(~valid, k)                # padding: no cluster

    settle = stops_at_a_fixed_point(x.device)
    labels = None
    for _ in range(iters):
        new = assign(centroids)
        if settle and labels is not None and torch.equal(new, labels):
            break   # a fixed point: each further step would give these labels and centroids again, bit for bit
        labels = new
        onehot = (labels[..., None] == slots).to(x.dtype)                                # [B, N, K]
        totals = onehot.transpose(1, 2) @ with_ones                                       # [B, K, D + 1]
        counts = totals[..., d:]                                                          # [B, K, 1]
        # An emptied cluster keeps its old centroid.
        centroids = torch.where(counts > 0, totals[..., :d] / counts.clamp_min(1), centroids)
    else:
        labels = assign(centroids)
    return (labels if valid is None else labels.clamp(max=k - 1)), centroids
