"""What the plugin's three families share on vLLM (docs/SERVING.md, "Design"). Imported by vLLM only.

Three mixins, each put in front of a family's vLLM class by `qwen.py` (Qwen2-VL), `qwen2_5.py` (Qwen2.5-VL) and
`qwen3.py` (Qwen3-VL), which add only what differs: the tower on the chosen cells (`encode_kept`).

- `ARRCOCInfo` (before the family's ProcessingInfo): images only, the server's settings, the question's tokens, the
  PIL image processor, a checkpoint of another family refused in one line;
- `ARRCOCProcessor` (before the family's multimodal processor): each request's budget and question join the kwargs
  vLLM hashes (so every cache is keyed by image, question and budget), and each image gets `count_of(budget,
  cells)` pads; a Qwen3-VL clip is chosen here (`ProcessorChoice`: its prompt holds each frame group's count), its
  kept cells handed to the model as a field;
- `ARRCOCModel` (before the family's model class): `arr_coc.choose` on the processor's patches and the question,
  after the tower (on its tokens) or before it (then `encode_kept` runs the tower on the chosen cells only); the
  kept rows leave with their own M-RoPE positions in 4 extra channels (EVS's convention), which
  `recompute_mrope_positions` places, so the text keeps its unpruned positions, as in the Hugging Face path.
  A row is whatever the family's tower gives per merged cell: Qwen3-VL's carries its deepstack features beside the
  token (qwen3_vl.py:901-904), so they are kept and dropped with it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
import functools
from functools import partial
from typing import Any

import numpy as np
import torch

from vllm.multimodal.inputs import MultiModalFieldConfig
from vllm.multimodal.processing import PromptReplacement
from vllm.utils.torch_utils import set_default_torch_dtype

from ...pipeline.pure import choose
from ...qwen.pixels import PatchImages
from ...qwen.prompt import PromptTokens
from .checkpoint import CheckpointEmbedding, checkpoint_folder
from .settings import (BUDGET_KEY, CLIP_COUNT_KEY, CLIP_KEPT_KEY, CLIP_PIXELS_KEY, CLIP_QUESTION_KEY, COUNT_KEY,
                       GROUPED_CLIP_FAMILIES, PIXELS_KEY, PLUGIN_KEYS, QUESTION_KEY, SERVER_KEY, Placed, ServeError,
                       ServeSettings, check_family, check_lora, check_picture, check_rows, clip_count, clips_served,
                       frame_units, kept_count, kept_positions, place_kept_positions, prompt_positions, prompt_tokens,
                       question_ids, refuse_clips, request_budget, screen_request_kwargs, server_fingerprint,
                       unit_cells)


@dataclasses.dataclass(frozen=True)
class Media:
    """What the plugin reads of one modality: its vLLM keys and the plugin's per-item fields beside them."""

    modality: str            # vLLM's: "image" or "video"
    name: str                # as messages name an item: "image" or "clip"
    pixels: str              # the processor's patch rows
    grid: str                # its [N, 3] patch grids
    question: str            # per item: the question's token ids
    count: str               # per item: the kept count its placeholders hold
    exact: str               # per item, below float32 serving: the float32 patch rows' bits
    token_id: str            # the config's pad token id attribute

    @property
    def fields(self) -> tuple[str, str]:
        return self.question, self.count


IMAGES = Media("image", "image", "pixel_values", "image_grid_thw", QUESTION_KEY, COUNT_KEY, PIXELS_KEY,
               "image_token_id")
CLIPS = Media("video", "clip", "pixel_values_videos", "video_grid_thw", CLIP_QUESTION_KEY, CLIP_COUNT_KEY,
              CLIP_PIXELS_KEY, "video_token_id")
MEDIA = (IMAGES, CLIPS)
FIELDS = (QUESTION_KEY, COUNT_KEY)   # per image, batched, on the host (CLIPS.fields per clip)
log = logging.getLogger("arr_coc.serving.vllm")
# While the plugin's processor runs transformers' (per clip, for Qwen3-VL, qwen3_vl.py:1578-1620, which keeps only
# the patches, the grids and the timestamps of each call): the clips' float32 patch bits, in order (`_exact_pixels`).
_CLIP_BITS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("arr_coc_clip_bits",
                                                                                     default=None)
