"""The pruning path's steps before the language model, for one batch: the unpruned prompt, the question
embeddings and the selection context.

What the host already has stays on the host. The processor made the prompt, the grids and the patches
there, so the prompt's layout (image-pad runs, question tokens, the unpruned M-RoPE positions from the
model's own `get_rope_index`) is read from the host copies, and only results are uploaded; nothing here
reads a value back from the VLM's device. The device gets the patches, the tower's work and one batched
question embedding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from ..budget import Budget, BudgetMode, resolve_count
from ..cancel import checkpoint
from ..grid import upload
from ..selection import SelectionContext, VLMHandles
from ..stopwatch import Stopwatch, lap
from .encoding import encoder_output_class
from .pixels import PatchImages
from .processing import QwenProcessor
from .rewrite import VisualRows
from .units import Units, unit_pixels, visual_units

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..layer import ARRCOCLayer


@dataclass(frozen=True)
class PromptTokens:
    """The special token ids the pruning path reads a Qwen-VL prompt by."""

    image: int          # <|image_pad|>
    video: int          # <|video_pad|>
    vision_end: int     # <|vision_end|>
    im_end: int         # <|im_end|>
    pad: int            # what left-pads a row
    special: frozenset[int]

    def question(self, ids: Sequence[int]) -> list[int]:
        """Question token ids of one unpadded row: text after the last <|vision_end|> up to <|im_end|>.

        Qwen's template puts the images first in the user turn, so this is the question. When
        nothing is there (question-first prompts), every non-special text token is used.
        """
        ids = list(ids)
        ends = [i for i, t in enumerate(ids) if t == self.vision_end]
        seg: list[int] = []
        if ends:
            for t in ids[ends[-1] + 1:]:
                if t == self.im_end:
                    break
                seg.append(t)
        skip = self.special | {self.image, self.video, self.vision_end, self.im_end}
        seg = [t for t in seg if t not in skip]
        if not seg:
            seg = [t for t in ids if t not in skip] or ids[-1:]
        return seg


@dataclass
class Unpruned:
    """One batch before selection. Its "images" are the visual units (`units.py`): every image, and every
    temporal group of every video, each a (1, h, w) grid; `inputs["pixel_values"]` / `["image_grid_thw"]` hold
    the units' patches and grids in unit order."""

    inputs: dict[str, torch.Tensor]             # the processor's tensors on the VLM's device
    host: dict[str, torch.Tensor]               # the same on the host (input_ids, attention_mask [B, S], ...)
    grid_thw: torch.Tensor                      # [N, 3] patch grid per image, host
    pos3_host: torch.Tensor                     # [3, B, S] unpruned M-RoPE positions, zeros on padding (host)
    pos3: torch.Tensor                          # the same on the device
    spans: list[tuple[int, int, int]]           # (row, start, end) of each image's pads
    visual: VisualRows | None                   # the full encoding (every cell), None until encoded
    feats: tuple[torch.Tensor, ...] | None      # its per-image views [n_i, D]
    deep: list[tuple[torch.Tensor, ...]] | None  # Qwen3-VL deepstack: per layer, per image [n_i, D]
    encoder_output_cls: type
    n_tokens: list[int]
    item_of_image: list[int]
    grid_hw: list[tuple[int, int]]
    vision_s: float
    patches: PatchImages | None = None          # the images as patches (`patch_images`), made on first use
    units: Units | None = None                  # which unit is an image, which a video's temporal group

    @property
    def rows(self) -> int:
        return int(self.host["input_ids"].shape[0])


