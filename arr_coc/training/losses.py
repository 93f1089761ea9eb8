"""What the scorers learn from: stage 1's ranking loss on the answer's cells, stage 2's answer loss
through a soft mask on the frozen VLM's attention, the coverage they are validated on, and
health checks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..core.attending import topk_indices
from ..budget import resolve_count
from ..core.layer import ARRCOCLayer, pad_grid
from .features import Features

if TYPE_CHECKING:
    from ..front import ARRCOC


def batch_scores(layer: ARRCOCLayer, items: list[Features]) -> dict[str, torch.Tensor]:
    """The layer's differentiable maps for a list of items (padded batch); adds 'valid' and 'target'."""
    grids = [f.grid_hw for f in items]
    tokens = None if any(f.visual_tokens is None for f in items) else [f.visual_tokens for f in items]
    # The texture arrays are computed where the features live (the CPU), then the padded batch goes to
    # the layer's device (a no-op on the CPU).
    padded = layer.pad_inputs([f.image.float() / 255 for f in items], grids, [f.query for f in items], tokens)
    device = next(layer.parameters()).device
    tex, valid, query, qmask, vis = (None if t is None else t.to(device) for t in padded)
    maps = layer.score(tex, valid, query, qmask, vis)
    maps["valid"] = valid
    maps["target"] = pad_grid([f.target.reshape(h, w) for f, (h, w) in zip(items, grids)], *valid.shape[1:]).to(device)
    return maps


def ranking_loss(relevance: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, tau: float) -> torch.Tensor:
    """Listwise: cross-entropy of softmax(relevance / tau) over the image's cells against the target shares.

    relevance, valid, target: [B, h, w] (target: weights >= 0, normalised per item here). Items
    without answer cells are skipped.
    """
    logits = (relevance / tau).masked_fill(~valid, -1e4).flatten(1)
    logp = torch.log_softmax(logits, dim=-1)
    t = target.flatten(1).float()
    has = t.sum(1) > 0
    if not has.any():
        return relevance.sum() * 0.0
    per_item = -(logp * t).sum(1) / t.sum(1).clamp_min(1)
    return per_item[has].mean()


def coverage(relevance: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, grids, budget: float) -> float:
    """Mean share of the answer's target weight (its boxes' area) inside the top-k, over items with answer cells."""
    out = []
    for i, (h, w) in enumerate(grids):
        t = target[i, :h, :w].reshape(-1)
        if not t.any():
            continue
        kept = topk_indices(relevance[i, :h, :w].reshape(-1), resolve_count(budget, h * w))
        out.append(float(t[kept].float().sum() / t.float().sum()))
    return sum(out) / max(1, len(out))


def soft_keep(relevance: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """relevance [N] -> m [N] in (0, 1): ~1 for the top k, ~0 below, differentiable.

    The sigmoid is taken on relevance standardised over the image, so the relaxation is
    scale-free: flattening every score (which would let all tokens through at m = 0.5)
    does not pay.
    """
    n = relevance.numel()
    if k >= n:
        return torch.ones_like(relevance)
    z = (relevance - relevance.mean()) / (relevance.std() + 1e-6)
    top = torch.topk(z.detach(), k + 1).values
    threshold = 0.5 * (top[k - 1] + top[k])
    return torch.sigmoid((z - threshold) / temperature)


def answer_loss(vlm: ARRCOC, items: list[Features], relevance: torch.Tensor, budget: float,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Cross-entropy of the answers with visual tokens softly masked by relevance (`soft_keep`), through the frozen
    VLM (`VLMBackend.soft_answer_loss`: the mask enters the language model's attention as log m on each visual
    token's column).

    Returns (answer loss, budget penalty = mean (soft kept share - budget share)^2, soft kept share).
    """
    backend = vlm.backend
    losses, shares, kept_share = [], [], []
    for i, f in enumerate(items):
        h, w = f.grid_hw
        m = soft_keep(relevance[i, :h, :w].reshape(-1), resolve_count(budget, h * w), temperature)
        lm = f.lm_tokens if f.lm_tokens is not None else f.visual_tokens
        losses.append(backend.soft_answer_loss(f.prompt, lm, f.answer, m))
        shares.append((m.mean() - resolve_count(budget, h * w) / (h * w)) ** 2)
        kept_share.append(float(m.detach().mean()))
    return torch.stack(losses).mean(), torch.stack(shares).mean(), sum(kept_share) / len(kept_share)


def health(maps: dict[str, torch.Tensor], grids, grad_norm: float) -> list[str]:
    """Warnings: collapsed scores, exploding gradients, allocations collapsing to one region."""
    warnings = []
    rel, valid = maps["relevance"], maps["valid"]
    std = float(rel[valid].detach().std()) if valid.sum() > 1 else 0.0
    if std < 1e-3:
        warnings.append(f"relevance collapsed (std {std:.2e})")
    if not math.isfinite(grad_norm) or grad_norm > 100:
        warnings.append(f"exploding gradient (norm {grad_norm:.1f})")
    spreads = []
    for i, (h, w) in enumerate(grids):
        k = resolve_count(0.1, h * w)
        idx = torch.topk(rel[i, :h, :w].reshape(-1).detach(), k).indices
        ys, xs = (idx // w).float() / max(1, h - 1), (idx % w).float() / max(1, w - 1)
        spreads.append(float(ys.std() + xs.std()) if k > 1 else 1.0)
    if spreads and sum(spreads) / len(spreads) < 0.05:
        warnings.append("allocations collapsed to one region (top-10% cells within ~5% of the image)")
    return warnings
