"""`fastv`: keep the visual tokens the last prompt token attends to most at an early LM layer.

FastV — L. Chen, H. Zhao, T. Liu, S. Bai, J. Lin, C. Zhou, B. Chang, "An Image is Worth
1/2 Tokens After Layer 2: Plug-and-Play Inference Acceleration for Large
Vision-Language Models", ECCV 2024 (arXiv:2403.06764).

FastV observes that after the first couple of LM layers most visual tokens receive very
little attention, so it ranks them by the attention they receive at layer K and drops
the rest for the remaining layers (K = 2 by default). As in the authors' code, the score
of a visual token is the attention weight from the LAST prompt token to it, averaged
over heads, in the K-th layer (1-based: the attention map of `layers[K - 1]`).

For Qwen-VL through the input-rewriting path (arr_coc/qwen/rewrite.py) the procedure is:
1. run the LM prefix, layers 1..K, on the UNPRUNED prompt (original M-RoPE positions,
   the merger's visual tokens, Qwen3-VL deepstack features) with eager attention on this
   instance only (the only implementation that returns weights), and stop right after
   the attention of layer K: no MLP of layer K, no later layer, no LM head;
2. keep the top-K_i visual tokens of each image by that score;
3. the caller prefills the pruned prompt from layer 1.

Difference from the paper, on purpose: FastV keeps all tokens in layers 1..K of the one
real prefill and prunes in place; here the K-layer prefix is an extra partial prefill
and the pruned prompt then runs every layer. It costs K layers more than FastV's own
schedule (the evaluation counts that cost in FLOPs and latency), and the first K layers
of the answer's KV cache hold only the kept tokens. A hook inside the LM would avoid the
extra prefix, but an in-forward LM hook is silently wrong for padded batches (docs/DESIGN.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..attending import topk_indices
from ..selection import Selection, SelectionContext, register_selector
from ._common import check_count, eager_attention, rows_of

DEFAULT_LAYER = 2


class _PrefixDone(Exception):
    """Raised by the hook after layer K's attention: the rest of the forward is not needed.

    Why an exception through transformers' forward: transformers 5.23 offers no way to stop a
    decoder stack early. Its text models loop `for decoder_layer in self.layers` with no exit,
    `output_attentions` / the output-capturing hooks record but never stop, and `num_hidden_layers`
    is read at construction only. The alternatives cost more or are less safe: truncating
    `language_model.layers` on the instance mutates the shared model while the app may serve
    another request, and still runs layer K's MLP and the final norm; re-implementing the stack
    (masks, M-RoPE, Qwen3-VL deepstack injection) would copy transformers' code. The exception is
    raised from a hook on this call's attention module only, caught right here, and the hook is
    removed in `finally`, so nothing outlives the call.
    """


def encoder_output(model: Any, visual_tokens: list[torch.Tensor], deepstack: list[list[torch.Tensor]] | None = None):
    """A vision-encoder output carrying precomputed visual tokens (and Qwen3-VL deepstack features)."""
    from ..qwen.encoding import encoder_output_class

    cls = encoder_output_class(model)
    if deepstack is None:
        return cls(pooler_output=tuple(visual_tokens))
    n_layers = len(deepstack[0]) if deepstack else 0
    return cls(pooler_output=tuple(visual_tokens),
               deepstack_features=[tuple(img[l] for img in deepstack) for l in range(n_layers)])


@torch.no_grad()
def last_token_attention(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                         encoder_out: Any, layer: int = DEFAULT_LAYER) -> torch.Tensor:
    """Attention from the last prompt token to every position at LM layer `layer` (1-based), mean over heads.

    input_ids / attention_mask [B, S] left-padded (so position -1 is each row's last prompt token),
    position_ids [3, B, S] the unpruned M-RoPE positions, encoder_out the image features of
    every image in these rows. Returns [B, S] float32. Runs layers 1..layer only.
    """
    core = model.model
    lm = core.language_model
    n_layers = len(lm.layers)
    if not 1 <= layer <= n_layers:
        raise ValueError(f"FastV layer K={layer} is outside this LM's 1..{n_layers} layers; pass a K in that range")
    found: dict[str, torch.Tensor] = {}

    def grab(module, args, kwargs, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise RuntimeError("the attention layer returned no weights; FastV needs eager attention")
        found["w"] = weights[:, :, -1, :].float().mean(dim=1)            # [B, S]
        raise _PrefixDone

    handle = lm.layers[layer - 1].self_attn.register_forward_hook(grab, with_kwargs=True)
    try:
        with eager_attention(lm):
            core(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 mm_encoder_outputs={"image": encoder_out}, use_cache=False)
    except _PrefixDone:
        pass
    finally:
        handle.remove()
    if "w" not in found:
        raise RuntimeError(f"LM layer {layer} did not run; cannot score visual tokens for FastV")
    return found["w"]


def fastv_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k visual tokens with the highest attention scores [n]: LongTensor[k] ascending (ties: lower index)."""
    return topk_indices(scores, check_count(k, scores.numel()))


def image_scores(ctx: SelectionContext, layer: int = DEFAULT_LAYER) -> list[torch.Tensor]:
    """Per image of ctx, the FastV score [n_i] of each of its visual tokens (raster order)."""
    rows = rows_of(ctx.item_of_image)
    ids = ctx.inputs["input_ids"][rows]
    mask = ctx.inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask[rows]
    model = ctx.vlm.model
    # ctx holds every image of these rows, in prompt order (selection contexts are split by item).
    enc = encoder_output(model, list(ctx.visual_tokens), ctx.deepstack_features)
    attn = last_token_attention(model, ids, mask, ctx.position_ids[:, rows], enc, layer)   # [len(rows), S]
    local = {b: j for j, b in enumerate(rows)}
    return [attn[local[b], s:e] for b, s, e in ctx.image_spans]


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

__all__ = ["encoder_output", "fastv_indices", "image_scores", "last_token_attention", "make_selector", "select"]
