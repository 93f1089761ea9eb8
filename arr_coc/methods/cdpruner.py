"""`cdpruner`: keep the K visual tokens of maximal conditional diversity (a conditional DPP).

CDPruner — Q. Zhang, M. Liu, L. Li, M. Lu, Y. Zhang, J. Pan, Q. She, S. Zhang, "Beyond
Attention or Similarity: Maximizing Conditional Diversity for Token Pruning in MLLMs",
NeurIPS 2025 (arXiv:2506.10967).

The paper conditions the similarity between visual tokens on the instruction and keeps
the subset a determinantal point process (DPP) finds most likely:

- similarity S_ij = cos(v_i, v_j) between the visual tokens the LM receives;
- relevance r_i = mean over instruction tokens t of cos(v_i, t), min-max normalised to
  [0, 1] per image; optionally r <- exp(alpha r) with alpha = theta / (2 (1 - theta)) to
  soften it (theta = 1, the default here, uses r as is, like the authors' LLaVA code);
- kernel L = diag(r) S diag(r): a token is worth keeping when it is relevant, and two
  tokens are worth keeping together when they are relevant AND different;
- K tokens by greedy MAP inference of the DPP, with the incremental Cholesky update of
  Chen, Zhang & Zhou, "Fast Greedy MAP Inference for Determinantal Point Process to
  Improve Recommendation Diversity", NeurIPS 2018 (O(N K^2)).

Qwen-VL has no CLIP text tower, so both sides are compared in the LM's own input space:
v_i are the merger outputs and t the input embeddings of the question tokens (the
SelectionContext provides both). The authors' public LLaVA code negates the mean cosine
(a property of LLaVA's CLIP features); we keep the paper's reading, higher cosine =
more relevant. When the kernel runs out of rank (K larger than the token width D, or
duplicate tokens) the greedy has no volume left to add; the remaining slots then go to
the most relevant tokens not yet kept, so exactly K are always returned.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..pipeline.selection import Selection, SelectionContext, register_selector
from ._common import check_count

DEFAULT_THETA = 1.0


def relevance_scores(tokens: torch.Tensor, query: torch.Tensor, theta: float = DEFAULT_THETA) -> torch.Tensor:
    """tokens [n, D], query [L, D] -> relevance [n] >= 0 (min-max normalised, then exp-softened if theta < 1)."""
    if not 0.0 < theta <= 1.0:
        raise ValueError(f"theta must be in (0, 1] (1 = relevance as is, smaller = softer), got {theta}")
    v = F.normalize(tokens.float(), dim=-1)
    t = F.normalize(query.float(), dim=-1)
    rel = (v @ t.T).mean(dim=-1)                                         # [n]
    rel = (rel - rel.min()) / (rel.max() - rel.min() + 1e-6)
    if theta < 1.0:
        rel = torch.exp(theta / (2.0 * (1.0 - theta)) * rel)
    return rel


def conditional_kernel(tokens: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """L = diag(r) S diag(r) [n, n] with S the cosine similarity of tokens [n, D]."""
    v = F.normalize(tokens.float(), dim=-1)
    return relevance[:, None] * (v @ v.T) * relevance[None, :]


def dpp_greedy_map(kernel: torch.Tensor, k: int, fallback_scores: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy MAP of a DPP with PSD kernel [n, n]: LongTensor[k], ascending (Chen et al. 2018).

    Each step adds the item with the largest marginal gain d_j^2 (the squared distance of its
    feature vector from the span of the kept ones); c holds the incremental Cholesky rows.
    When no item has gain left (> 1e-9 of the largest diagonal), the rest go by fallback_scores.
    """
    n = kernel.shape[0]
    k = check_count(k, n)
    kernel = kernel.double()
    d2 = torch.diagonal(kernel).clone()                                  # [n] marginal gains
    floor = 1e-9 * float(d2.max().clamp_min(1e-30))
    c = torch.zeros(k, n, dtype=torch.float64, device=kernel.device)   # the tokens' device (a GPU's too)
    taken = torch.zeros(n, dtype=torch.bool, device=kernel.device)
    chosen: list[int] = []
    for i in range(k):
        gains = d2.masked_fill(taken, -math.inf)
        j = int(torch.argmax(gains))
        if float(gains[j]) <= floor:
            break
        chosen.append(j)
        taken[j] = True
        e = (kernel[j] - c[:i, j] @ c[:i]) / math.sqrt(float(d2[j]))    # [n]
        c[i] = e
        d2 = d2 - e * e
    if len(chosen) < k:
        scores = (fallback_scores if fallback_scores is not None else torch.diagonal(kernel)).double()
        order = torch.sort(-scores.masked_fill(taken, -math.inf), stable=True).indices
        chosen.extend(int(j) for j in order[: k - len(chosen)])
    return torch.tensor(sorted(chosen), dtype=torch.long)


def cdpruner_indices(tokens: torch.Tensor, query: torch.Tensor, k: int, theta: float = DEFAULT_THETA) -> torch.Tensor:
    """CDPruner for one image: tokens [n, D], question embeddings [L, D] -> LongTensor[k] ascending."""
    n = tokens.shape[0]
    k = check_count(k, n)
    if k == n:
        return torch.arange(n)
    rel = relevance_scores(tokens, query, theta)
    return dpp_greedy_map(conditional_kernel(tokens, rel), k, fallback_scores=rel)


def make_selector(theta: float = DEFAULT_THETA):
    """A CDPruner selector with relevance softness theta in (0, 1]."""

    def select(ctx: SelectionContext) -> Selection:
        return Selection(kept=[cdpruner_indices(v, q, k, theta)
                               for v, q, k in zip(ctx.visual_tokens, ctx.query_embeds, ctx.counts)])

    select.__name__ = "cdpruner"
    return select


select = make_selector()
register_selector("cdpruner", select, overwrite=True)

__all__ = ["cdpruner_indices", "conditional_kernel", "dpp_greedy_map", "make_selector", "relevance_scores", "select"]
