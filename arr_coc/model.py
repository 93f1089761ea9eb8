"""ARRCOCQwen: query-aware visual-token pruning inside Qwen-VL `generate()`.

The VLM is pruned by rewriting its inputs (DESIGN.md, "Integration with
transformers"), never by hooking the language model:

1. vision tower + merger once (`model.model.get_image_features`): visual tokens
   V_i [n_i, D] per image in raster order of the merged grid (Qwen3-VL also
   returns deepstack features, one [n_i, D] per deepstack layer);
2. a selector (ARR-COC by default, see `SELECTORS`) picks K_i kept raster
   indices per image from the texture of the SAME resized image the processor
   produced (un-patchified from `pixel_values`), the question embeddings (the
   VLM's own input embeddings) and the visual tokens;
3. `model.model.get_rope_index` gives the unpruned M-RoPE (t, h, w) positions;
   kept visual tokens keep theirs, text keeps its own, dropped image pads are
   removed so each image has exactly K_i pads, and the rows are left-padded again;
4. `position_ids` [4, B, S'] = [text row, t, h, w]. The text row is a contiguous
   counter (cumsum(mask) - 1): transformers reads row 0 only to build the causal
   mask (a gap there would be read as a packed-sequence boundary); rows 1..3
   carry the rotary positions. `generate()` extends all four rows by +1 per new
   token, which is right because the last prompt token is text.
5. pruned features go in as `mm_encoder_outputs={"image": <encoder output with
   pooler_output=(V_i[kept_i], ...) [, deepstack_features=[(F_li[kept_i], ...)]]>}`,
   which `forward()` scatters into the K_i pads per image and `generate()`
   forwards at prefill (and expands per beam). `generate()` mutates that dict, so
   every call gets fresh kwargs (`PrunedInputs.model_kwargs()`).

Kept-all (method="none" or budget 1.0) reproduces the stock forward exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch

from .attending import grid_indices
from .budget import resolve_count as _resolve_count
from .processing import (
    IM_END, VISION_END, image_processor_of, load_processor, render_prompt, unpatchify_images,
)

logger = logging.getLogger(__name__)

Budget = Union[int, float]
BudgetSpec = Union[Budget, Sequence[Union[Budget, Sequence[Budget], None]], None]

DEFAULT_BUDGET: Budget = 0.25

MODEL_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


# ----------------------------------------------------------------------------- outputs


@dataclass
class Trace:
    """What happened to one item (one question with its images).

    Times are for the whole batch the item ran in (one prefill serves the batch).
    Per-image lists follow the item's images in prompt order.
    """

    method: str
    budget: Any                                  # the budget asked for (per image list when it differed)
    kept_tokens: int                             # visual tokens the LM saw, summed over the item's images
    total_tokens: int                            # visual tokens before pruning
    kept_per_image: list[int] = field(default_factory=list)
    total_per_image: list[int] = field(default_factory=list)
    kept_indices: list[torch.Tensor] = field(default_factory=list)   # LongTensor[K_i] raster indices, ascending
    grid_hw: list[tuple[int, int]] = field(default_factory=list)     # merged grid (h_i, w_i) per image
    arr_coc: Any = None                          # ARRCOCOutput sliced to this item's images, or None
    fallback: list[str | None] = field(default_factory=list)        # per image: None | "grid" | "keep_all"
    error: str | None = None                     # why an image kept all its tokens, if it did
    prompt_tokens: int = 0                       # pruned prompt length (no padding)
    new_tokens: int = 0                          # generated tokens (first returned sequence)
    vision_s: float = 0.0                        # vision tower + merger
    select_s: float = 0.0                        # selector (ARR-COC layer incl. texture)
    prefill_s: float = 0.0                       # first LM forward (the prefill)
    total_s: float = 0.0                         # the whole call

    @property
    def kept_ratio(self) -> float:
        return self.kept_tokens / max(1, self.total_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no tensors)."""
        return {
            "method": self.method, "budget": self.budget, "kept_tokens": self.kept_tokens,
            "total_tokens": self.total_tokens, "kept_per_image": self.kept_per_image,
            "total_per_image": self.total_per_image, "grid_hw": [list(g) for g in self.grid_hw],
            "fallback": self.fallback, "error": self.error, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "vision_s": self.vision_s, "select_s": self.select_s,
            "prefill_s": self.prefill_s, "total_s": self.total_s,
        }


@dataclass
class Selection:
    """A selector's answer for the images of a `SelectionContext`.

    kept: LongTensor[K_i] per image, raster indices into the merged grid (any order;
    sorted and checked by the caller). fallback / errors: per image, optional.
    """

    kept: list[torch.Tensor]
    arr_coc: Any = None
    fallback: list[str | None] | None = None
    errors: list[str | None] | None = None
    # per image, optional Tensor[n_i, D] replacing the merger output in the same raster layout; the LM
    # then sees visual_tokens[i][kept_i] (e.g. VisionZip's merged contextual tokens). None: the merger output.
    visual_tokens: list[torch.Tensor | None] | None = None


