"""The vision tower's attention over packed images without reading their lengths on the host.

Stock transformers 5.23 runs Qwen2-VL / Qwen2.5-VL / Qwen3-VL's vision attention in one of two ways: flash
attention over `cu_seqlens` (varlen), or, for eager / sdpa, one call per image after
`torch.split(..., lengths.tolist())`. The second reads the lengths back to the host, which `torch.compile`
cannot capture (a graph break on every block, and no CUDA graph). `PACKED` is an attention implementation
registered with transformers' own `AttentionInterface`; its name contains "flash", which routes the tower to
its `cu_seqlens` branch, and it runs transformers' sdpa on what it is given:

- images of equal length (a fixed-shape bucket: `n * max_seqlen == S`, so every segment is exactly
  `max_seqlen` long): one batched sdpa over [n, heads, L, D], the stock per-image arithmetic;
- otherwise: the segments scattered on the device into a padded batch [n, heads, max_seqlen, D] (each patch's
  segment and place in it computed from `cu_seqlens`), one sdpa over it with the padding keys masked, and the
  rows gathered back: the same attention, O(n x max_seqlen^2) instead of a block-diagonal mask's O(S^2) (a batch
  of 8 images of unequal buckets did 8x the attention arithmetic with the mask).

Only the tower's config is switched, only inside `packed_tower` (the compiled execution's calls); every other
call runs the stock code. `max_seqlen` must be passed by the caller (a host int), as `encode_packed` does.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

PACKED = "arr_coc_packed_flash"   # "flash" in the name routes the tower to its cu_seqlens branch


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query / key / value [1, heads, S, D] packed over images (`cu_seq_lens_q` [n + 1]) -> ([1, S, heads, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        raise ValueError("packed attention needs cu_seqlens (the tower's packed images)")
    _, heads, s, d = query.shape
    n = cu_seq_lens_q.shape[0] - 1
    if isinstance(max_length_q, int) and n * max_length_q == s:        # equal segments: a batch of images
        def per_image(x: torch.Tensor) -> torch.Tensor:                 # [1, H, n * L, D] -> [n, H, L, D]
            return x.reshape(heads, n, max_length_q, d).transpose(0, 1)
        out, _ = sdpa_attention_forward(module, per_image(query), per_image(key), per_image(value), None,
                                        dropout=dropout, scaling=scaling, is_causal=False)
        return out.reshape(1, s, heads, d), None                        # [n, L, H, D] in packed order
    if not isinstance(max_length_q, int):
        raise ValueError("packed attention needs max_seqlen as a host int (the longest segment)")
    cu = cu_seq_lens_q.to(torch.long)
    position = torch.arange(s, device=query.device)
    segment = (position[:, None] >= cu[None, 1:-1]).sum(1)              # [S] the segment each patch belongs to
    place = position - cu.index_select(0, segment)                      # [S] its place in that segment

    def padded(x: torch.Tensor) -> torch.Tensor:                        # [1, H, S, D] -> [n, H, L, D], zeros after
        out = x.new_zeros(n, max_length_q, heads, d)
        return out.index_put((segment, place), x[0].transpose(0, 1)).transpose(1, 2)

    keys = torch.arange(max_length_q, device=query.device)
    valid = (keys[None, :] < (cu[1:] - cu[:-1])[:, None])[:, None, None]   # [n, 1, 1, L] a segment's own keys
    out, _ = sdpa_attention_forward(module, padded(query), padded(key), padded(value), valid, dropout=dropout,
                                    scaling=scaling, is_causal=False)      # [n, L, H, D]
    return out[segment, place][None], None                              # [1, S, H, D] in packed order


def register() -> None:
    """Make `PACKED` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention)


@contextmanager
def packed_tower(model: torch.nn.Module) -> Iterator[None]:
    """The model's vision tower runs `PACKED` inside the block, its own implementation after."""
    register()
    config = model.model.visual.config
    before = config._attn_implementation
    config._attn_implementation = PACKED
    try:
        yield
    finally:
        config._attn_implementation = before


__all__ = ["PACKED", "packed_attention", "packed_tower", "register"]
