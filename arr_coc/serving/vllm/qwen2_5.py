"""vLLM's Qwen2.5-VL with ARR-COC (docs/SERVING.md, "Design"); what the families share is `serving.py`. Imported by
vLLM only.

Before the tower, the tower runs on the kept cells only, with the Hugging Face path's default rules (`encode_cells`
with `EncodeConfig("before")`: no margin, windows not kept whole): each kept cell stays in its FULL-grid attention
window, in the full encoding's order inside it (`arr_coc.qwen.encoding.packed_windows`), and the full-attention
blocks see one sequence per image. vLLM's `Qwen2_5_VisionTransformer.forward` (qwen2_5_vl.py:1082-1143) takes all of
it as `encoder_metadata`: it reorders the patches by `window_index`, reads `rotary_pos_emb_*` already in window order
(`get_rope_by_thw`, qwen2_5_vl.py:810-835) and restores the input order with `reverse_indices` after the merger.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.models.qwen2_5_vl import (Qwen2_5_VLDummyInputsBuilder, Qwen2_5_VLForConditionalGeneration,
                                                   Qwen2_5_VLMultiModalProcessor, Qwen2_5_VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...qwen.encoding import packed_windows
from .serving import ARRCOCInfo, ARRCOCModel, ARRCOCProcessor, packed_bounds, sequence_metadata
from .settings import cell_rows

FAMILY = "qwen2_5_vl"


class ARRCOCQwen2_5_VLProcessingInfo(ARRCOCInfo, Qwen2_5_VLProcessingInfo):
    family = FAMILY


class ARRCOCQwen2_5_VLProcessor(ARRCOCProcessor, Qwen2_5_VLMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(ARRCOCQwen2_5_VLProcessor, info=ARRCOCQwen2_5_VLProcessingInfo,
                                        dummy_inputs=Qwen2_5_VLDummyInputsBuilder)
class ARRCOCQwen2_5_VL(ARRCOCModel, Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL serving ARR-COC's kept cells, after or before the tower."""

    family = FAMILY

    def encode_kept(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kept: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The tower on the kept cells only, each in its full-grid window (module docstring). -> per image
        [K_i, D]."""
        visual, dev = self.visual, pixel_values.device
        merge = int(visual.spatial_merge_size)
        unit = merge * merge
        thw = [[int(v) for v in g] for g in grid_thw.tolist()]
        full = visual.prepare_encoder_metadata(thw)
        order, cu_window, _, rank = packed_windows(visual, grid_thw.cpu(), kept, torch.device("cpu"))
        if not torch.equal(rank, full["reverse_indices"].cpu().long()):
            raise RuntimeError("transformers' and vLLM's Qwen2.5-VL windows differ (get_vision_window_index, "
                               "qwen2_5_vl.py:773-808): the plugin cannot encode before the tower exactly")
        offsets = torch.tensor([0] + [h * w // unit for _, h, w in thw]).cumsum(0)
        cells = torch.cat([o + k.long().cpu() for o, k in zip(offsets.tolist(), kept)])   # [K] global, packed
        window_rows = (rank[cells[order]][:, None] * unit + torch.arange(unit)).reshape(-1)   # full window order
        cu, longest, lengths = sequence_metadata(visual, packed_bounds(kept, unit), dev)
        cu_w, longest_w, lengths_w = sequence_metadata(visual, cu_window.numpy(), dev)
        cos, sin = full["rotary_pos_emb_cos"], full["rotary_pos_emb_sin"]
        meta = {"rotary_pos_emb_cos": cos[window_rows.to(cos.device)],
                "rotary_pos_emb_sin": sin[window_rows.to(sin.device)],
                "window_index": order.to(dev), "reverse_indices": torch.argsort(order).to(dev),
                "cu_seqlens": cu, "cu_window_seqlens": cu_w, "max_seqlen_full": longest, "max_seqlen_window": longest_w,
                "sequence_lengths_full": lengths, "sequence_lengths_window": lengths_w}
        rows = cell_rows(thw, kept, merge).to(dev)
        tokens = visual(pixel_values[rows], None, encoder_metadata=meta)
        return list(tokens.split([int(k.numel()) for k in kept]))