def unpruned(model: PreTrainedModel, tokens: PromptTokens, inputs: dict[str, torch.Tensor],
             encode_all: bool = True, clock: Stopwatch | None = None) -> Unpruned:
    """Unpruned M-RoPE positions, where each visual unit's pads are (an image, or a video's temporal group:
    `units.py`), and (encode_all) the vision tower + merger once on every patch."""
    if inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is None:
        raise ValueError("no images or videos in the inputs (pixel_values / pixel_values_videos missing): nothing "
                         "to prune; build inputs with images, or call generate() which handles text-only prompts")
    host = {k: v.cpu() if isinstance(v, torch.Tensor) and not k.startswith("pixel_values") else v
            for k, v in inputs.items()}
    if host.get("attention_mask") is None:
        host["attention_mask"] = torch.ones_like(host["input_ids"])
    dev = model.device
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["attention_mask"] = host["attention_mask"].to(dev)
    ids, mask = host["input_ids"], host["attention_mask"]
    mm = host.get("mm_token_type_ids")
    if mm is None:
        mm = (ids == tokens.image).long() + 2 * (ids == tokens.video).long()
    merge = int(model.config.vision_config.spatial_merge_size)
    units = visual_units(mm, mask, host.get("image_grid_thw"), host.get("video_grid_thw"), merge)
    if units.has_video:   # the image path reads the units' patches as pictures, in unit order
        inputs["pixel_values"] = unit_pixels(inputs, units)
        inputs["image_grid_thw"] = upload(units.grid_thw, dev)
    lap(clock, "prompt")
    t0 = time.perf_counter()
    visual = feats = deep = enc_cls = None
    if encode_all:
        enc = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        feats = tuple(enc.pooler_output)                                  # (Tensor[n_i, D], ...)
        deep = getattr(enc, "deepstack_features", None)
        deep = [tuple(layer) for layer in deep] if deep is not None else None
        visual = VisualRows.every_cell(feats, deep)
        enc_cls = type(enc)
    vision_s = time.perf_counter() - t0
    lap(clock, "vision")
    checkpoint("vision")
    rope = {k: host[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if host.get(k) is not None}
    pos3, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm, attention_mask=mask, **rope)
    thw = units.grid_thw.tolist()
    n_tokens = [int(t) * int(h) * int(w) // merge ** 2 for t, h, w in thw]
    pos3_device = upload(pos3, dev)
    lap(clock, "prompt")
    return Unpruned(
        inputs=inputs, host=host, grid_thw=units.grid_thw, pos3_host=pos3, pos3=pos3_device, spans=units.spans,
        visual=visual, feats=feats, deep=deep, encoder_output_cls=enc_cls or encoder_output_class(model),
        n_tokens=n_tokens, item_of_image=[b for b, _, _ in units.spans],
        grid_hw=[(int(h) // merge, int(w) // merge) for _, h, w in thw], vision_s=vision_s, units=units)


def patch_images(batch: Unpruned, processor: QwenProcessor) -> PatchImages:
    """The batch's images as the processor's patches, made once per batch (the gist and the selector share it,
    and with it the host pictures it rebuilds on demand)."""
    if batch.patches is None:
        batch.patches = PatchImages.of(batch.inputs["pixel_values"], batch.grid_thw, processor)
    return batch.patches


def question_tokens(tokens: PromptTokens, batch: Unpruned) -> list[list[int]]:
    """Each row's question token ids (host)."""
    ids, mask = batch.host["input_ids"].numpy(), batch.host["attention_mask"].numpy() != 0
    return [tokens.question(ids[b][mask[b]].tolist()) for b in range(batch.rows)]


def unit_counts(budgets: list[Budget | None], batch: Unpruned) -> list[int]:
    """K_i per unit. A video's count budget is the clip's: split over its groups (earlier groups take the
    remainder, each at least 1), so a per-group selector keeps what the clip was given; a share is a share."""
    counts = [resolve_count(bud, h * w) for bud, (h, w) in zip(budgets, batch.grid_hw)]
    for units in (batch.units.clips if batch.units is not None else []):
        bud = budgets[units[0]]
        if isinstance(bud, int):
            t, n = len(units), batch.n_tokens[units[0]]
            k = max(t, min(bud, t * n))
            for g, i in enumerate(units):
                counts[i] = min(n, k // t + (g < k % t))
    return counts


def question_embeddings(model: PreTrainedModel, tokens: PromptTokens, batch: Unpruned
                        ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each image's question-token embeddings, in one embedding call for the batch.
    -> (query [N, L, D] in the VLM's dtype, mask [N, L] bool, lengths L_i) on the VLM's device."""
    questions = question_tokens(tokens, batch)
    per_image = [questions[b] for b in batch.item_of_image]
    longest = max(len(q) for q in per_image)
    padded = np.full((len(per_image), longest), tokens.pad, dtype=np.int64)
    real = np.zeros((len(per_image), longest), dtype=bool)
    for i, q in enumerate(per_image):
        padded[i, : len(q)], real[i, : len(q)] = q, True
    dev = model.device
    query = model.get_input_embeddings()(upload(padded, dev))
    return query, upload(real, dev), [len(q) for q in per_image]


def selection_context(model: PreTrainedModel, layer: Callable[[], ARRCOCLayer], tokens: PromptTokens,
                      processor: QwenProcessor, batch: Unpruned, visual_tokens: list[torch.Tensor] | None,
                      budgets: list[Budget | None], budget_mode: BudgetMode | None, seed: int,
                      clock: Stopwatch | None = None) -> SelectionContext:
    """What a selector reads of this batch (`arr_coc.selection.SelectionContext`)."""
    query, query_mask, lengths = question_embeddings(model, tokens, batch)
    units = batch.units
    texts: list[str] = []
    if units is not None and units.has_video:   # the temporal allocator reads the question's words
        tok = getattr(processor, "tokenizer", processor)
        rows = [tok.decode(q) for q in question_tokens(tokens, batch)]
        texts = [rows[b] for b in batch.item_of_image]
    lap(clock, "question")
    deep = batch.deep
    return SelectionContext(
        vlm=VLMHandles(model, layer), pixels=patch_images(batch, processor),
        grid_hw=batch.grid_hw, visual_tokens=visual_tokens, query=query, query_mask=query_mask,
        query_lengths=lengths, budgets=list(budgets),
        counts=unit_counts(list(budgets), batch),
        item_of_image=batch.item_of_image, inputs=batch.inputs, image_spans=batch.spans,
        position_ids=batch.pos3, budget_mode=budget_mode, image_ids=list(range(len(batch.n_tokens))), seed=seed,
        deepstack_features=[[layer[i] for layer in deep] for i in range(len(batch.n_tokens))] if deep is not None
        else None, clock=clock, clips=list(units.clip) if units is not None else [],
        groups=list(units.group) if units is not None else [], questions=texts,
    )


__all__ = ["PromptTokens", "Unpruned", "patch_images", "question_embeddings", "question_tokens", "selection_context",
           "unit_counts", "unpruned"]
