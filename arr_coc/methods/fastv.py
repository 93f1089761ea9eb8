"""`fastv`: keep the visual tokens the last prompt token attends to most at an early LM layer.

FastV — L. Chen, H. Zhao, T. Liu, S. Bai, J. Lin, C. Zhou, B. Chang, "An Image is Worth
1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024 (arXiv:2403.06764).

FastV observes that after the first couple of LM layers most visual tokens receive very
little attention, so it ranks them by the attention they receive at layer K and drops
the rest for the remaining layers (K = 2 by default). As in the authors' code, the score
of a visual token is the attention weight from the LAST prompt token to it, averaged
over heads, in the K-th layer (1-based: the attention map of `layers[K - 1]`).

Through the pipeline the procedure is:
1. the backend runs the LM prefix, layers 1..K, on the UNPRUNED prompt and returns that attention
   (`VLMBackend.text_attention`; the Qwen backend's is `arr_coc.qwen.attention.last_token_attention`:
   eager attention on this instance only, stopped right after the attention of layer K);
2. keep the top-K_i visual tokens of each image by that score;
3. the pipeline prefills the pruned prompt from layer 1.

Difference from the paper, on purpose: FastV keeps all tokens in layers 1..K of the one
real prefill and prunes in place; here the K-layer prefix is an extra partial prefill
and the pruned prompt then runs every layer. It costs K layers more than FastV's own
schedule (the evaluation counts that cost in FLOPs and latency), and the first K layers
of the answer's KV cache hold only the kept tokens. A hook inside the LM would avoid the
extra prefix, but an in-forward LM hook is silently wrong for padded batches (docs/DESIGN.md).
"""

from __future__ import annotations

import torch

from ..core.attending import topk_indices
from ..pipeline.backend import TextAttention, require
from ..pipeline.selection import Selection, SelectionContext, register_selector
from ._common import check_count

DEFAULT_LAYER = 2


def fastv_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k visual tokens with the highest attention scores [n]: LongTensor[k] ascending (ties: lower index)."""
    return topk_indices(scores, check_count(k, scores.numel()))


def image_scores(ctx: SelectionContext, layer: int = DEFAULT_LAYER) -> list[torch.Tensor]:
    """Per unit of ctx, the FastV score [n_i] of each of its visual tokens (raster order). ctx holds every unit
    of its rows, in prompt order (selection contexts are split by item)."""
    backend = require(ctx.backend, TextAttention, "give the language model's attention to FastV")
    return backend.text_attention(ctx.prompt, ctx.image_ids, ctx.visual_tokens, ctx.side_features, layer)


def make_selector(layer: int = DEFAULT_LAYER):
    """A FastV selector that scores at LM layer `layer` (1-based)."""

    def select(ctx: SelectionContext) -> Selection:
        if all(k >= h * w for k, (h, w) in zip(ctx.counts, ctx.grid_hw)):
            return Selection(kept=[torch.arange(h * w) for h, w in ctx.grid_hw])   # nothing to prune: no prefix
        scores = image_scores(ctx, layer)
        return Selection(kept=[fastv_indices(s, k) for s, k in zip(scores, ctx.counts)])

    select.__name__ = "fastv"
    return select


select = make_selector()
register_selector("fastv", select, overwrite=True)

__all__ = ["fastv_indices", "image_scores", "make_selector", "select"]