TRACE = os.environ.get("ARR_COC_VLLM_TRACE")    # a file: each image's kept cells appended there (tests)
TIMING = os.environ.get("ARR_COC_VLLM_TIMING")  # a file: each encoder call's choice and tower seconds (benchmarks)


class ARRCOCInfo:
    """Before a family's ProcessingInfo. family: the model_type its class serves."""

    family: str = ""

    def get_hf_config(self) -> Any:
        check_family(getattr(self.ctx.model_config.hf_config, "model_type", None), self.family)
        return super().get_hf_config()

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        """Images, and clips where this server serves them (`settings.clips_served`: elsewhere vLLM refuses a clip
        at the request, 400, as a modality this model does not take)."""
        if not clips_served(self.family, self.arr_coc_settings().encode):
            return {"image": None}
        return super().get_supported_mm_limits()

    def arr_coc_chooses_clips(self) -> bool:
        """Whether this server chooses a clip's cells here, in the processor (`settings.GROUPED_CLIP_FAMILIES`,
        before the tower): the prompt then holds each frame group's kept count."""
        return self.family in GROUPED_CLIP_FAMILIES and self.arr_coc_settings().encode == "before"

    def arr_coc_processor_choice(self) -> ProcessorChoice:
        """The server's choice as the processor runs it (built once per processing info)."""
        if not hasattr(self, "_arr_coc_choice"):
            self._arr_coc_choice = ProcessorChoice(self.arr_coc_settings(), self.get_hf_config(), self.ctx.model_config)
        return self._arr_coc_choice

    def arr_coc_settings(self) -> ServeSettings:
        if not hasattr(self, "_arr_coc_settings"):
            self._arr_coc_settings = ServeSettings.of(self.get_hf_config())
            self._arr_coc_fingerprint = server_fingerprint(self._arr_coc_settings)
            self._arr_coc_floor = self._arr_coc_settings.min_per_group()    # read once, not per request
        return self._arr_coc_settings

    def arr_coc_floor(self) -> int:
        """The fewest cells a clip's frame group keeps (the layer's `min_per_group`), read once per server."""
        self.arr_coc_settings()
        return self._arr_coc_floor

    def arr_coc_server_kwargs(self) -> dict[str, Any]:
        """The operator's default budget from `--mm-processor-kwargs` (vLLM merges those into transformers'
        call after the plugin reads a request, context.py:376-400): taken out of the server's kwargs at the first
        request, so that it is the plugin's default and never reaches transformers' processor. Not earlier: vLLM
        builds a ProcessingInfo while it makes the model's config (`get_supported_mm_limits`, config/model.py:925),
        and a budget taken there would be gone from the config it then hands to its other processes (data-parallel
        API servers, the engine). Checked here too, in one line, as the model checks it at start."""
        if not hasattr(self, "_arr_coc_server_kwargs"):
            mm = self.ctx.model_config.get_multimodal_config()
            server = getattr(mm, "mm_processor_kwargs", None)
            taken = {BUDGET_KEY: server.pop(BUDGET_KEY)} if isinstance(server, dict) and BUDGET_KEY in server else {}
            request_budget({}, self.arr_coc_settings(), taken)
            self._arr_coc_server_kwargs = taken
        return self._arr_coc_server_kwargs

    def arr_coc_request(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """A request's processor kwargs as the plugin serves them (`screen_request_kwargs`), with its budget (the
        request's, else the server's), its question's ids and the server's fingerprint, all hashed by vLLM."""
        settings = self.arr_coc_settings()
        ours = screen_request_kwargs(kwargs)
        ours[BUDGET_KEY] = request_budget(ours, settings, self.arr_coc_server_kwargs())
        ours[SERVER_KEY] = self._arr_coc_fingerprint
        return ours

    def arr_coc_tokens(self) -> PromptTokens:
        if not hasattr(self, "_arr_coc_tokens"):
            cfg = self.get_hf_config()
            self._arr_coc_tokens = prompt_tokens(self.get_tokenizer(), cfg.image_token_id, cfg.video_token_id)
        return self._arr_coc_tokens

    def get_hf_processor(self, **kwargs: object) -> Any:
        """vLLM's processor with transformers' PIL image processor, the Hugging Face path's (the project runs
        without torchvision): the torchvision one's `pixel_values` differ from it by a float rounding (2e-7), which
        can move a cell's score across another's. Same settings (`to_dict`), swapped once per cached processor.
        Below float32, both processors also hand on their float32 patches (`_exact_pixels`)."""
        processor = super().get_hf_processor(**kwargs)
        exact = self.ctx.model_config.dtype != torch.float32
        if not isinstance(processor.image_processor, _pil_processor(exact)):
            processor.image_processor = _pil_processor(exact).from_dict(processor.image_processor.to_dict())
        videos = getattr(processor, "video_processor", None)
        if exact and videos is not None and not getattr(type(videos), "arr_coc_exact", False):
            videos.__class__ = _exact_pixels(type(videos), CLIPS)
        return processor


@functools.cache
def _pil_processor(exact: bool) -> type:
    """transformers' PIL image processor; exact=True (a server below float32): with its float32 patches' bits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return _exact_pixels(Qwen2VLImageProcessorPil, IMAGES) if exact else Qwen2VLImageProcessorPil


@functools.cache
def _exact_pixels(base: type, media: Media) -> type:
    """`base` (an image or video processor) that also hands on its float32 patches as their bits (int32: vLLM casts
    every floating output to the model's dtype, context.py:345-374), so that the choice reads the pictures the
    Hugging Face path reads, whatever dtype the tower runs in."""

    class ExactPixels(base):
        arr_coc_exact = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            out = super().__call__(*args, **kwargs)
            if media.pixels in out:
                out[media.exact] = torch.as_tensor(out[media.pixels]).to(torch.float32).view(torch.int32)
                seen = _CLIP_BITS.get() if media is CLIPS else None
                if seen is not None:
                    seen.append(out[media.exact])
            return out

    ExactPixels.__name__ = ExactPixels.__qualname__ = f"Exact{base.__name__}"
    return ExactPixels


def build_served_layer(layer: str | None, hidden: int) -> torch.nn.Module:
    """The server's layer as every place that chooses builds it: float32 whatever the model's dtype, as in the
    Hugging Face path; the untrained layer (`layer` None) is the one built after `torch.manual_seed(0)` (every
    worker and the processor the same one). Built outside inference mode: a layer's own bookkeeping cannot
    version inference tensors (vLLM runs requests under inference_mode)."""
    from ...core.layer import build_layer

    # vLLM builds the model under its serving dtype: the layer under float32 (its weights load as they are).
    with torch.inference_mode(False), torch.random.fork_rng(devices=[]), set_default_torch_dtype(torch.float32):
        torch.manual_seed(0)
        built = build_layer(layer, hidden)
    return built.to(torch.float32).eval()


@functools.cache
def _processor_layer(layer: str | None, hidden: int) -> torch.nn.Module:
    """The processor's copy of the server's layer, built once per process."""
    return build_served_layer(layer, hidden)


def served_choice(pixel_values: torch.Tensor, unit_thw: Sequence[tuple[int, int, int]],
                  questions: Sequence[list[int]], budgets: Sequence[int], *, config: Any, layer: torch.nn.Module,
                  embed: Any, image_processor: Any, tokenizer: Any = None,
                  tokens: Sequence[torch.Tensor] | None = None, clips: Sequence[int] | None = None,
                  groups: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Kept cells per unit (an image, or a clip's frame group: `frame_units`), the one choice the server runs,
    in the model or in the processor: the pure choice at the count the processor wrote placeholders for (a
    clip's: its count over space and time, one value, no second rounding), each image and each clip alone
    (`run_selector`). pixel_values [P, C * T * p * p] float32; embed: [N, L] ids -> [N, L, D] (the model's
    `embed_input_ids`, or the checkpoint's rows); tokens: per unit the tower's [n_i, D] (after the tower). A
    clip's allocator reads its question's words, decoded as the Hugging Face path decodes them
    (`QwenBackend.decode_text`)."""
    merge = int(config.vision_config.spatial_merge_size)
    grid_hw = [(h // merge, w // merge) for _, h, w in unit_thw]
    pad = getattr(config.text_config, "pad_token_id", None) or 0
    texts = None if clips is None else [tokenizer.decode(q, skip_special_tokens=True) for q in questions]
    chosen = choose(PatchImages(pixel_values, list(unit_thw), image_processor), grid_hw, questions, embed,
                    layer=layer, method="arr_coc", budget=list(budgets), budget_mode="exact", seed=0,
                    pad_token_id=pad, strict=True, visual_tokens=None if tokens is None else list(tokens),
                    clips=clips, groups=groups, questions=texts)
    return chosen.kept


class ProcessorChoice:
    """The server's choice where the processor runs it (Qwen3-VL clips, `ARRCOCInfo.arr_coc_chooses_clips`): the
    layer built as the model builds it (`build_served_layer`, once per process), the question's embedding rows
    read from the checkpoint in the serving dtype (`CheckpointEmbedding`: what `embed_input_ids` returns), and the
    checkpoint's image processor and tokenizer loaded as the model loads them. It runs on the processor's host."""

    def __init__(self, settings: ServeSettings, config: Any, model_config: Any):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.config = config
        self.layer = _processor_layer(settings.layer, int(config.text_config.hidden_size))
        folder = checkpoint_folder(model_config.model, getattr(model_config, "revision", None))
        self.embed = CheckpointEmbedding(folder, model_config.dtype)
        self.image_processor = AutoImageProcessor.from_pretrained(model_config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)

    def clips(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]], question: list[int],
              counts: Sequence[int]) -> torch.Tensor:
        """[sum K] long: each clip's kept cells (raster over its (t, h, w) merged cells, `counts[i]` of clip i),
        clips one after the other. pixel_values [P, C * T * p * p] float32, the clips' patch rows."""
        units, clips, groups = frame_units(grid_thw)
        with torch.inference_mode():
            kept = served_choice(pixel_values, units, [question] * len(units), [counts[c] for c in clips],
                                 config=self.config, layer=self.layer, embed=self.embed,
                                 image_processor=self.image_processor, tokenizer=self.tokenizer, clips=clips,
                                 groups=groups)
        merge = int(self.config.vision_config.spatial_merge_size)
        per_clip = _item_cells(kept, clips, [h * w // merge ** 2 for _, h, w in units], len(grid_thw))
        return torch.cat(per_clip).to(torch.long)


class ARRCOCProcessor:
    """Before a family's multimodal processor."""

    def apply(self, inputs: Any, timing_ctx: Any) -> Any:
        """The request's budget and question join the processor kwargs: vLLM hashes them with the image
        (processing/inputs.py:70-74), and they reach the HF call even on a cache miss without the prompt."""
        kwargs = self.info.arr_coc_request(inputs.hf_processor_mm_kwargs)
        kwargs[QUESTION_KEY] = question_ids(inputs.prompt, self.info.arr_coc_tokens())
        return super().apply(dataclasses.replace(inputs, hf_processor_mm_kwargs=kwargs), timing_ctx)

    def _apply_hf_processor_main(self, mm_items: Any, hf_kwargs: Mapping[str, object]) -> Any:
        """transformers' processor without the plugin's kwargs, then the plugin's per-item fields beside each
        modality's grid (`_count_items`). Here, not in `_call_hf_processor` (processor.py:1287-1297): Qwen3-VL's
        override of this method (qwen3_vl.py:1420-1644) calls transformers' processor itself (line 1615)."""
        ours = {k: hf_kwargs[k] for k in PLUGIN_KEYS if k in hf_kwargs}
        bits: list[torch.Tensor] = []
        collecting = _CLIP_BITS.set(bits)
        try:
            out = super()._apply_hf_processor_main(mm_items, {k: v for k, v in hf_kwargs.items() if k not in ours})
        finally:
            _CLIP_BITS.reset(collecting)
        if bits and out.get(CLIPS.grid) is not None and out.get(CLIPS.exact) is None:
            out[CLIPS.exact] = torch.cat(bits)          # dropped by Qwen3-VL's per-clip calls
        if QUESTION_KEY in ours:
            for media in MEDIA:
                if out.get(media.grid) is not None:
                    self._count_items(out, media, ours)
        return out

    def _count_items(self, out: Any, media: Media, ours: Mapping[str, Any]) -> None:
        """Each item's question ids and kept count (the one count: the placeholders written here and the rows the
        model keeps, `check_rows`); an item no budget lets in is refused (`check_picture`). Where clips are chosen
        here (Qwen3-VL, `arr_coc_chooses_clips`), each clip's kept cells too (`CLIP_KEPT_KEY`, [sum K] over the
        clips), on the float32 patches."""
        grid = out[media.grid].tolist()
        merge = int(self.info.get_hf_config().vision_config.spatial_merge_size)
        longest = int(self.info.ctx.model_config.max_model_len)
        for i, g in enumerate(grid):
            check_picture(g, merge, longest, i, media.name)
        budget, n = ours[BUDGET_KEY], len(grid)
        if media is CLIPS:
            floor = self.info.arr_coc_floor()
            counts = [clip_count(budget, g, merge, floor) for g in grid]
        else:
            counts = [kept_count(budget, g, merge) for g in grid]
        out[media.question] = torch.tensor([list(ours[QUESTION_KEY])] * n, dtype=torch.long).reshape(n, -1)
        out[media.count] = torch.tensor(counts, dtype=torch.long)
        if media is CLIPS and self.info.arr_coc_chooses_clips():
            bits = out.get(CLIPS.exact)
            pixels = out[CLIPS.pixels] if bits is None else _float32_bits(bits, torch.device("cpu"))
            if pixels.dtype != torch.float32:
                raise RuntimeError("ARR-COC: the processor's float32 clip patches were not handed on (their bits); "
                                   "this is a plugin defect, please report it")
            chooser, t0 = self.info.arr_coc_processor_choice(), time.perf_counter()
            out[CLIP_KEPT_KEY] = chooser.clips(pixels, grid, list(ours[QUESTION_KEY]), counts)
            if TIMING:
                _timing(n, choose_s=time.perf_counter() - t0, tower_s=0.0, where="processor")

    def _get_mm_fields_config(self, hf_inputs: Any, hf_processor_mm_kwargs: Mapping[str, object]
                              ) -> Mapping[str, MultiModalFieldConfig]:
        fields = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))
        for media in MEDIA:
            fields.update({k: MultiModalFieldConfig.batched(media.modality, keep_on_cpu=True) for k in media.fields})
            if media.exact in hf_inputs:          # as the patch rows: each item's rows
                grid = hf_inputs.get(media.grid, torch.empty((0, 3)))
                fields[media.exact] = MultiModalFieldConfig.flat_from_sizes(media.modality, grid.prod(-1))
        if CLIP_KEPT_KEY in hf_inputs:            # each clip's kept cells, its count of them
            fields[CLIP_KEPT_KEY] = MultiModalFieldConfig.flat_from_sizes(CLIPS.modality, hf_inputs[CLIPS.count],
                                                                          keep_on_cpu=True)
        return fields

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any],
                            out_mm_kwargs: Any) -> Sequence[PromptReplacement]:
        """Each item's pads: its kept count (the stock count is grid_thw.prod() // merge**2, qwen2_vl.py:1260)."""
        config = self.info.get_hf_config()

        def replacement(item_idx: int, media: Media) -> list[int]:
            pad = int(getattr(config, media.token_id))
            return [pad] * int(out_mm_kwargs[media.modality][item_idx][media.count].data)

        return [PromptReplacement(modality=m.modality, target=[int(getattr(config, m.token_id))],
                                  replacement=partial(replacement, media=m)) for m in MEDIA]