@dataclass
class SelectionContext:
    """Everything a selector may use, for N images (all images of a batch, prompt order).

    images        list[FloatTensor[3, H_i, W_i]] in [0, 1]: the resized image the VLM saw
    grid_hw       list[(h_i, w_i)] merged-token grid; n_i = h_i * w_i
    visual_tokens list[Tensor[n_i, D]] merger output (VLM dtype)
    query_embeds  list[Tensor[L_i, D]] input embeddings of the image's question tokens
    budgets       list[Budget | None] per image (None: the selector's default)
    counts        list[int] K_i for fixed-count selectors (budget resolved against n_i)
    item_of_image list[int] batch row of each image
    inputs        the unpruned batch (input_ids, attention_mask, ...), for LM-based selectors
    image_spans   list[(row, start, end)]: where image i's pads sit in `inputs["input_ids"]`
    position_ids  LongTensor[3, B, S] unpruned M-RoPE positions
    """

    wrapper: "ARRCOCQwen"
    images: list[torch.Tensor]
    grid_hw: list[tuple[int, int]]
    visual_tokens: list[torch.Tensor]
    query_embeds: list[torch.Tensor]
    budgets: list[Budget | None]
    counts: list[int]
    item_of_image: list[int]
    inputs: dict[str, torch.Tensor]
    image_spans: list[tuple[int, int, int]]
    position_ids: torch.Tensor
    image_ids: list[int] = field(default_factory=list)   # batch-global index of each image
    seed: int = 0
    deepstack_features: list[list[torch.Tensor]] | None = None  # Qwen3-VL: per image, one [n_i, D] per deepstack layer

    def __len__(self) -> int:
        return len(self.images)

    def subset(self, which: Sequence[int]) -> "SelectionContext":
        pick = lambda xs: [xs[i] for i in which]  # noqa: E731
        return dataclasses.replace(
            self, images=pick(self.images), grid_hw=pick(self.grid_hw), visual_tokens=pick(self.visual_tokens),
            query_embeds=pick(self.query_embeds), budgets=pick(self.budgets), counts=pick(self.counts),
            item_of_image=pick(self.item_of_image), image_spans=pick(self.image_spans),
            image_ids=pick(self.image_ids),
            deepstack_features=pick(self.deepstack_features) if self.deepstack_features is not None else None,
        )

    def generator(self, i: int) -> torch.Generator:
        """A per-image generator seeded by (seed, image content): the same image draws the same
        tokens whether it runs alone or in a batch, different images draw different ones."""
        pixels = (self.images[i].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy().tobytes()
        return torch.Generator().manual_seed((zlib.crc32(pixels) + 7919 * self.seed) % (2**63))


Selector = Callable[[SelectionContext], Union[Selection, Sequence[torch.Tensor]]]


@dataclass
class PrunedInputs:
    """Model inputs after pruning, plus what is needed to explain or redo them.

    input_ids / attention_mask  [B, S'] left-padded
    position_ids                [4, B, S'] rows (text, t, h, w)
    orig_index                  [B, S'] position of each token in the unpruned row, -1 on padding
    image_features              tuple of Tensor[K_i, D]
    deepstack_features          Qwen3-VL: list over deepstack layers of tuple of Tensor[K_i, D]; else None
    kept_indices                list of LongTensor[K_i]
    full_features / full_deepstack  the unpruned encoder outputs (same layout, n_i rows)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    orig_index: torch.Tensor
    image_features: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]] | None
    kept_indices: list[torch.Tensor]
    full_features: tuple[torch.Tensor, ...]
    full_deepstack: list[tuple[torch.Tensor, ...]] | None
    encoder_output_cls: type
    item_of_image: list[int]
    grid_hw: list[tuple[int, int]]

    def model_kwargs(self) -> dict[str, Any]:
        """Fresh kwargs for `model(**kw)` / `model.generate(**kw)` (generate mutates them)."""
        enc: dict[str, Any] = {"pooler_output": tuple(self.image_features)}
        if self.deepstack_features is not None:
            enc["deepstack_features"] = [tuple(layer) for layer in self.deepstack_features]
        return {
            "input_ids": self.input_ids.clone(),
            "attention_mask": self.attention_mask.clone(),
            "position_ids": self.position_ids.clone(),
            "mm_encoder_outputs": {"image": self.encoder_output_cls(**enc)},
        }

    def with_features(
        self, image_features: Sequence[torch.Tensor] | None = None,
        deepstack_features: Sequence[Sequence[torch.Tensor]] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> "PrunedInputs":
        """A copy with some parts swapped (tests' negative controls, ablations)."""
        return dataclasses.replace(
            self,
            image_features=tuple(image_features) if image_features is not None else self.image_features,
            deepstack_features=[tuple(x) for x in deepstack_features] if deepstack_features is not None
            else self.deepstack_features,
            position_ids=position_ids if position_ids is not None else self.position_ids,
        )

    @property
    def kept_counts(self) -> list[int]:
        return [int(k.numel()) for k in self.kept_indices]


@dataclass
class PrefillOutput:
    """logits [B, S', V] of the pruned prompt, the pruned inputs and per-item traces."""

    logits: torch.Tensor
    pruned: PrunedInputs
    traces: list[Trace]


# ----------------------------------------------------------------------------- selectors


def resolve_count(budget: Budget | None, n: int, default: Budget = DEFAULT_BUDGET) -> int:
    """Tokens to keep out of n, with the allocator's rule (shares round half up, at least 1)."""
    return _resolve_count(default if budget is None else budget, n)


def _select_none(ctx: SelectionContext) -> Selection:
    return Selection(kept=[torch.arange(h * w) for h, w in ctx.grid_hw])


def _select_random(ctx: SelectionContext) -> Selection:
    kept = []
    for i, ((h, w), k) in enumerate(zip(ctx.grid_hw, ctx.counts)):
        kept.append(torch.randperm(h * w, generator=ctx.generator(i))[:k])
    return Selection(kept=kept)


def _select_grid(ctx: SelectionContext) -> Selection:
    return Selection(kept=[grid_indices(h, w, k) for (h, w), k in zip(ctx.grid_hw, ctx.counts)])


def _run_arr_coc(ctx: SelectionContext, budget: list[Budget | None] | None) -> Selection:
    """The ARR-COC layer on every image of the context; budget None entries mean adaptive."""
    out = ctx.wrapper.arr_coc_layer(
        [im.float() for im in ctx.images],
        [tuple(g) for g in ctx.grid_hw],
        query_embeds=[q.float() for q in ctx.query_embeds],
        visual_tokens=[v.float() for v in ctx.visual_tokens],
        budget=budget,
    )
    return Selection(
        kept=list(out.kept_indices), arr_coc=out,
        fallback=list(getattr(out, "fallback", None) or [None] * len(ctx)),
        errors=list(getattr(out, "errors", None) or [None] * len(ctx)),
    )


def _select_arr_coc(ctx: SelectionContext) -> Selection:
    budget: list[Budget | None] | None = None
    if any(b is not None for b in ctx.budgets):
        # A None entry means "the layer's default": its fixed budget, or adaptive (None) in adaptive mode.
        attending = ctx.wrapper.arr_coc_layer.config.attending
        default = attending.budget if attending.mode == "fixed" else None
        budget = [default if b is None else b for b in ctx.budgets]
    return _run_arr_coc(ctx, budget)


def select_arr_coc_adaptive(ctx: SelectionContext) -> Selection:
    """ARR-COC with the allocator's adaptive budget for every image, whatever the configured mode."""
    return _run_arr_coc(ctx, [None] * len(ctx))


# name -> selector(ctx) -> Selection | list of kept index tensors. The evaluation's anchor
# methods (downscale, fastv, visionzip, divprune, cdpruner, oracle, ...) register here.
SELECTORS: dict[str, Selector] = {
    "none": _select_none,
    "arr_coc": _select_arr_coc,
    "random": _select_random,
    "grid": _select_grid,
}


def register_selector(name: str, fn: Selector | None = None, *, overwrite: bool = False):
    """Register `fn(ctx: SelectionContext) -> Selection | list[LongTensor]` under `name`.

    Usable as `register_selector("oracle", fn)` or as a decorator `@register_selector("oracle")`.
    """

    def add(f: Selector) -> Selector:
        if name in SELECTORS and not overwrite and SELECTORS[name] is not f:
            raise ValueError(f"selector {name!r} is already registered; pass overwrite=True to replace it")
        SELECTORS[name] = f
        return f

    return add(fn) if fn is not None else add


# ----------------------------------------------------------------------------- the wrapper


class ARRCOCQwen:
    """A frozen Qwen2-VL / Qwen2.5-VL / Qwen3-VL model that answers with pruned visual tokens.

        wrapper = ARRCOCQwen.from_pretrained("Qwen/Qwen2-VL-2B-Instruct", arr_coc="checkpoints/arr_coc")
        answer, trace = wrapper.generate(image, "What colour is the circle?", budget=0.1)
    """

    def __init__(self, model: Any, processor: Any, arr_coc: Any = None, seed: int = 0):
        family = getattr(model.config, "model_type", None)
        if family not in MODEL_CLASSES:
            raise ValueError(
                f"ARRCOCQwen wraps {sorted(MODEL_CLASSES)} models; got model_type={family!r}. "
                "Load a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint."
            )
        self.family = family
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.seed = seed
        self._arr_coc_spec = arr_coc
        self._arr_coc_layer = None
        tok = getattr(processor, "tokenizer", processor)
        self.tokenizer = tok
        cfg = model.config
        self.image_token_id = int(cfg.image_token_id)
        self.vision_end_id = tok.convert_tokens_to_ids(VISION_END)
        self.im_end_id = tok.convert_tokens_to_ids(IM_END)
        self.pad_token_id = (
            tok.pad_token_id if tok.pad_token_id is not None
            else model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None
            else 0
        )
        self.merge = int(cfg.vision_config.spatial_merge_size)

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str,
        arr_coc: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> "ARRCOCQwen":
        """Load any of the three families from a hub id or a local folder (offline folders work)."""
        import transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_id_or_path)
        family = getattr(config, "model_type", None)
        if family not in MODEL_CLASSES:
            raise ValueError(
                f"{model_id_or_path!r} is a {family!r} model; ARRCOCQwen supports {sorted(MODEL_CLASSES)}"
            )
        model_cls = getattr(transformers, MODEL_CLASSES[family])
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        load_kw: dict[str, Any] = {"dtype": dtype}
        if attn_implementation is not None:
            load_kw["attn_implementation"] = attn_implementation
        model = model_cls.from_pretrained(model_id_or_path, **load_kw, **kwargs).to(device)
        processor = load_processor(model_id_or_path)
        return cls(model, processor, arr_coc=arr_coc)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def text_hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[-1])

    @property
    def arr_coc_layer(self) -> Any:
        """The ARR-COC layer, built on first use (so "none"/"grid"/"random" need no layer)."""
        if self._arr_coc_layer is None:
            self._arr_coc_layer = self._build_layer(self._arr_coc_spec)
        return self._arr_coc_layer

    def _build_layer(self, spec: Any) -> Any:
        try:
            from .config import ARRCOCConfig
            from .layer import ARRCOCLayer
        except ImportError as exc:
            raise RuntimeError(
                f"method='arr_coc' needs arr_coc.layer.ARRCOCLayer ({exc}); use method='none', 'grid' or 'random'"
            ) from exc
        d = self.text_hidden_size
        if spec is None:
            layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(d))
        elif isinstance(spec, ARRCOCConfig):
            layer = ARRCOCLayer(spec if spec.knowing.query_dim == d else spec.with_query_dim(d))
        elif isinstance(spec, (str, os.PathLike)):
            layer = ARRCOCLayer.from_pretrained(os.fspath(spec))
        else:
            layer = spec
        qd = getattr(getattr(getattr(layer, "config", None), "knowing", None), "query_dim", d)
        if qd != d:
            raise ValueError(
                f"the ARR-COC layer expects question embeddings of width {qd} but this VLM's text hidden size is {d}; "
                "train or build the layer with ARRCOCConfig().with_query_dim(%d)" % d
            )
        return layer.eval()

    # -- inputs ----------------------------------------------------------------------

    def build_inputs(self, images: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Processor tensors for a batch: images[b] is the list of images of question b (left padding)."""
        texts = [render_prompt(self.processor, len(ims), q) for ims, q in zip(images, questions)]
        flat = [im for ims in images for im in ims]
        kw: dict[str, Any] = {"text": texts, "padding": True, "padding_side": "left", "return_tensors": "pt"}
        if flat:
            kw["images"] = flat
        out = self.processor(**kw)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def _question_tokens(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Question token ids of one unpadded row: text after the last <|vision_end|> up to <|im_end|>.

        Qwen's template puts the images first in the user turn, so this is the question. When
        nothing is there (question-first prompts), every non-special text token is used.
        """
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        special.update({self.image_token_id, self.vision_end_id, self.im_end_id})
        ids = row_ids.tolist()
        ends = [i for i, t in enumerate(ids) if t == self.vision_end_id]
        seg: list[int] = []
        if ends:
            for t in ids[ends[-1] + 1:]:
                if t == self.im_end_id:
                    break
                seg.append(t)
        seg = [t for t in seg if t not in special]
        if not seg:
            seg = [t for t in ids if t not in special] or ids[-1:]
        return torch.tensor(seg, dtype=torch.long, device=row_ids.device)

    # -- the pruning path ------------------------------------------------------------

    @torch.no_grad()
    def prepare(
        self,
        inputs: dict[str, torch.Tensor],
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        kept_indices: Sequence[torch.Tensor] | None = None,
    ) -> tuple[PrunedInputs, list[Trace]]:
        """Vision tower once, select, rewrite the inputs. Returns the pruned inputs and per-item traces.

        budget: one budget for every image, or one entry per batch row (a budget, or a list with
        one budget per image of that row). kept_indices: explicit LongTensor[K_i] per image
        (overrides `method`).
        """
        t_start = time.perf_counter()
        if inputs.get("pixel_values_videos") is not None:
            raise ValueError("the pruning path handles images only; pass videos as frames (images) or "
                             "call the model's own generate() for video inputs")
        if inputs.get("pixel_values") is None or inputs.get("image_grid_thw") is None:
            raise ValueError("no images in the inputs (pixel_values / image_grid_thw missing): nothing to prune; "
                             "build inputs with images, or call generate() which handles text-only prompts")
        dev = self.device
        inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        input_ids = inputs["input_ids"]
        B, S = input_ids.shape
        attention_mask = inputs.get("attention_mask")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mm = inputs.get("mm_token_type_ids")
        if mm is None:
            mm = (input_ids == self.image_token_id).long()
        grid_thw = inputs["image_grid_thw"]
        pixel_values = inputs["pixel_values"]
        core = self.model.model

        # 1. vision tower + merger, once.
        t0 = time.perf_counter()
        enc = core.get_image_features(pixel_values, grid_thw, return_dict=True)
        feats = tuple(enc.pooler_output)                                     # (Tensor[n_i, D], ...)
        deep = getattr(enc, "deepstack_features", None)
        deep = [tuple(layer) for layer in deep] if deep is not None else None
        vision_s = time.perf_counter() - t0

        # 2. unpruned M-RoPE positions [3, B, S] (zeros on padding).
        pos3, _ = core.get_rope_index(
            input_ids, mm_token_type_ids=mm, image_grid_thw=grid_thw, attention_mask=attention_mask
        )

        # 3. where each image's pads are: runs of image tokens, row-major = processor's image order.
        spans = _image_spans(input_ids == self.image_token_id, attention_mask)
        n_tokens = [int(f.shape[0]) for f in feats]
        if len(spans) != len(feats) or any(e - s != n for (_, s, e), n in zip(spans, n_tokens)):
            raise ValueError(
                f"the prompts hold image-pad runs of lengths {[e - s for _, s, e in spans]} but the vision tower "
                f"returned {n_tokens} tokens per image; build inputs with this model's processor "
                "(one <|image_pad|> run per image, in image order)"
            )
        item_of_image = [b for b, _, _ in spans]
        grid_hw = [(int(h) // self.merge, int(w) // self.merge) for _, h, w in grid_thw.tolist()]
        budgets = _expand_budgets(budget, item_of_image, B)
        method_name = method if isinstance(method, str) else getattr(method, "__name__", "custom")

        # 4. select.
        t0 = time.perf_counter()
        fallback: list[str | None] = [None] * len(feats)
        errors: list[str | None] = [None] * len(feats)
        replaced: list[torch.Tensor | None] = [None] * len(feats)
        arr_out = None
        if kept_indices is not None:
            kept = [torch.as_tensor(k, dtype=torch.long) for k in kept_indices]
            method_name = "explicit" if isinstance(method, str) and method == "arr_coc" else method_name
        elif method_name == "none":
            kept = [torch.arange(n) for n in n_tokens]
        else:
            ctx = self._context(inputs, input_ids, attention_mask, pos3, spans, feats, grid_thw, grid_hw,
                                budgets, item_of_image, deep)
            kept, arr_out, fallback, errors, replaced = self._run_selector(method, ctx)
        kept, fallback, errors = _validate_kept(kept, n_tokens, fallback, errors)
        select_s = time.perf_counter() - t0

        pruned = self._rewrite(input_ids, attention_mask, pos3, spans, feats, deep, kept, type(enc),
                               item_of_image, grid_hw)
        if any(r is not None for r in replaced):  # the selector replaced some tokens (Selection.visual_tokens)
            pruned = pruned.with_features(image_features=[
                f[k.to(f.device)] if r is None or fb == "keep_all" else _replacement(r, f, i)[k.to(f.device)]
                for i, (f, r, k, fb) in enumerate(zip(feats, replaced, kept, fallback))
            ])
        total_s = time.perf_counter() - t_start
        default: Any = self._default_budget() if method_name != "none" else 1.0
        if method_name == "arr_coc" and self._arr_coc_layer is not None \
                and self._arr_coc_layer.config.attending.mode == "adaptive":
            default = "adaptive"
        traces = []
        for b in range(B):
            imgs = [i for i, r in enumerate(item_of_image) if r == b]
            item_budget = [default if budgets[i] is None else budgets[i] for i in imgs]
            if method_name == "none" or not item_budget:
                item_budget = [1.0] * max(1, len(imgs))
            traces.append(Trace(
                method=method_name,
                budget=item_budget[0] if len(set(map(repr, item_budget))) == 1 else item_budget,
                kept_tokens=sum(int(kept[i].numel()) for i in imgs),
                total_tokens=sum(n_tokens[i] for i in imgs),
                kept_per_image=[int(kept[i].numel()) for i in imgs],
                total_per_image=[n_tokens[i] for i in imgs],
                kept_indices=[kept[i].cpu() for i in imgs],
                grid_hw=[grid_hw[i] for i in imgs],
                arr_coc=_slice_output(arr_out, imgs) if arr_out is not None and imgs else None,
                fallback=[fallback[i] for i in imgs],
                error="; ".join(e for e in (errors[i] for i in imgs) if e) or None,
                prompt_tokens=int(pruned.attention_mask[b].sum()),
                vision_s=vision_s, select_s=select_s, total_s=total_s,
            ))
        return pruned, traces

    def _context(self, inputs, input_ids, attention_mask, pos3, spans, feats, grid_thw, grid_hw, budgets,
                 item_of_image, deep=None) -> SelectionContext:
        images = unpatchify_images(inputs["pixel_values"], grid_thw, image_processor_of(self.processor))
        embed = self.model.get_input_embeddings()
        q_rows = {}
        for b in set(item_of_image):
            row = input_ids[b][attention_mask[b].bool()]
            q_rows[b] = embed(self._question_tokens(row))                   # [L_b, D]
        default = self._default_budget()
        counts = [resolve_count(bud, h * w, default) for bud, (h, w) in zip(budgets, grid_hw)]
        return SelectionContext(
            wrapper=self, images=images, grid_hw=grid_hw, visual_tokens=list(feats),
            query_embeds=[q_rows[b] for b in item_of_image], budgets=list(budgets), counts=counts,
            item_of_image=item_of_image, inputs=inputs, image_spans=spans, position_ids=pos3,
            image_ids=list(range(len(feats))), seed=self.seed,
            deepstack_features=[[layer[i] for layer in deep] for i in range(len(feats))] if deep is not None else None,
        )

    def _default_budget(self) -> Budget:
        spec = self._arr_coc_layer if self._arr_coc_layer is not None else self._arr_coc_spec
        cfg = getattr(spec, "config", spec)
        return getattr(getattr(cfg, "attending", None), "budget", DEFAULT_BUDGET)

    def _run_selector(self, method: str | Selector, ctx: SelectionContext):
        """Run the selector on the batch; if it raises, per item; an item that still fails keeps all."""
        if not callable(method) and method not in SELECTORS:
            from . import methods as _anchors  # noqa: F401 - registers fastv, visionzip, divprune, cdpruner
        if callable(method):
            fn = method
        elif method in SELECTORS:
            fn = SELECTORS[method]
        else:
            raise ValueError(f"unknown method {method!r}; registered: {sorted(SELECTORS)} (see register_selector)")
        N = len(ctx)
        kept: list[torch.Tensor | None] = [None] * N
        fallback: list[str | None] = [None] * N
        errors: list[str | None] = [None] * N
        replaced: list[torch.Tensor | None] = [None] * N
        try:
            sel = _as_selection(fn(ctx), N)
            groups = [(list(range(N)), sel)]
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the items that cause it
            logger.warning("selector %r failed on the batch (%s); retrying item by item", method, exc)
            groups = []
            for b in sorted(set(ctx.item_of_image)):
                which = [i for i, r in enumerate(ctx.item_of_image) if r == b]
                try:
                    groups.append((which, _as_selection(fn(ctx.subset(which)), len(which))))
                except Exception as item_exc:  # noqa: BLE001
                    logger.warning("selector %r failed for item %d (%s); it keeps all tokens", method, b, item_exc)
                    for i in which:
                        fallback[i] = "keep_all"
                        errors[i] = f"{type(item_exc).__name__}: {item_exc}"
        outs = []
        for which, sel in groups:
            for j, i in enumerate(which):
                kept[i] = sel.kept[j]
                if sel.fallback is not None:
                    fallback[i] = sel.fallback[j]
                if sel.errors is not None:
                    errors[i] = sel.errors[j]
                if sel.visual_tokens is not None:
                    replaced[i] = sel.visual_tokens[j]
            outs.append((which, sel.arr_coc))
        arr_out = None
        if len(outs) == 1 and outs[0][1] is not None and len(outs[0][0]) == N:
            arr_out = outs[0][1]
        elif any(o is not None for _, o in outs):
            arr_out = _PerImageOutputs(N, outs)
        return kept, arr_out, fallback, errors, replaced

    def _rewrite(self, input_ids, attention_mask, pos3, spans, feats, deep, kept, enc_cls, item_of_image,
                 grid_hw) -> PrunedInputs:
        """Drop the unkept image pads, keep every other token with its original positions, left-pad."""
        B, S = input_ids.shape
        dev = input_ids.device
        keep = attention_mask.bool().clone()                                  # [B, S]
        for (b, s, e), k in zip(spans, kept):
            keep[b, s:e] = False
            keep[b, s + k.to(dev)] = True
        lengths = keep.sum(-1)
        S2 = int(lengths.max())
        new_ids = torch.full((B, S2), self.pad_token_id, dtype=input_ids.dtype, device=dev)
        new_mask = torch.zeros((B, S2), dtype=attention_mask.dtype, device=dev)
        new_pos = torch.zeros((3, B, S2), dtype=pos3.dtype, device=dev)
        orig = torch.full((B, S2), -1, dtype=torch.long, device=dev)
        for b in range(B):
            idx = keep[b].nonzero().squeeze(1)                               # ascending: order is preserved
            L = idx.numel()
            new_ids[b, S2 - L:] = input_ids[b, idx]
            new_mask[b, S2 - L:] = 1
            new_pos[:, b, S2 - L:] = pos3[:, b, idx]
            orig[b, S2 - L:] = idx
        text_row = (new_mask.long().cumsum(-1) - 1).masked_fill(new_mask == 0, 0)   # contiguous, 0 on pads
        position_ids = torch.cat([text_row[None].to(pos3.dtype), new_pos], dim=0)   # [4, B, S']
        kept_dev = [k.to(f.device) for k, f in zip(kept, feats)]
        image_features = tuple(f[k] for f, k in zip(feats, kept_dev))
        deep_pruned = [tuple(f[k] for f, k in zip(layer, kept_dev)) for layer in deep] if deep is not None else None
        return PrunedInputs(
            input_ids=new_ids, attention_mask=new_mask, position_ids=position_ids, orig_index=orig,
            image_features=image_features, deepstack_features=deep_pruned, kept_indices=[k.cpu() for k in kept],
            full_features=feats, full_deepstack=deep, encoder_output_cls=enc_cls, item_of_image=item_of_image,
            grid_hw=grid_hw,
        )

    # -- running the LM ---------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, pruned: PrunedInputs, **forward_kwargs: Any) -> Any:
        """One LM forward over the pruned prompt (what the evaluation counts FLOPs around)."""
        return self.model(**pruned.model_kwargs(), **forward_kwargs)

    @torch.no_grad()
    def forward_pruned(
        self, budget: BudgetSpec = None, method: str | Selector = "arr_coc",
        kept_indices: Sequence[torch.Tensor] | None = None, **inputs: Any,
    ) -> PrefillOutput:
        """Prune the processor's tensors and run the prefill: logits [B, S', V] + pruned inputs + traces."""
        t0 = time.perf_counter()
        pruned, traces = self.prepare(_tensors(inputs), budget=budget, method=method, kept_indices=kept_indices)
        t1 = time.perf_counter()
        out = self.prefill(pruned)
        t2 = time.perf_counter()
        for tr in traces:
            tr.prefill_s = t2 - t1
            tr.total_s = t2 - t0
        return PrefillOutput(logits=out.logits, pruned=pruned, traces=traces)

    @torch.no_grad()
    def _generate_pruned(self, pruned: PrunedInputs, gen_kwargs: dict[str, Any]) -> tuple[torch.Tensor, float]:
        """model.generate on fresh pruned kwargs; returns sequences and the prefill time (first forward)."""
        marks: list[float] = []

        def pre_hook(module, args, kwargs):
            if len(marks) == 0:
                marks.append(time.perf_counter())

        def post_hook(module, args, kwargs, output):
            if len(marks) == 1:
                marks.append(time.perf_counter())

        # Hooks on this instance only, removed right after: they time the first forward (prefill).
        h1 = self.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        h2 = self.model.register_forward_hook(post_hook, with_kwargs=True)
        try:
            kw = {"do_sample": False, "pad_token_id": self.pad_token_id, **gen_kwargs}
            seqs = self.model.generate(**pruned.model_kwargs(), **kw)
        finally:
            h1.remove()
            h2.remove()
        prefill_s = marks[1] - marks[0] if len(marks) == 2 else float("nan")
        return seqs, prefill_s

    def generate(
        self,
        images: Any,
        questions: str | Sequence[str],
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        max_new_tokens: int = 32,
        return_trace: bool = True,
        **gen_kwargs: Any,
    ):
        """Answer question(s) about image(s) with pruned visual tokens.

        Single item: `generate(image_or_list_of_images, "question")` -> (answer, trace).
        Batch: `generate([img_or_list, ...], ["q1", ...])` -> (answers, traces).
        Each image is pruned by its own budget. With num_return_sequences > 1, an item's
        answer is a list of strings. return_trace=False returns the answers only.
        """
        t0 = time.perf_counter()
        single = isinstance(questions, str)
        if single:
            questions = [questions]
            images = [images]
        questions = list(questions)
        if len(images) != len(questions):
            raise ValueError(f"got {len(images)} image entries for {len(questions)} questions; pass one per question")
        item_images = [list(im) if isinstance(im, (list, tuple)) else ([] if im is None else [im]) for im in images]
        inputs = self.build_inputs(item_images, questions)
        sequences, new_tokens, traces = self._generate_from_inputs(
            inputs, budget, method, max_new_tokens=max_new_tokens, **gen_kwargs)
        r = int(gen_kwargs.get("num_return_sequences", 1))
        texts = self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        answers: list[Any] = [texts[i * r:(i + 1) * r] if r > 1 else texts[i] for i in range(len(questions))]
        total = time.perf_counter() - t0
        for tr in traces:
            tr.total_s = total
        if single:
            return (answers[0], traces[0]) if return_trace else answers[0]
        return (answers, traces) if return_trace else answers

    def _generate_from_inputs(self, inputs: dict[str, torch.Tensor], budget: BudgetSpec, method: str | Selector,
                              **gen_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, list[Trace]]:
        """-> (sequences as generate returns them on the pruned prompt, new tokens only, traces)."""
        if inputs.get("pixel_values") is None:  # text-only: nothing to prune
            kw = {"do_sample": False, "pad_token_id": self.pad_token_id, **gen_kwargs}
            with torch.no_grad():
                seqs = self.model.generate(**{k: v.to(self.device) for k, v in inputs.items()}, **kw)
            S = inputs["input_ids"].shape[1]
            r = int(gen_kwargs.get("num_return_sequences", 1))
            traces = [Trace(method=str(method), budget=None, kept_tokens=0, total_tokens=0,
                            prompt_tokens=int(m.sum()), new_tokens=seqs.shape[1] - S)
                      for m in inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))]
            return seqs, seqs[:, S:], traces[: seqs.shape[0] // r]
        pruned, traces = self.prepare(inputs, budget=budget, method=method)
        seqs, prefill_s = self._generate_pruned(pruned, gen_kwargs)
        S2 = pruned.input_ids.shape[1]
        new = seqs[:, S2:]
        r = int(gen_kwargs.get("num_return_sequences", 1))
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        for b, tr in enumerate(traces):
            tr.new_tokens = _count_new(new[b * r].tolist(), eos, self.pad_token_id)
            tr.prefill_s = prefill_s
        return seqs, new, traces

    def model_generate(
        self,
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        return_trace: bool = False,
        **kwargs: Any,
    ):
        """Drop-in for `model.generate(**processor_outputs, ...)` with pruning.

        Returns sequences laid out as the stock call returns them — the ORIGINAL
        (unpruned) prompt followed by the new tokens — so `out[:, len(input_ids[0]):]`
        trimming code keeps working. return_trace=True returns (sequences, traces).
        """
        inputs = _tensors(kwargs)
        gen_kwargs = {k: v for k, v in kwargs.items() if k not in inputs}
        t0 = time.perf_counter()
        _, new, traces = self._generate_from_inputs(inputs, budget, method, **gen_kwargs)
        r = new.shape[0] // inputs["input_ids"].shape[0]
        prompt = inputs["input_ids"].to(new.device).repeat_interleave(r, dim=0)
        sequences = torch.cat([prompt, new], dim=1)
        for tr in traces:
            tr.total_s = time.perf_counter() - t0
        return (sequences, traces) if return_trace else sequences


# ----------------------------------------------------------------------------- helpers

_INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def _tensors(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: kwargs[k] for k in _INPUT_KEYS if kwargs.get(k) is not None}


def _count_new(row: list[int], eos: set[int], pad: int | None) -> int:
    """Generated tokens up to and including the first end-of-sequence token (generate pads after it)."""
    for j, t in enumerate(row):
        if t in eos:
            return j + 1
    n = len(row)
    while n > 0 and row[n - 1] == pad:
        n -= 1
    return n


def _image_spans(is_image: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of image pads per row, row-major: [(row, start, end)]."""
    spans = []
    valid = is_image & attention_mask.bool()
    for b in range(valid.shape[0]):
        x = valid[b].to(torch.int8)
        d = torch.diff(x, prepend=x.new_zeros(1), append=x.new_zeros(1))
        starts = (d == 1).nonzero().squeeze(1).tolist()
        ends = (d == -1).nonzero().squeeze(1).tolist()
        spans.extend((b, s, e) for s, e in zip(starts, ends))
    return spans


def _expand_budgets(budget: BudgetSpec, item_of_image: list[int], batch: int) -> list[Budget | None]:
    """One budget per image: a scalar for all, or one entry per row (scalar or per-image list)."""
    if budget is None or isinstance(budget, (int, float)):
        return [budget] * len(item_of_image)
    budget = list(budget)
    if len(budget) != batch:
        raise ValueError(f"got {len(budget)} budgets for a batch of {batch}; pass one per question (or one for all)")
    out: list[Budget | None] = []
    seen: dict[int, int] = {}
    for b in item_of_image:
        entry = budget[b]
        j = seen.get(b, 0)
        seen[b] = j + 1
        if isinstance(entry, (list, tuple)):
            n_img = item_of_image.count(b)
            if len(entry) != n_img:
                raise ValueError(f"question {b} has {n_img} images but {len(entry)} budgets")
            out.append(entry[j])
        else:
            out.append(entry)
    return out


def _as_selection(result: Any, n: int) -> Selection:
    sel = result if isinstance(result, Selection) else Selection(kept=list(result))
    if len(sel.kept) != n:
        raise ValueError(f"selector returned kept indices for {len(sel.kept)} images, expected {n}")
    return sel


def _replacement(tokens: torch.Tensor, feats: torch.Tensor, i: int) -> torch.Tensor:
    """A selector's replacement tokens for image i, checked against the merger output [n_i, D]."""
    if tuple(tokens.shape) != tuple(feats.shape):
        raise ValueError(f"the selector returned visual_tokens of shape {tuple(tokens.shape)} for image {i}; "
                         f"expected {tuple(feats.shape)} (the merger output's raster layout [n_i, D])")
    return tokens.to(feats.device, feats.dtype)


def _validate_kept(kept, n_tokens, fallback, errors):
    """Sorted unique in-range non-empty indices per image; anything else keeps all tokens (and says why)."""
    out = []
    fallback, errors = list(fallback), list(errors)
    for i, (k, n) in enumerate(zip(kept, n_tokens)):
        problem = None
        if k is None:
            problem = "no indices returned"
        else:
            k = torch.as_tensor(k).long().flatten().cpu()
            if k.numel() == 0:
                problem = "empty selection (every image keeps at least one token)"
            elif int(k.min()) < 0 or int(k.max()) >= n:
                problem = f"indices outside [0, {n})"
            else:
                k = torch.unique(k)  # sorted ascending
        if problem is not None:
            out.append(torch.arange(n))
            fallback[i] = "keep_all"
            errors[i] = errors[i] or f"invalid selection: {problem}"
        else:
            out.append(k)
    return out, fallback, errors


class _PerImageOutputs:
    """Selector outputs that came back in pieces (per-item retry): slices by image."""

    def __init__(self, n: int, outs: list[tuple[list[int], Any]]):
        self.n = n
        self.where = {}
        for which, out in outs:
            for j, i in enumerate(which):
                self.where[i] = (out, j)

    def slice(self, imgs: list[int]) -> Any:
        pieces = [self.where.get(i) for i in imgs]
        if any(p is None or p[0] is None for p in pieces):
            return None
        out = pieces[0][0]
        if all(p[0] is out for p in pieces):
            return _slice_output(out, [p[1] for p in pieces])
        return None


def _slice_output(out: Any, imgs: list[int]) -> Any:
    """The selector output restricted to images `imgs` (lists and batch-first tensors are sliced)."""
    if isinstance(out, _PerImageOutputs):
        return out.slice(imgs)
    if not dataclasses.is_dataclass(out):
        return out
    per_image = getattr(out, "kept_indices", None)
    if not isinstance(per_image, (list, tuple)):
        return out
    n = len(per_image)
    idx = torch.tensor(imgs, dtype=torch.long)
    changes = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if f.name == "channel_names":  # per channel, not per image
            continue
        if isinstance(v, list) and len(v) == n:
            changes[f.name] = [v[i] for i in imgs]
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            changes[f.name] = v[idx.to(v.device)]
    return dataclasses.replace(out, **changes)
