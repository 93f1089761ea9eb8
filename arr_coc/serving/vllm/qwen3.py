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
- Clips (before the tower only, `settings.clips_served`): Qwen3-VL's prompt holds each frame group's pads between
  its own timestamp text and <|vision_start|> / <|vision_end|> (`get_video_repl`, qwen3_vl.py:1754-1815), so each
  group's count is fixed when the prompt is written: the processor runs the space-time choice
  (`ProcessorChoice`) and writes each group's kept count; the model encodes those cells (`CLIP_KEPT_KEY`), and
  each group's kept cells sit at their own (0, h, w) after its timestamp, as an image would
  (`frame_group_positions`, `frame_group_spans`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from vllm.model_executor.models.qwen3_vl import (Qwen3VLDummyInputsBuilder, Qwen3VLForConditionalGeneration,
                                                 Qwen3VLMultiModalProcessor, Qwen3VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing import PromptReplacement, PromptUpdateDetails

from .serving import CLIPS, ARRCOCInfo, ARRCOCModel, ARRCOCProcessor, Media, packed_bounds, sequence_metadata
from .settings import (CLIP_KEPT_KEY, Placed, cell_rows, frame_group_positions, frame_group_spans, group_counts,
                       kept_positions)

FAMILY = "qwen3_vl"


class ARRCOCQwen3VLProcessingInfo(ARRCOCInfo, Qwen3VLProcessingInfo):
    family = FAMILY

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        """Qwen3-VL's scopes where this server takes clips; else the base's: Qwen3-VL's adds video kwargs to a
        "videos_kwargs" scope (qwen3_vl.py:949-957) that the base makes only where videos are taken
        (multimodal/processing/context.py:486-489), so an images-only info would fail there with KeyError
        'videos_kwargs'."""
        if "video" in self.get_supported_mm_limits():
            return super().get_supported_mm_processor_kwargs()
        return super(Qwen3VLProcessingInfo, self).get_supported_mm_processor_kwargs()


class ARRCOCQwen3VLProcessor(ARRCOCProcessor, Qwen3VLMultiModalProcessor):

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[PromptReplacement]:
        """Images: the plugin's (their kept count). Clips (chosen here, `CLIP_KEPT_KEY`): stock vLLM's prompt, the
        same target (the bare pad under transformers >= 5.10, else the whole vision_start / pad / vision_end,
        qwen3_vl.py:1730-1740) and per frame group its timestamp text, <|vision_start|>, its kept count of pads and
        <|vision_end|> (`get_video_repl`); only the pads take the clip's rows."""
        images = [u for u in super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
                  if u.modality != CLIPS.modality]
        config = self.info.get_hf_config()
        video, start = int(config.video_token_id), int(config.vision_start_token_id)
        end = int(config.vision_end_token_id)
        bare = self._expands_only_video_token(self.info.get_hf_processor(**hf_processor_mm_kwargs))
        return images + [PromptReplacement(modality=CLIPS.modality, target=[video] if bare else [start, video, end],
                                           replacement=partial(self._clip_replacement, out_mm_kwargs))]

    def _clip_replacement(self, out_mm_kwargs: Any, item_idx: int) -> PromptUpdateDetails:
        """One clip's tokens: per frame group its timestamp, <|vision_start|>, as many pads as the processor's
        choice kept in the group (`group_counts`), <|vision_end|>; the pads alone marked for its rows."""
        item = out_mm_kwargs[CLIPS.modality][item_idx]
        config = self.info.get_hf_config()
        merge = int(config.vision_config.spatial_merge_size)
        t, h, w = (int(v) for v in item[CLIPS.grid].data.tolist())
        per_group = group_counts(item[CLIP_KEPT_KEY].data, t, (h // merge) * (w // merge))
        return Qwen3VLMultiModalProcessor.get_video_repl(
            tokens_per_frame=per_group, timestamps=item["timestamps"].data, tokenizer=self.info.get_tokenizer(),
            vision_start_token_id=int(config.vision_start_token_id),
            vision_end_token_id=int(config.vision_end_token_id), video_token_id=int(config.video_token_id),
            select_token_id=True)


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

    def arr_coc_positions(self, media: Media, cells: torch.Tensor, grid_hw: tuple[int, int], groups: int,
                          factor: float) -> torch.Tensor:
        """A clip's kept cells: each from its own frame group's first pad (`frame_group_positions`)."""
        if media is CLIPS:
            return frame_group_positions(cells, grid_hw)
        return kept_positions(cells, grid_hw, groups, factor)

    def arr_coc_placed(self, feature: Any, input_tokens: list[int]) -> list[Placed]:
        """A clip's pads: one run per frame group, each between its <|vision_start|> and <|vision_end|>
        (`frame_group_spans`), each laid out like an image (vLLM's `_iter_mm_grid_hw`, qwen3_vl.py:2796-2874)."""
        if feature.modality != CLIPS.modality:
            return super().arr_coc_placed(feature, input_tokens)
        merge = int(self.config.vision_config.spatial_merge_size)
        _, h, w = (int(v) for v in feature.data[CLIPS.grid].data.tolist())
        start = feature.mm_position.offset
        spans = frame_group_spans(input_tokens, start, start + feature.mm_position.length,
                                  int(self.config.vision_start_token_id), int(self.config.vision_end_token_id))
        return [Placed(offset, pads, h // merge, w // merge) for offset, pads in spans]
