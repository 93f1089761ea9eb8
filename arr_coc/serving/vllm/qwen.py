"""vLLM's Qwen2-VL with ARR-COC after the vision tower (docs/SERVING.md, "Design"). Imported by vLLM only.

- the processor (`ARRCOCQwen2VLProcessor`) reads each request's budget and question, puts both in the kwargs vLLM
  hashes (so every cache is keyed by image, question and budget), and writes `count_of(budget, cells)` image pads;
- the model (`ARRCOCQwen2VL`) runs the tower on every cell, as stock, then `arr_coc.choose` on the processor's
  patches, the question and the tower's tokens, keeps the chosen tokens and hands vLLM their own M-RoPE positions
  through `SupportsMultiModalPruning` (EVS's 4-channel convention), so the text keeps its unpruned positions, as
  in the Hugging Face path.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from vllm.model_executor.models.interfaces import SupportsMultiModalPruning
from vllm.model_executor.models.qwen2_vl import (Qwen2VLDummyInputsBuilder, Qwen2VLForConditionalGeneration,
                                                 Qwen2VLMultiModalProcessor, Qwen2VLProcessingInfo)
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import PromptReplacement

from ...pipeline.pure import choose
from ...qwen.pixels import PatchImages
from ...qwen.processing import IM_END, VISION_END
from ...qwen.prompt import PromptTokens
from .settings import (BUDGET_KEY, COUNT_KEY, QUESTION_KEY, ServeError, ServeSettings, cell_rows, check_lora,
                       kept_count, kept_positions, place_kept_positions, prompt_positions, question_ids,
                       refuse_clips, request_budget)

ARCH = "ARRCOCQwen2VLForConditionalGeneration"
SHARE_KEY = "arr_coc_share"          # per image: the budget as a share, or -1 where it is a count
FIELDS = (QUESTION_KEY, COUNT_KEY, SHARE_KEY)
PLUGIN_KWARGS = (BUDGET_KEY, QUESTION_KEY)
log = logging.getLogger("arr_coc.serving.vllm")
TRACE = os.environ.get("ARR_COC_VLLM_TRACE")    # a file: each image's kept cells appended there (tests)
TIMING = os.environ.get("ARR_COC_VLLM_TIMING")  # a file: each encoder call's choice and tower seconds (benchmarks)


class ARRCOCQwen2VLProcessingInfo(Qwen2VLProcessingInfo):
    """Images only (a clip is refused by vLLM at the request, as a modality this model does not take)."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def arr_coc_settings(self) -> ServeSettings:
        if not hasattr(self, "_arr_coc_settings"):
            self._arr_coc_settings = ServeSettings.of(self.get_hf_config())
        return self._arr_coc_settings

    def arr_coc_tokens(self) -> PromptTokens:
        if not hasattr(self, "_arr_coc_tokens"):
            cfg, tok = self.get_hf_config(), self.get_tokenizer()
            vocab = tok.get_vocab()
            self._arr_coc_tokens = PromptTokens(
                image=int(cfg.image_token_id), video=int(cfg.video_token_id), vision_end=vocab[VISION_END],
                im_end=vocab[IM_END], pad=0, special=frozenset(getattr(tok, "all_special_ids", []) or []))
        return self._arr_coc_tokens


    def get_hf_processor(self, **kwargs: object) -> Any:
        """vLLM's processor with transformers' PIL image processor, the Hugging Face path's (the project runs
        without torchvision): the torchvision one's `pixel_values` differ from it by a float rounding (2e-7), which
        can move a cell's score across another's. Same settings (`to_dict`), swapped once per cached processor."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = super().get_hf_processor(**kwargs)
        if not isinstance(processor.image_processor, Qwen2VLImageProcessorPil):
            processor.image_processor = Qwen2VLImageProcessorPil.from_dict(processor.image_processor.to_dict())
        return processor


class ARRCOCQwen2VLProcessor(Qwen2VLMultiModalProcessor):
    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        """The request's budget and question join the processor kwargs: vLLM hashes them with the image
        (processing/inputs.py:70-74), and they reach `_call_hf_processor` even on a cache miss without the prompt."""
        kwargs = dict(inputs.hf_processor_mm_kwargs)
        kwargs[BUDGET_KEY] = request_budget(kwargs, self.info.arr_coc_settings())
        kwargs[QUESTION_KEY] = question_ids(inputs.prompt, self.info.arr_coc_tokens())
        return super().apply(dataclasses.replace(inputs, hf_processor_mm_kwargs=kwargs), timing_ctx)

    def _call_hf_processor(self, hf_data: Mapping[str, object], hf_kwargs: Mapping[str, object]) -> Any:
        ours = {k: hf_kwargs[k] for k in PLUGIN_KWARGS if k in hf_kwargs}
        out = super()._call_hf_processor(hf_data, {k: v for k, v in hf_kwargs.items() if k not in PLUGIN_KWARGS})
        grid = out.get("image_grid_thw")
        if grid is None or QUESTION_KEY not in ours:
            return out
        merge = int(self.info.get_hf_config().vision_config.spatial_merge_size)
        budget, n = ours[BUDGET_KEY], len(grid)
        out[QUESTION_KEY] = torch.tensor([list(ours[QUESTION_KEY])] * n, dtype=torch.long).reshape(n, -1)
        out[COUNT_KEY] = torch.tensor([kept_count(budget, g, merge) for g in grid.tolist()], dtype=torch.long)
        out[SHARE_KEY] = torch.full((n,), float(budget) if isinstance(budget, float) else -1.0, dtype=torch.float64)
        return out

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]
                              ) -> Mapping[str, MultiModalFieldConfig]:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        fields.update({k: MultiModalFieldConfig.batched("image", keep_on_cpu=True) for k in FIELDS})
        return fields

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[PromptReplacement]:
        hf_processor = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        pad = self.info.get_tokenizer().get_vocab()[hf_processor.image_token]

        def replacement(item_idx: int) -> list[int]:
            return [pad] * int(out_mm_kwargs["image"][item_idx][COUNT_KEY].data)

        return [PromptReplacement(modality="image", target=[pad], replacement=partial(replacement))]


def _trace(pixel_values: torch.Tensor, grid_thw: torch.Tensor, fields: Mapping[str, Any],
           kept: Sequence[torch.Tensor]) -> None:
    """One JSON line per image to $ARR_COC_VLLM_TRACE (the tests' view of the kept cells): the image's
    fingerprint (its pixel rows' float64 sum), its question's ids, its budget and its kept cells."""
    import json

    rows = grid_thw.prod(-1).tolist()
    pieces = pixel_values.split([int(r) for r in rows])
    with open(TRACE, "a") as f:
        for px, q, c, s, k in zip(pieces, _per_item(fields[QUESTION_KEY]), _per_item(fields[COUNT_KEY]),
                                  _per_item(fields[SHARE_KEY]), kept):
            f.write(json.dumps({"fingerprint": round(float(px.double().sum()), 3), "question": q.tolist(),
                                "count": int(c), "share": float(s), "kept": k.tolist()}) + "\n")


def _timing(images: int, choose_s: float, tower_s: float) -> None:
    """One JSON line per encoder call to $ARR_COC_VLLM_TIMING (scripts/vllm_bench.py): its images, the seconds
    inside the choice (`arr_coc_choose`) and in the tower (every cell after, the kept cells before)."""
    import json

    with open(TIMING, "a") as f:
        f.write(json.dumps({"images": images, "choose_s": choose_s, "tower_s": tower_s}) + "\n")


def _per_item(value: Any) -> list[torch.Tensor]:
    """A batched field as one tensor per item (stacked when the shapes agreed, a list otherwise)."""
    return list(value) if isinstance(value, (list, tuple)) else list(value.unbind(0))


@MULTIMODAL_REGISTRY.register_processor(ARRCOCQwen2VLProcessor, info=ARRCOCQwen2VLProcessingInfo,
                                        dummy_inputs=Qwen2VLDummyInputsBuilder)
class ARRCOCQwen2VL(Qwen2VLForConditionalGeneration, SupportsMultiModalPruning):
    """Qwen2-VL serving ARR-COC's kept cells after the tower (module docstring)."""

    supported_video_pruning_methods = ()
    # The processor normalises, as in the Hugging Face path: vLLM would otherwise move the rescale and
    # normalisation into the tower (config/model.py:1071-1101, layers/fusion/mm_input_norm.py:336-361), whose
    # fused arithmetic rounds differently, and the choice reads the processor's patches (`PatchImages`).
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        model_type = getattr(vllm_config.model_config.hf_config, "model_type", None)
        if model_type != "qwen2_vl":
            raise ServeError(f"{ARCH} serves Qwen2-VL checkpoints (model_type 'qwen2_vl'), not {model_type!r}: "
                             "Qwen2.5-VL and Qwen3-VL are not served by the plugin yet")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.arr_coc = ServeSettings.of(self.config)
        refuse_clips(vllm_config.model_config.multimodal_config.limit_per_prompt)
        for note in (self.arr_coc.layer_mode_note(), check_lora(self.arr_coc, vllm_config.lora_config)):
            if note:
                log.warning(note)
        # vLLM recomputes positions after the encoder only where its video-pruning switch is on
        # (gpu_model_runner.py:5156-5160, config/multimodal.py:751-759); this class prunes images itself and
        # never runs EVS, so it turns the switch on for itself.
        mm = vllm_config.model_config.multimodal_config
        if self.arr_coc.encode == "before" and self.use_data_parallel:
            raise ServeError("ARR-COC before the tower runs the tower on the chosen cells itself: serve it without "
                             "--mm-encoder-tp-mode data")
        if not mm.is_multimodal_pruning_enabled():
            mm.video_pruning_rate = 1e-9
        from ...core.layer import build_layer

        # Built here, not at the first request: vLLM runs requests under inference_mode, whose tensors a layer's
        # own bookkeeping cannot version. float32 whatever the model's dtype, as in the Hugging Face path.
        with torch.inference_mode(False):
            layer = build_layer(self.arr_coc.layer, int(self.config.text_config.hidden_size))
        self.arr_coc_layer = layer.to(torch.float32).eval()
        self._arr_coc_image_processor: Any = None

    def load_weights(self, weights: Any) -> set[str]:
        """The checkpoint's weights; the layer's came from its own folder (vLLM counts every parameter)."""
        loaded = set(super().load_weights(weights))
        return loaded | {f"arr_coc_layer.{name}" for name, _ in self.arr_coc_layer.named_parameters()}

    def get_encoder_cudagraph_config(self) -> Any:
        """No encoder CUDA graphs: they bypass `embed_multimodal`, where the choice runs (as EVS, qwen2_5_vl.py)."""
        return dataclasses.replace(super().get_encoder_cudagraph_config(), modalities=[])

    # -- the choice -------------------------------------------------------------------------------------------

    def _image_processor(self) -> Any:
        if self._arr_coc_image_processor is None:
            from transformers import AutoImageProcessor

            self._arr_coc_image_processor = AutoImageProcessor.from_pretrained(self.model_config.model)
        return self._arr_coc_image_processor

    def arr_coc_choose(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, questions: Any, counts: Any,
                       shares: Any, tokens: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """Kept cells per image: the pure choice at each image's budget, met exactly."""
        merge = int(self.config.vision_config.spatial_merge_size)
        thw = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        grid_hw = [(h // merge, w // merge) for _, h, w in thw]
        budgets = [round(float(s), 12) if float(s) > 0 else int(c)
                   for s, c in zip(_per_item(shares), _per_item(counts))]
        ids = [q.tolist() for q in _per_item(questions)]
        pad = getattr(self.config.text_config, "pad_token_id", None) or 0
        chosen = choose(PatchImages(pixel_values, thw, self._image_processor()), grid_hw, ids,
                        self.get_language_model().embed_input_ids, layer=self.arr_coc_layer, method="arr_coc",
                        budget=budgets, budget_mode="exact", seed=0, pad_token_id=pad,
                        visual_tokens=None if tokens is None else list(tokens))
        return chosen.kept

    def encode_kept(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kept: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """The tower on the kept cells only, at their true positions, each image's cells attending to each other
        (as the Hugging Face path's `encode_packed`): vLLM's tower takes its positions and sequence bounds as
        `encoder_metadata` (qwen2_vl.py:717-753), so they are the full grid's rows of the kept patches."""
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

    def embed_multimodal(self, **kwargs: object) -> Any:
        ours = {k: kwargs.pop(k, None) for k in FIELDS}
        image = self._parse_and_validate_image_input(**kwargs)
        if image is None:
            return []
        before = self.arr_coc.encode == "before"
        t0 = time.perf_counter()
        tokens = None if before else self._process_image_input(image)      # after: the tower on every cell
        pixel_values, grid_thw = image["pixel_values"], image["image_grid_thw"]
        t1 = time.perf_counter()
        kept = self.arr_coc_choose(pixel_values, grid_thw, ours[QUESTION_KEY], ours[COUNT_KEY], ours[SHARE_KEY],
                                   tokens)
        t2 = time.perf_counter()
        if TRACE:
            _trace(pixel_values, grid_thw, ours, kept)
        t3 = time.perf_counter()
        feats = self.encode_kept(pixel_values, grid_thw, kept) if before else \
            [t[k.to(t.device)] for t, k in zip(tokens, kept)]
        if TIMING:
            _timing(len(kept), choose_s=t2 - t1, tower_s=(t1 - t0) + (time.perf_counter() - t3))
        merge = int(self.config.vision_config.spatial_merge_size)
        out = []
        for f, k, (_, h, w) in zip(feats, kept, grid_thw.tolist()):
            out.append(torch.cat([f, kept_positions(k, (h // merge, w // merge)).to(f.device, f.dtype)], dim=1))
        return tuple(out)

    # -- positions --------------------------------------------------------------------------------------------

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        """The text's final positions and the pads' provisional ones (`settings.prompt_positions`)."""
        merge = int(self.config.vision_config.spatial_merge_size)
        images = []
        for f in mm_features:
            _, h, w = (int(v) for v in f.data["image_grid_thw"].data.tolist())
            images.append((f.mm_position.offset, f.mm_position.length, h // merge, w // merge))
        return prompt_positions(len(input_tokens), images)

    def recompute_mrope_positions(self, input_ids: Any, multimodal_embeddings: Sequence[torch.Tensor],
                                  mrope_positions: torch.LongTensor, num_computed_tokens: int
                                  ) -> tuple[Sequence[torch.Tensor], torch.Tensor, int]:
        """The chunk's pads at their kept cells' positions (`settings.place_kept_positions`), the 4 position
        channels stripped from the embeddings."""
        device = multimodal_embeddings[0].device if len(multimodal_embeddings) else mrope_positions.device
        ids = input_ids.to(device, torch.long) if isinstance(input_ids, torch.Tensor) else \
            torch.as_tensor(input_ids, dtype=torch.long, device=device)
        embeds = [mm[:, :-4] for mm in multimodal_embeddings]
        kept = [mm[:, -4:].long() for mm in multimodal_embeddings]
        new, delta = place_kept_positions(ids, kept, mrope_positions, num_computed_tokens,
                                          int(self.config.image_token_id), int(self.config.vision_start_token_id))
        return embeds, new, delta
