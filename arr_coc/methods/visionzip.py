"""`visionzip`: dominant tokens by attention received in the vision tower, plus merged context.

VisionZip — S. Yang, Y. Chen, Z. Tian, C. Wang, J. Li, B. Yu, J. Jia, "VisionZip: Longer
is Better but Not Necessary in Vision Language Models", CVPR 2025 (arXiv:2412.04467).

VisionZip selects before the language model, from the vision encoder's own attention:
- dominant tokens: the tokens that receive the most attention in the encoder layer
  whose output the LM uses. CLIP models rank by the [CLS] token's attention; for
  encoders without [CLS] (SigLIP in the paper) the score is the MEAN attention a token
  receives, over heads and over all query tokens. Qwen's vision tower has no [CLS]
  token, so we use the mean attention received in its LAST block (the block before the
  merger) and average the 2x2 patches of each merged token;
- contextual tokens: the remaining tokens are merged by similarity into a few: target
  tokens are taken uniformly (a fixed stride) from the remaining tokens, every other
  remaining token joins the target whose key is most similar (dot product of normalised
  keys of that same block, mean over the merged token's patches), and each group is
  averaged. The paper keeps dominant : contextual = 54 : 10 (64 tokens on LLaVA-1.5);
  we keep that ratio, round(K * 10 / 64) contextual tokens.

Where a merged contextual token sits: Qwen gives every visual token an M-RoPE (t, h, w)
position, so a merged token needs one. We place it at its TARGET token's cell: the target
is a member of the group, groups are formed around targets spread at a fixed stride over
the image, and the members are the tokens most similar to the target, so the target's
cell is the group's natural representative, it is a cell no kept token occupies (indices
stay unique), and the LM reads the kept tokens in raster order as usual. The merged value
replaces the target's merger output (`Selection.visual_tokens`). The authors' public
code adds the target to the mean of its members; we average the whole group (target
included), which keeps the token at the scale the LM was trained on. On Qwen3-VL the
deepstack features of a contextual token are the target's own (not merged).

Cost: VisionZip needs the attention weights of the last vision block, which flash/SDPA
attention never materialises. `LastBlockRecorder` records that block's query/key
projections and rotary tables during the vision pass the wrapper runs anyway, and
`attention_received` recomputes only the Q K^T softmax (the extra work VisionZip pays).
Without a recorder (e.g. `method="visionzip"` by name) the selector re-runs the vision
tower under its own recorder, which costs a second vision pass.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from ..attending import topk_indices
from ..selection import Selection, SelectionContext, register_selector
from ._common import check_count

DOMINANT, CONTEXTUAL = 54, 10   # the paper's split of 64 kept tokens


def contextual_count(k: int) -> int:
    """How many of k kept tokens are merged contextual tokens (the paper's 10 in 64; none below 2)."""
    return 0 if k < 2 else min(k - 1, int(round(k * CONTEXTUAL / (DOMINANT + CONTEXTUAL))))


def visionzip_select(received: torch.Tensor, keys: torch.Tensor, tokens: torch.Tensor, k: int,
                     n_contextual: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """VisionZip for one image.

    received [n]: mean attention each merged token receives; keys [n, Dk]: its key; tokens [n, D]:
    the merger output. Returns (kept LongTensor[k] ascending, tokens_out [n, D]) where tokens_out
    equals tokens except at the contextual targets, which hold their group's mean.
    """
    n = tokens.shape[0]
    k = check_count(k, n)
    if k == n:
        return torch.arange(n), tokens
    c = contextual_count(k) if n_contextual is None else max(0, min(int(n_contextual), k - 1))
    dominant = topk_indices(received, k - c)                            # ascending
    if c == 0:
        return dominant, tokens
    rest_mask = torch.ones(n, dtype=torch.bool)
    rest_mask[dominant] = False
    rest = rest_mask.nonzero().squeeze(1)                                # ascending raster order
    step = max(1, rest.numel() // c)
    local_targets = torch.arange(0, rest.numel(), step)[:c]
    targets = rest[local_targets]
    is_target = torch.zeros(rest.numel(), dtype=torch.bool)
    is_target[local_targets] = True
    members = rest[~is_target]
    out = tokens.clone()
    if members.numel():
        kn = F.normalize(keys.float(), dim=-1)
        group = (kn[members] @ kn[targets].T).argmax(dim=1)              # [m] -> target slot
        total = tokens[targets].float().clone()
        count = torch.ones(c, device=tokens.device)                      # the tokens' device (a GPU's too)
        total.index_add_(0, group, tokens[members].float())
        count.index_add_(0, group, torch.ones(members.numel(), device=tokens.device))
        out[targets] = (total / count[:, None]).to(tokens.dtype)
    kept = torch.cat([dominant, targets]).sort().values
    return kept, out


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


def make_selector(recorder: LastBlockRecorder | None = None, n_contextual: int | None = None):
    """A VisionZip selector; with a recorder it reads the vision pass the wrapper ran (no second pass)."""

    def select(ctx: SelectionContext) -> Selection:
        if all(k >= h * w for k, (h, w) in zip(ctx.counts, ctx.grid_hw)):
            return Selection(kept=[torch.arange(h * w) for h, w in ctx.grid_hw])
        model = ctx.vlm.model
        grid_thw = ctx.inputs["image_grid_thw"]
        if recorder is not None:
            record = recorder.last
        else:  # standalone: run the vision tower again, recording its last block
            with LastBlockRecorder(model) as own:
                model.model.get_image_features(ctx.inputs["pixel_values"], grid_thw, return_dict=True)
            record = own.last
        per_image = attention_received(model.model.visual, record, grid_thw)
        kept, tokens = [], []
        for g, v, k in zip(ctx.image_ids, ctx.visual_tokens, ctx.counts):
            received, keys = per_image[g]
            idx, out = visionzip_select(received, keys, v, k, n_contextual)
            kept.append(idx)
            tokens.append(out if out is not v else None)
        return Selection(kept=kept, visual_tokens=tokens)

    select.__name__ = "visionzip"
    return select


select = make_selector()
register_selector("visionzip", select, overwrite=True)

__all__ = ["LastBlockRecorder", "attention_received", "contextual_count", "make_selector", "select",
           "visionzip_select"]
