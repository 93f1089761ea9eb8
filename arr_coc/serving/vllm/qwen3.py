"""vLLM's Qwen3-VL with ARR-COC (docs/SERVING.md, "Design"); what the families share is `serving.py`. Imported by
vLLM only.

- The tower's rows are [token | deepstack features]: `Qwen3_VisionTransformer.forward` concatenates each merged
  cell's deepstack mergers' outputs to its token (qwen3_vl.py:901-904), and `embed_input_ids` splits them off the
  kept rows only after the pads are filled (`_compute_deepstack_embeds`, qwen3_vl.py:3083-3122), so keeping a row
  keeps its deepstack features, and the choice reads the token part (as the Hugging Face path's `pooler_output`).
- Before the tower, the tower runs on the kept cells only: its learned position table, interpolated to the full
  grid (`pos_embeds`, `fast_pos_embed_interpolate`, qwen3_vl.py:744-763), and its rotary tables are the full
  grid's rows of the kept patches, one sequence per image, as the project's `encode_packed` gathers
  `interp_indices` / `interp_weights` and `position_ids` for transformers' tower.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.model_executor.models.qwen3_vl import (Qwen3VLDummyInputsBuilder, Qwen3VLForConditionalGeneration,
                                                 Qwen3VLMultiModalProcessor, Qwen3VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY

from .serving import ARRCOCInfo, ARRCOCModel, ARRCOCProcessor, packed_bounds, sequence_metadata
from .settings import cell_rows

FAMILY = "qwen3_vl"


class ARRCOCQwen3VLProcessingInfo(ARRCOCInfo, Qwen3VLProcessingInfo):
    family = FAMILY

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        """The base's scopes: Qwen3-VL's adds video kwargs to a "videos_kwargs" scope (qwen3_vl.py:949-957) that
        the base makes only where videos are taken (multimodal/processing/context.py:486-489), so an images-only
        info would fail there with KeyError 'videos_kwargs'."""
        return super(Qwen3VLProcessingInfo, self).get_supported_mm_processor_kwargs()


class ARRCOCQwen3VLProcessor(ARRCOCProcessor, Qwen3VLMultiModalProcessor):
    pass


@MULTIMODAL_REGISTRY.register_processor(ARRCOCQwen3VLProcessor, info=ARRCOCQwen3VLProcessingInfo,
                                        dummy_inputs=Qwen3VLDummyInputsBuilder)
class ARRCOCQwen3VL(ARRCOCModel, Qwen3VLForConditionalGeneration):
    """Qwen3-VL serving ARR-COC's kept cells (with their deepstack features), after or before the tower."""

    family = FAMILY

    def encode_kept(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kept: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The tower on the kept cells only, at their full-grid positions (module docstring).
        -> per image [K_i, D * (1 + deepstack layers)]."""
        visual, dev = self.visual, pixel_values.device
        merge = int(visual.spatial_merge_size)
        thw = [[int(v) for v in g] for g in grid_thw.tolist()]
        full = visual.prepare_encoder_metadata(thw)
        rows = cell_rows(thw, kept, merge).to(dev)
        cu, longest, lengths = sequence_metadata(visual, packed_bounds(kept, merge * merge), dev)
        meta = {key: full[key][rows.to(full[key].device)]
                for key in ("pos_embeds", "rotary_pos_emb_cos", "rotary_pos_emb_sin")}
        meta.update({"cu_seqlens": cu, "max_seqlen": longest, "sequence_lengths": lengths})
        tokens = visual(pixel_values[rows], thw, encoder_metadata=meta)
        return list(tokens.split([int(k.numel()) for k in kept]))