def _trace(pixel_values: torch.Tensor, grid_thw: torch.Tensor, questions: Any, counts: Any,
           kept: Sequence[torch.Tensor]) -> None:
    """One JSON line per image or clip to $ARR_COC_VLLM_TRACE (the tests' view of the kept cells): the item's
    fingerprint (its pixel rows' float64 sum), its question's ids, its budget and its kept cells (a clip's: raster
    indices over its (t, h, w) cells)."""
    rows = grid_thw.prod(-1).tolist()
    pieces = pixel_values.split([int(r) for r in rows])
    with open(TRACE, "a") as f:
        for px, q, c, k in zip(pieces, _per_item(questions), _per_item(counts), kept):
            f.write(json.dumps({"fingerprint": round(float(px.double().sum()), 3), "question": q.tolist(),
                                "count": int(c), "kept": k.tolist()}) + "\n")


def _timing(images: int, choose_s: float, tower_s: float, where: str = "model") -> None:
    """One JSON line per encoder call to $ARR_COC_VLLM_TIMING (scripts/vllm_bench.py): its images, the seconds
    inside the choice (`arr_coc_choose`) and in the tower (every cell after, the kept cells before); `where`:
    "model", or "processor" for the clips chosen there (Qwen3-VL, one line per processor call)."""
    with open(TIMING, "a") as f:
        f.write(json.dumps({"images": images, "choose_s": choose_s, "tower_s": tower_s, "where": where}) + "\n")


