"""Attention the published pruning methods read, as services of the Qwen backend (their selectors never touch
the model): FastV's attention from the last prompt token at a language-model layer, and VisionZip's attention
received in the vision tower's last block.

FastV runs the LM prefix, layers 1..K, on the UNPRUNED prompt (original M-RoPE positions, the tower's visual
tokens, Qwen3-VL deepstack features) with eager attention on this instance only (the only implementation that
returns weights), and stops right after the attention of layer K: no MLP of layer K, no later layer, no LM head.

VisionZip needs the attention weights of the last vision block, which flash/SDPA attention never materialises.
`LastBlockRecorder` records that block's query/key projections and rotary tables during the tower's pass (the
backend records it during the pipeline's own pass when the selector asks: `Method.tower_attention`), and
`attention_received` recomputes only the Q K^T softmax (the extra work VisionZip pays). Without a record the
tower runs again under a recorder, which costs a second vision pass.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from .encoding import encoder_output_class

DEFAULT_LAYER = 2


@contextlib.contextmanager
def eager_attention(module) -> Iterator[None]:
    """Run `module` (a transformers PreTrainedModel) with eager attention, then restore its implementation.

    Eager attention is the only implementation that returns attention weights. The switch touches this
    one instance's config and is undone on exit, also when the body raises (patch one instance, reversibly: docs/DESIGN.md).
    """
    previous = module.config._attn_implementation
    if previous == "eager":
        yield
        return
    module.set_attn_implementation("eager")
    try:
        yield
    finally:
        module.set_attn_implementation(previous)


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


def encoder_output(model: Any, visual_tokens: list[torch.Tensor], deepstack: list[list[torch.Tensor]] | None = None):
    """A vision-encoder output carrying precomputed visual tokens (and Qwen3-VL deepstack features)."""
    cls = encoder_output_class(model)
    if deepstack is None:
        return cls(pooler_output=tuple(visual_tokens))
    n_layers = len(deepstack[0]) if deepstack else 0
    return cls(pooler_output=tuple(visual_tokens),
               deepstack_features=[tuple(img[l] for img in deepstack) for l in range(n_layers)])


class LastBlockRecorder:
    """Records what the vision tower's last attention block computes, on one model instance.

        with LastBlockRecorder(model) as rec:
            wrapper.prepare(inputs, budget=0.1, method=visionzip.make_selector(rec))

    Hooks (removed on exit): the block's qkv projection output [P, 3 * C] and its rotary
    tables / attention segments (cu_seqlens). `records` holds one entry per vision pass.
    """

    def __init__(self, model: Any):
        self.visual = model.model.visual
        self.records: list[dict[str, Any]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> "LastBlockRecorder":
        attn = self.visual.blocks[-1].attn

        def before(module, args, kwargs):
            self.records.append({"cu_seqlens": kwargs.get("cu_seqlens"),
                                 "position_embeddings": kwargs.get("position_embeddings")})

        def qkv(module, args, output):
            if self.records:
                self.records[-1]["qkv"] = output.detach()

        self._handles = [attn.register_forward_pre_hook(before, with_kwargs=True),
                         attn.qkv.register_forward_hook(qkv)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def last(self) -> dict[str, Any]:
        if not self.records or "qkv" not in self.records[-1]:
            raise RuntimeError("nothing recorded: run the vision tower (wrapper.prepare) inside the recorder")
        return self.records[-1]


@torch.no_grad()
def attention_received(visual: Any, record: dict[str, Any], grid_thw: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per image of a recorded vision pass: (received [n_i], keys [n_i, C]) per MERGED token, raster order.

    received: attention each patch receives in the last block, mean over heads and over the
    queries of its attention segment, then mean over the merged token's patches; keys: the
    block's rotary keys, heads concatenated, mean over the patches.
    """
    attn = visual.blocks[-1].attn
    qkv = record["qkv"]
    P = qkv.shape[0]
    q, k, _ = qkv.reshape(P, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)   # [P, H, d]
    rotate = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb_vision
    cos, sin = record["position_embeddings"]
    q, k = rotate(q, k, cos, sin)
    received = torch.empty(P)
    cu = record["cu_seqlens"].tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        qs, ks = q[s:e].transpose(0, 1).float(), k[s:e].transpose(0, 1).float()      # [H, L, d]
        weights = torch.softmax(qs @ ks.transpose(1, 2) * attn.scaling, dim=-1)       # [H, L, L]
        received[s:e] = weights.mean(dim=0).mean(dim=0)                              # [L]: received by each key
    unit = int(visual.spatial_merge_size) ** 2
    keys = k.reshape(P, -1).float()
    received_m = received.reshape(P // unit, unit).mean(1)                           # per merged token, block order
    keys_m = keys.reshape(P // unit, unit, -1).mean(1)
    order = _block_to_raster(visual, grid_thw)                                      # block position -> raster
    if order is not None:
        received_m = received_m[torch.argsort(order)]
        keys_m = keys_m[torch.argsort(order)]
    counts = (grid_thw.prod(-1) // unit).tolist()
    if sum(counts) != received_m.numel():
        raise RuntimeError(f"the recorded vision pass has {received_m.numel()} merged tokens but the images need "
                           f"{sum(counts)}; record the same images that are being pruned")
    return list(zip(received_m.split(counts), keys_m.split(counts)))


def _block_to_raster(visual: Any, grid_thw: torch.Tensor) -> torch.Tensor | None:
    """Qwen2.5-VL runs its blocks in window order: the raster index of each block position, else None."""
    if not hasattr(visual, "window_size") or not hasattr(visual, "fullatt_block_indexes"):
        return None
    from transformers.vision_utils import get_vision_window_index

    window_index, _ = get_vision_window_index(grid_thw.cpu(), spatial_merge_size=visual.spatial_merge_size,
                                              window_size=visual.window_size, patch_size=visual.patch_size)
    return window_index.long()


__all__ = ["DEFAULT_LAYER", "LastBlockRecorder", "attention_received", "eager_attention", "encoder_output",
           "last_token_attention"]
