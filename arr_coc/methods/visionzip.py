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
attention never materialises. The backend records that block's query/key projections and
rotary tables during the vision pass the pipeline runs anyway (the registry marks VisionZip
`tower_attention`), and recomputes only the Q K^T softmax (`VLMBackend.tower_attention`: the
extra work VisionZip pays). A context whose pass was not recorded (the selector called on
its own) costs a second vision pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.attending import topk_indices
from ..pipeline.backend import TowerAttention, require
from ..pipeline.selection import Selection, SelectionContext, register_selector
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


def make_selector(n_contextual: int | None = None):
    """A VisionZip selector: the tower's last-block attention through the backend (recorded during the
    pipeline's own tower pass when there was one)."""

    def select(ctx: SelectionContext) -> Selection:
        if all(k >= h * w for k, (h, w) in zip(ctx.counts, ctx.grid_hw)):
            return Selection(kept=[torch.arange(h * w) for h, w in ctx.grid_hw])
        kept, tokens = [], []
        backend = require(ctx.backend, TowerAttention, "give the tower's attention to VisionZip")
        for (received, keys), v, k in zip(backend.tower_attention(ctx.prompt, ctx.image_ids),
                                          ctx.visual_tokens, ctx.counts):
            idx, out = visionzip_select(received, keys, v, k, n_contextual)
            kept.append(idx)
            tokens.append(out if out is not v else None)
        return Selection(kept=kept, visual_tokens=tokens)

    select.__name__ = "visionzip"
    return select


select = make_selector()
register_selector("visionzip", select, overwrite=True)

__all__ = ["contextual_count", "make_selector", "select", "visionzip_select"]
