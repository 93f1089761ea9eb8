"""Adaptive tension balancing: how much each way of knowing counts, per image and question.

The seeds' "opponent processing" (compress vs. particularise, exploit vs. explore)
is realised as three independent sigmoid weights predicted from the question
embedding and from statistics of the three score maps. Sigmoid rather than
softmax: the weights do not compete for a fixed total, so all three can be
amplified (or damped) at once.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import BalancingConfig, KnowingConfig

N_STATS = 4  # mean, std, max, normalised entropy per map


def map_statistics(maps: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """maps [B, 3, h, w] in [0, 1], valid [B, h, w] -> [B, 3 * N_STATS] over valid cells only."""
    b, k = maps.shape[:2]
    m = valid[:, None].to(maps.dtype).expand_as(maps).flatten(2)  # [B, 3, N]
    x = maps.flatten(2)
    n = m.sum(-1).clamp_min(1.0)
    mean = (x * m).sum(-1) / n
    std = ((((x - mean[..., None]) * m) ** 2).sum(-1) / n).sqrt()
    mx = x.masked_fill(m == 0, -1.0).amax(-1)
    p = x * m / (x * m).sum(-1, keepdim=True).clamp_min(1e-12)
    ent = -(p * torch.log(p.clamp_min(1e-12))).sum(-1) / torch.log(n.clamp_min(2.0))
    return torch.stack([mean, std, mx, ent], dim=-1).reshape(b, k * N_STATS)


class AdaptiveTensionBalancer(nn.Module):
    """(question embedding, map statistics) -> weights [B, 3] in (0, 1) and relevance [B, h, w].

    relevance = sum_i w_i * map_i / 3, in [0, 1]. The MLP's output layer starts near
    zero, so untrained weights equal `init_weights` for every input.
    """

    def __init__(self, config: BalancingConfig, knowing: KnowingConfig):
        super().__init__()
        self.query_norm = nn.LayerNorm(knowing.query_dim, elementwise_affine=False)
        self.query_proj = nn.Linear(knowing.query_dim, config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(3 * N_STATS + config.hidden, config.hidden), nn.GELU(), nn.Linear(config.hidden, 3)
        )
        nn.init.normal_(self.mlp[-1].weight, std=1e-3)
        with torch.no_grad():
            self.mlp[-1].bias.copy_(torch.tensor([math.log(w / (1 - w)) for w in config.init_weights]))

    def forward(
        self,
        maps: torch.Tensor,
        valid: torch.Tensor,
        query: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """maps [B, 3, h, w]; query [B, L, D] with query_mask [B, L] -> (relevance [B, h, w], weights [B, 3])."""
        stats = map_statistics(maps, valid)
        if query is None:
            q = torch.zeros(maps.shape[0], self.query_proj.out_features, dtype=maps.dtype, device=maps.device)
        else:
            if query_mask is None:
                query_mask = torch.ones(query.shape[:2], dtype=torch.bool, device=query.device)
            qm = query_mask[..., None].to(maps.dtype)
            pooled = (self.query_norm(query.float()) * qm).sum(1) / qm.sum(1).clamp_min(1.0)
            q = self.query_proj(pooled)
        weights = torch.sigmoid(self.mlp(torch.cat([stats, q], dim=-1)))  # [B, 3]
        relevance = (weights[:, :, None, None] * maps).sum(1) / 3.0
        return relevance * valid, weights