def _float32_bits(bits: Any, device: torch.device) -> torch.Tensor:
    """The processor's float32 patches from their int32 bits (`_pil_processor(exact=True)`), [P, C * T * p * p]."""
    bits = torch.cat(list(bits)) if isinstance(bits, (list, tuple)) else bits
    return bits.to(device).view(torch.float32)


def _rows(value: Any) -> torch.Tensor:
    """A flat field (items' rows one after the other) as one tensor."""
    return torch.cat(list(value)) if isinstance(value, (list, tuple)) else value


def _item_cells(kept: Sequence[torch.Tensor], of_item: Sequence[int], cells: Sequence[int], n_items: int
                ) -> list[torch.Tensor]:
    """Per item its kept cells as raster indices over its (t, h, w) merged cells: a clip's units (its frame groups,
    in order, `cells` each) offset by the cells before them; an image's are its one unit's."""
    out: list[list[torch.Tensor]] = [[] for _ in range(n_items)]
    before = [0] * n_items
    for k, i, n in zip(kept, of_item, cells):
        out[i].append(k.to(torch.long).cpu() + before[i])
        before[i] += n
    return [torch.cat(parts) for parts in out]


def _per_item(value: Any) -> list[torch.Tensor]:
    """A batched field as one tensor per item (stacked when the shapes agreed, a list otherwise)."""
    return list(value) if isinstance(value, (list, tuple)) else list(value.unbind(0))


