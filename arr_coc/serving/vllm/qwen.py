"""vLLM's Qwen2-VL with ARR-COC (docs/SERVING.md, "Design"); what the families share is `serving.py`. Imported by
vLLM only.

Before the tower, the tower runs on the kept cells only: vLLM's `Qwen2VisionTransformer.forward` takes its rotary
tables and sequence bounds as `encoder_metadata` (qwen2_vl.py:717-753), so they are the full grid's rows of the
kept patches and one sequence per image, as the project's `encode_packed` gives transformers' tower.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.models.interfaces import SupportsMultiModalPruning
from vllm.model_executor.models.qwen2_vl import (Qwen2VLDummyInputsBuilder, Qwen2VLForConditionalGeneration,
                                                 Qwen2VLMultiModalProcessor, Qwen2VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY

from .serving import ARRCOCInfo, ARRCOCModel, ARRCOCProcessor
from .settings import cell_rows

FAMILY = "qwen2_vl"


class ARRCOCQwen2VLProcessingInfo(ARRCOCInfo, Qwen2VLProcessingInfo):
    family = FAMILY


class ARRCOCQwen2VLProcessor(ARRCOCProcessor, Qwen2VLMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(ARRCOCQwen2VLProcessor, info=ARRCOCQwen2VLProcessingInfo,
                                        dummy_inputs=Qwen2VLDummyInputsBuilder)
class ARRCOCQwen2VL(ARRCOCModel, Qwen2VLForConditionalGeneration, SupportsMultiModalPruning):
    """Qwen2-VL serving ARR-COC's kept cells, after or before the tower."""

    family = FAMILY

    def encode_kept(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kept: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The tower on the kept cells only, at their true positions, each image's cells attending to each other
        (module docstring). -> per image [K_i, D]."""
        merge = int(self.config.vision_config.spatial_merge_size)
        thw = [[int(v) for v in g] for g in grid_thw.tolist()]
        rows = cell_rows(thw, kept, merge).to(pixel_values.device)
        full = self.visual.prepare_encoder_metadata(thw)
        sizes = torch.tensor([0] + [int(k.numel()) * merge * merge for k in kept])
        cu = sizes.cumsum(0).to(torch.int32)
        meta = {"rotary_pos_emb_cos": full["rotary_pos_emb_cos"][rows.to(full["rotary_pos_emb_cos"].device)],
                "rotary_pos_emb_sin": full["rotary_pos_emb_sin"][rows.to(full["rotary_pos_emb_sin"].device)],
                "cu_seqlens": cu.to(full["cu_seqlens"].device), "max_seqlen": self.visual.compute_attn_mask_seqlen(cu)}
        tokens = self.visual(pixel_values[rows], None, encoder_metadata=meta)
        return list(tokens.split([int(k.numel()) for k in kept]))
