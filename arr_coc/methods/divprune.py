"""`divprune`: keep the most diverse K visual tokens (max-min diversity).

DivPrune — S. R. Alvar, G. Singh, M. Akbari, Y. Zhang, "DivPrune: Diversity-based
Visual Token Pruning for Large Multimodal Models", CVPR 2025 (arXiv:2503.02175).

The paper casts pruning as the Max-Min Diversity Problem: choose K of the N visual
tokens so that the smallest pairwise distance inside the kept set is as large as
possible, with the cosine distance d(i, j) = 1 - cos(v_i, v_j) between the tokens the
language model receives. It is solved greedily: the first token is the one whose
nearest neighbour is farthest away, then each step adds the token whose distance to the
kept set (its minimum distance to any kept token) is largest. The selection ignores the
question and the image layout.

For Qwen-VL the tokens are the merger outputs V_i [n_i, D] (what the LM sees), per
image; a multi-image prompt runs the greedy per image with that image's budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..pipeline.selection import Selection, SelectionContext, register_selector
from ._common import check_count


def cosine_distances(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [n, D] -> [n, n] cosine distances 1 - cos(v_i, v_j), in [0, 2]."""
    x = F.normalize(tokens.float(), dim=-1)
    return (1.0 - x @ x.T).clamp_min_(0.0)


def divprune_indices(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy max-min diverse subset of tokens [n, D]: LongTensor[k] raster indices, ascending.

    Ties go to the lower index (argmax returns the first maximum), so the result is deterministic.
    """
    n = tokens.shape[0]
    k = check_count(k, n)
    if k == n:
        return torch.arange(n)
    dist = cosine_distances(tokens)                                      # [n, n]
    if n == 1:
        return torch.zeros(1, dtype=torch.long)
    # First token: the largest nearest-neighbour distance (self-distance 0 excluded).
    nearest = dist.masked_fill(torch.eye(n, dtype=torch.bool, device=dist.device), float("inf")).min(dim=1).values
    first = int(torch.argmax(nearest))
    chosen = [first]
    taken = torch.zeros(n, dtype=torch.bool, device=dist.device)      # the tokens' device (a GPU's too)
    taken[first] = True
    to_set = dist[first].clone()                                         # [n] distance to the kept set
    for _ in range(k - 1):
        j = int(torch.argmax(to_set.masked_fill(taken, -1.0)))
        chosen.append(j)
        taken[j] = True
        to_set = torch.minimum(to_set, dist[j])
    return torch.tensor(sorted(chosen), dtype=torch.long)


def select(ctx: SelectionContext) -> Selection:
    """DivPrune per image over the merger outputs, K_i = ctx.counts[i]."""
    return Selection(kept=[divprune_indices(v, k) for v, k in zip(ctx.visual_tokens, ctx.counts)])


register_selector("divprune", select, overwrite=True)

__all__ = ["cosine_distances", "divprune_indices", "select"]
