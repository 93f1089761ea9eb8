"""How many cells a question needs: the extent that a question-following budget scales by.

"What colour is the star?" needs the star's few cells; "How many squares are there?" needs every
square's. A budget that follows the question (`attending.budget_mode="mean"`) multiplies each
image's token budget by extent / reference. The first estimate of the extent was the perplexity
of the relevance map (`attending.relevant_cells`); it barely tells the two apart, because stage 1
teaches the map to peak on the answer whatever its size (on the shipped layer's training items
the median perplexity is 3.4 cells for count questions against 2.1-2.8 for the others, while the
answers cover 22 and 4-6 cells).

`ExtentHead` predicts it instead: log(1 + answer cells) from the question (its token embeddings,
normalised and mean-pooled) and the relevance map's shape (log perplexities at a few temperatures,
log of the grid's cell count, the sorted top relevances). It is linear, fitted in closed form
(ridge regression, `fit_extent_head`) on the training items' answer cells once the scorers are
trained, so fitting it is deterministic and takes seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .grid import constant

PERPLEXITY_TAUS = (0.01, 0.02, 0.05, 0.1)  # softmax temperatures of the map's perplexities (relevance units)
TOP_RANKS = tuple(range(0, 64, 8))           # the relevances at these ranks (clamped to the grid's last cell)
N_MAP_FEATURES = len(PERPLEXITY_TAUS) + 1 + len(TOP_RANKS)


def pooled_query(query: torch.Tensor | None, query_mask: torch.Tensor | None, batch: int, dim: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, L, D] question embeddings (mask [B, L]) -> [B, D]: mean of the layer-normalised tokens (zeros if None)."""
    if query is None:
        return torch.zeros(batch, dim, device=device)
    mask = torch.ones(query.shape[:2], dtype=torch.bool, device=query.device) if query_mask is None else query_mask
    m = mask[..., None].float()
    return (F.layer_norm(query.float(), query.shape[-1:]) * m).sum(1) / m.sum(1).clamp_min(1.0)


def map_features(relevance: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """relevance, valid [B, ...] (each item's cells, padded) -> [B, N_MAP_FEATURES]: log perplexities, log cells,
    top relevances. Batched over items in float64, padding excluded; nothing is read back to the host."""
    r = relevance.detach().double().flatten(1)                               # [B, N]
    ok = valid.flatten(1)
    n = ok.sum(1)                                                            # [B] cells per item
    logps = torch.log_softmax(_scaled(r, ok), dim=-1)                        # [B, T, N]
    perplexities = -(logps.exp() * logps).masked_fill(~ok[:, None], 0.0).sum(-1)   # [B, T]: log of the perplexity
    top = r.masked_fill(~ok, float("-inf")).sort(dim=1, descending=True).values    # [B, N]
    ranks = torch.minimum(constant("top_ranks", lambda: torch.tensor(TOP_RANKS), n)[None], n[:, None] - 1)
    rows = torch.cat([perplexities, n.double().log()[:, None], top.gather(1, ranks)], dim=1)
    return rows.float()


def _scaled(r: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """[B, N] relevance -> [B, T, N]: divided by each PERPLEXITY_TAUS, padding at -inf (out of every softmax)."""
    taus = constant("perplexity_taus", lambda: torch.tensor(PERPLEXITY_TAUS, dtype=torch.float64), r)
    return (r[:, None] / taus[None, :, None]).masked_fill(~ok[:, None], float("-inf"))


class ExtentHead(nn.Module):
    """(question, relevance map) -> cells the answer covers, >= 1. Linear in standardised features.

    Its weights are buffers, not parameters: they are fitted in closed form, never by the optimiser
    that trains the scorers around them.
    """

    def __init__(self, query_dim: int):
        super().__init__()
        self.query_dim = query_dim
        n = query_dim + N_MAP_FEATURES
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.register_buffer("weight", torch.zeros(n))
        self.register_buffer("bias", torch.zeros(()))

    def features(self, relevance: torch.Tensor, valid: torch.Tensor, query: torch.Tensor | None,
                 query_mask: torch.Tensor | None) -> torch.Tensor:
        """[B, query_dim + N_MAP_FEATURES], before standardisation."""
        q = pooled_query(query, query_mask, relevance.shape[0], self.query_dim, relevance.device)
        return torch.cat([q, map_features(relevance, valid)], 1)

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n] features -> [B] cells (exp of the predicted log(1 + cells), minus 1, at least 1)."""
        z = (features.to(self.mean) - self.mean) / self.std
        return (z @ self.weight + self.bias).exp().sub(1.0).clamp_min(1.0)

    def forward(self, relevance: torch.Tensor, valid: torch.Tensor, query: torch.Tensor | None = None,
                query_mask: torch.Tensor | None = None) -> torch.Tensor:
        """relevance, valid [B, Hm, Wm]; query [B, L, D] -> [B] predicted answer cells."""
        return self.predict(self.features(relevance, valid, query, query_mask))


@torch.no_grad()
def fit_extent_head(head: ExtentHead, features: torch.Tensor, cells: torch.Tensor, ridge: float = 1.0) -> float:
    """Fit `head` to answer-cell counts in closed form: ridge regression of log(1 + cells) on the
    standardised features [N, n]. Returns the fit's R^2 on those items."""
    if features.shape[0] < 2:
        raise ValueError("fitting the extent head needs at least two items with their answer cells")
    x = features.double()
    y = torch.log1p(cells.double().clamp_min(0))
    mean, std = x.mean(0), x.std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))  # constant features: weight 0 after the ridge
    z = torch.cat([(x - mean) / std, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    reg = ridge * torch.eye(z.shape[1], dtype=x.dtype)
    reg[-1, -1] = 0.0  # the intercept is not shrunk
    w = torch.linalg.solve(z.T @ z + reg, z.T @ y)
    head.mean.copy_(mean.float())
    head.std.copy_(std.float())
    head.weight.copy_(w[:-1].float())
    head.bias.copy_(w[-1].float())
    residual = y - z @ w
    return float(1 - residual.pow(2).mean() / y.var(unbiased=False).clamp_min(1e-12))


__all__ = ["ExtentHead", "fit_extent_head", "map_features", "pooled_query", "N_MAP_FEATURES"]