def sequence_metadata(visual: Any, cu: np.ndarray, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One attention segmentation (cu [S + 1] int32, in patches) in the forms the attention backend of vLLM's
    Qwen2.5-VL / Qwen3-VL towers reads, made as `prepare_encoder_metadata` makes them (qwen3_vl.py:833-857):
    -> (cu_seqlens, max_seqlen (host), sequence_lengths or None)."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    backend = visual.attn_backend
    lengths = MMEncoderAttention.maybe_compute_seq_lens(backend, cu, device)
    longest = torch.tensor(MMEncoderAttention.compute_max_seqlen(backend, cu), dtype=torch.int32)
    cu_seqlens = MMEncoderAttention.maybe_recompute_cu_seqlens(
        backend, cu, visual.hidden_size, visual.tp_size, device, fp8_padded_hidden_size=visual.fp8_padded_hidden_size)
    return cu_seqlens, longest, lengths


def packed_bounds(kept: Sequence[torch.Tensor], unit: int) -> np.ndarray:
    """[N + 1] int32: one attention segment per image over its kept cells' patches (unit = merge**2 each)."""
    return np.concatenate([[0], np.cumsum([int(k.numel()) * unit for k in kept])]).astype(np.int32)


class ARRCOCModel:
    """Before a family's vLLM model class (module docstring). family: the model_type its class serves; a family
    class adds `encode_kept` (the tower on the chosen cells only, at their full-grid positions) and lists
    `SupportsMultiModalPruning` after the vLLM class where that class does not (Qwen2-VL): a Protocol here, before
    the vLLM class in the method order, would swallow its `__init__`."""

    family: str = ""
    supported_video_pruning_methods = ()
    # The processor normalises, as in the Hugging Face path: vLLM would otherwise move the rescale and
    # normalisation into the tower (config/model.py:1071-1101, layers/fusion/mm_input_norm.py:336-361), whose
    # fused arithmetic rounds differently, and the choice reads the processor's patches (`PatchImages`).
    supports_mm_device_do_normalize = False

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        check_family(getattr(vllm_config.model_config.hf_config, "model_type", None), self.family)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.arr_coc = ServeSettings.of(self.config)
        refuse_clips(vllm_config.model_config.multimodal_config.limit_per_prompt, self.family, self.arr_coc.encode)
        operator = getattr(vllm_config.model_config.multimodal_config, "mm_processor_kwargs", None) or {}
        if operator.get(BUDGET_KEY) is not None:        # a bad default stops the server at start, in one line
            request_budget({}, self.arr_coc, operator)
        for note in (self.arr_coc.layer_mode_note(), check_lora(self.arr_coc, vllm_config.lora_config)):
            if note:
                log.warning(note)
        if self.arr_coc.encode == "before" and self.use_data_parallel:
            raise ServeError("ARR-COC before the tower runs the tower on the chosen cells itself: serve it without "
                             "--mm-encoder-tp-mode data")
        # vLLM recomputes positions after the encoder only where its video-pruning switch is on
        # (gpu_model_runner.py:5156-5160, config/multimodal.py:751-759); this class prunes images itself and
        # never runs EVS, so it turns the switch on for itself.
        mm = vllm_config.model_config.multimodal_config
        if not mm.is_multimodal_pruning_enabled():
            mm.video_pruning_rate = 1e-9
        self.arr_coc_layer = self._build_layer()
        self._arr_coc_image_processor: Any = None

    def _build_layer(self) -> torch.nn.Module:
        """The server's layer (`build_served_layer`), built here, not at the first request."""
        return build_served_layer(self.arr_coc.layer, int(self.config.text_config.hidden_size))

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

    def _tokenizer(self) -> Any:
        if getattr(self, "_arr_coc_tokenizer", None) is None:
            from transformers import AutoTokenizer

            self._arr_coc_tokenizer = AutoTokenizer.from_pretrained(self.model_config.tokenizer)
        return self._arr_coc_tokenizer

    def arr_coc_choose(self, pixel_values: torch.Tensor, unit_thw: Sequence[tuple[int, int, int]],
                       questions: Sequence[list[int]], budgets: Sequence[int],
                       tokens: Sequence[torch.Tensor] | None, clips: Sequence[int] | None = None,
                       groups: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Kept cells per unit (`served_choice`), with the model's layer and input embedding."""
        return served_choice(pixel_values, unit_thw, questions, budgets, config=self.config, layer=self.arr_coc_layer,
                             embed=self.get_language_model().embed_input_ids, image_processor=self._image_processor(),
                             tokenizer=None if clips is None else self._tokenizer(), tokens=tokens, clips=clips,
                             groups=groups)

    def encode_kept(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, kept: Sequence[torch.Tensor]
                    ) -> list[torch.Tensor]:
        """Per unit [K_i, D'] rows of the tower on the kept cells only (the family's class)."""
        raise NotImplementedError

    def embed_multimodal(self, **kwargs: object) -> Any:
        """One modality per call (vLLM batches items of one modality, multimodal/utils.py:291-327)."""
        media = CLIPS if kwargs.get(CLIPS.pixels) is not None else IMAGES
        if kwargs.get(media.pixels) is None:
            return []
        return tuple(self._embed(media, kwargs))

    def _embed(self, media: Media, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Per item [K, D' + 4]: its kept rows and their M-RoPE offsets (`kept_positions`). The choice runs per
        unit (a clip's frame groups together, `frame_units`), after the tower (on every unit's tokens) or before it
        (then the tower encodes the kept cells only); a Qwen3-VL clip's cells were chosen in the processor
        (`CLIP_KEPT_KEY`), whose prompt holds each frame group's count."""
        ours = {k: kwargs.pop(k, None) for k in media.fields}
        bits = kwargs.pop(media.exact, None)
        chosen = kwargs.pop(CLIP_KEPT_KEY, None) if media is CLIPS else None
        if chosen is None and media is CLIPS and self.family in GROUPED_CLIP_FAMILIES:
            raise RuntimeError(f"ARR-COC: a {self.family} clip reached the model without the processor's kept cells; "
                               "this is a plugin defect, please report it")
        factors = self._time_factors(kwargs) if media is CLIPS else None
        pixel_values, grid_thw = _rows(kwargs[media.pixels]), kwargs[media.grid]
        if not isinstance(grid_thw, torch.Tensor):
            grid_thw = torch.stack([torch.as_tensor(g).reshape(3) for g in grid_thw])
        items = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
        units, clips, groups = frame_units(items) if media is CLIPS else (items, None, None)
        of_item = clips if clips is not None else list(range(len(items)))
        counts = [int(c) for c in _per_item(ours[media.count])]
        ids = [q.tolist() for q in _per_item(ours[media.question])]
        unit_grid = torch.tensor(units, dtype=torch.long).reshape(-1, 3)
        before = self.arr_coc.encode == "before"
        t0 = time.perf_counter()
        rows = None if before else self._process_image_input(
            self._parse_and_validate_image_input(pixel_values=pixel_values, image_grid_thw=unit_grid))
        exact = pixel_values if bits is None else _float32_bits(bits, pixel_values.device)
        width = int(self.config.text_config.hidden_size)                   # the token, without Qwen3's deepstack
        merge = int(self.config.vision_config.spatial_merge_size)
        t1 = time.perf_counter()
        kept = unit_cells(_rows(chosen), counts, items, merge) if chosen is not None else self.arr_coc_choose(
            exact, units, [ids[i] for i in of_item], [counts[i] for i in of_item],
            None if rows is None else [r[:, :width] for r in rows], clips, groups)
        t2 = time.perf_counter()
        check_rows([sum(int(k.numel()) for k, i in zip(kept, of_item) if i == j) for j in range(len(items))],
                   counts, media.name)
        per_item = _item_cells(kept, of_item, [h * w // merge ** 2 for _, h, w in units], len(items))
        if TRACE:
            _trace(exact, grid_thw, ours[media.question], ours[media.count], per_item)
        t3 = time.perf_counter()
        feats = self.encode_kept(pixel_values, unit_grid, kept) if before else \
            [r[k.to(r.device)] for r, k in zip(rows, kept)]
        if TIMING:
            _timing(len(items), choose_s=t2 - t1, tower_s=(t1 - t0) + (time.perf_counter() - t3))
        out = []
        for j, ((t, h, w), cells) in enumerate(zip(items, per_item)):
            f = torch.cat([feats[u] for u, i in enumerate(of_item) if i == j])
            where = self.arr_coc_positions(media, cells, (h // merge, w // merge), t,
                                           1.0 if factors is None else factors[j])
            out.append(torch.cat([f, where.to(f.device, f.dtype)], dim=1))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("ARR-COC: %s %d kept %d of %d cells", media.name, j, cells.numel(), t * h * w // merge ** 2)
        return out

    def arr_coc_positions(self, media: Media, cells: torch.Tensor, grid_hw: tuple[int, int], groups: int,
                          factor: float) -> torch.Tensor:
        """[K, 4] an item's kept cells' M-RoPE offsets from its first pad's position (`kept_positions`; a clip's
        over its groups in one run of pads). Qwen3-VL's clips: from each frame group's own (its class)."""
        return kept_positions(cells, grid_hw, groups, factor)

    def _time_factors(self, kwargs: Mapping[str, Any]) -> list[float]:
        """Per clip, its frame groups' M-RoPE time step: `second_per_grid_ts` (Qwen2.5-VL's processor; 1.0 where
        absent) times the tower's `tokens_per_second` (1.0 where absent), as vLLM's `iter_mm_grid_thw`."""
        per_second = float(getattr(self.config.vision_config, "tokens_per_second", 1.0))
        seconds = kwargs.get("second_per_grid_ts")
        if seconds is None:
            return [per_second] * len(kwargs[CLIPS.grid])
        return [float(s) * per_second for s in _per_item(seconds)]

    # -- positions --------------------------------------------------------------------------------------------

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        """The text's final positions and the pads' provisional ones (`settings.prompt_positions`): the families'
        own rules for images (qwen2_vl.py:1354-1391, qwen2_5_vl.py:1371-1408, qwen3_vl.py:2888-2961) and for clips
        (a group's time step from `iter_mm_grid_thw`, qwen2_5_vl.py:1328-1369)."""
        placed = [p for f in mm_features for p in self.arr_coc_placed(f, input_tokens)]
        return prompt_positions(len(input_tokens), placed)

    def arr_coc_placed(self, feature: Any, input_tokens: list[int]) -> list[Placed]:
        """An image's or clip's pads in the prompt (one run each; Qwen3-VL's clips: one per frame group, its
        class). A clip's time step: `second_per_grid_ts` (where its processor gives it) times `tokens_per_second`."""
        merge = int(self.config.vision_config.spatial_merge_size)
        media = CLIPS if feature.modality == "video" else IMAGES
        t, h, w = (int(v) for v in feature.data[media.grid].data.tolist())
        factor = 1.0
        if media is CLIPS:
            seconds = feature.data.get("second_per_grid_ts")
            per_second = float(getattr(self.config.vision_config, "tokens_per_second", 1.0))
            factor = (1.0 if seconds is None else float(seconds.data.item())) * per_second
        return [Placed(feature.mm_position.offset, feature.mm_position.length, h // merge, w // merge, t, factor)]

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
        pads = (int(self.config.image_token_id), int(self.config.video_token_id))
        new, delta = place_kept_positions(ids, kept, mrope_positions, num_computed_tokens, pads)
        return embeds, new, delta


__all__ = ["ARRCOCInfo", "ARRCOCModel", "ARRCOCProcessor", "FIELDS", "packed_bounds",
           "sequence_metadata"]
