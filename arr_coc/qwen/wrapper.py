"""ARRCOCQwen: query-aware visual-token pruning inside Qwen-VL `generate()`.

The VLM is pruned by rewriting its inputs (`rewrite.py`), never by hooking the language model
(an in-forward hook is silently wrong for padded batches):

1. vision tower + merger once (`model.model.get_image_features`): visual tokens V_i [n_i, D]
   per image in raster order of the merged grid (Qwen3-VL also returns deepstack features,
   one [n_i, D] per deepstack layer);
2. a selector (ARR-COC by default; `arr_coc.selection`) picks K_i kept raster indices per image
   from the texture of the SAME resized image the processor produced (un-patchified from
   `pixel_values`), the question embeddings (the VLM's own input embeddings) and the visual
   tokens; the budget and budget mode reach it untouched;
3. `model.model.get_rope_index` gives the unpruned M-RoPE (t, h, w) positions; `rewrite` keeps
   each kept token's, drops the unkept pads and left-pads the rows again;
4. the language model prefills and generates from the pruned inputs.

Kept-all (method="none" or budget 1.0) reproduces the stock forward exactly.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

from ..budget import Budget, BudgetMode, BudgetSpec, check_mode
from ..cancel import checkpoint, stopping_kwargs
from ..inputs import check_items, check_max_new_tokens, limits_for
from ..layer import ARRCOCLayer
from ..paths import check_layer_folder
from ..runtime import Runtime
from ..stopwatch import Stopwatch
from ..selection import Selector, get_selector, selector_name, selects_before_encoding, selects_video, video_methods
from .encoding import EncodeConfig, EncodeMode, as_encode_config
from .foveation import Foveated, Gist, encode_gist, foveate, merge_gists
from .loading import MODEL_CLASSES, LayerSpec, build_layer, load_vlm
from .preparing import PromptTokens, Unpruned, patch_images, selection_context, unpruned
from .processing import IM_END, VISION_END, QwenProcessor, encode_prompts, video_sampling
from .rewrite import (PrunedInputs, VisualRows, expand_budgets, model_tensors, rewrite,
                      validate_kept)
from .selecting import Choice, run_selector
from .trace import PrefillOutput, Trace, item_traces

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


# What `generate` returns: for one question (a string), (answer, trace) or the answer alone
# (return_trace=False); for a batch (a list of questions), (answers, traces) or the answers alone. An answer is
# a list of strings with num_return_sequences > 1.
Answer = Union[str, list[str]]
Answers = Union[tuple[Answer, Trace], Answer, tuple[list[Answer], list[Trace]], list[Answer]]


@dataclass
class Prepared:
    """One look's result: what `prepare` returns (pruned, traces) and what a saccade builds on."""

    pruned: PrunedInputs
    traces: list[Trace]
    batch: Unpruned
    choice: Choice
    fovea: Foveated | None               # encode="before": the encoded cells and their tokens
    gist: Gist | None
    encoding: EncodeConfig
    budgets: list[Budget | None]
    budget_mode: BudgetMode | None = None
    selector: Selector | None = None      # what chose (None: given cells or every cell)


class ARRCOCQwen:
    """A frozen Qwen2-VL / Qwen2.5-VL / Qwen3-VL model that answers with pruned visual tokens.

        wrapper = ARRCOCQwen.from_pretrained("Qwen/Qwen2-VL-2B-Instruct", arr_coc="checkpoints/arr_coc")
        answer, trace = wrapper.generate(image, "What colour is the circle?", budget=0.1)
    """

    def __init__(self, model: PreTrainedModel, processor: QwenProcessor, arr_coc: LayerSpec = None, seed: int = 0):
        family = getattr(model.config, "model_type", None)
        if family not in MODEL_CLASSES:
            raise ValueError(
                f"ARRCOCQwen wraps {sorted(MODEL_CLASSES)} models; got model_type={family!r}. "
                "Load a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint."
            )
        if isinstance(arr_coc, (str, os.PathLike)):  # refused here, not kept-all at the first request
            arr_coc = check_layer_folder(arr_coc)    # a hub id: its snapshot in the cache
        self.family = family
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.seed = seed
        self._arr_coc_spec = arr_coc
        self._arr_coc_layer: ARRCOCLayer | None = None
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
        self.tokens = PromptTokens(image=self.image_token_id, video=int(cfg.video_token_id), vision_end=self.vision_end_id,
                                   im_end=self.im_end_id,
                                   pad=self.pad_token_id,
                                   special=frozenset(getattr(tok, "all_special_ids", []) or []))

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str | os.PathLike,
        arr_coc: LayerSpec = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = "auto",
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> ARRCOCQwen:
        """Load any of the three families from a hub id or a local folder (see `loading.load_vlm`).

        device ("auto", "cpu", "cuda", "cuda:N"), dtype ("auto", "float32", "bfloat16", "float16") and
        attn_implementation ("sdpa", "eager", "flash_attention_2"; None: transformers' default) mean what
        they mean on every command (`arr_coc.runtime`): "auto" is cuda in bfloat16 (float16 where the GPU
        lacks it) when a GPU is there, else cpu in float32. The device defaults to the CPU here (the commands
        default to "auto"), so library code that never asked for a GPU keeps running where it ran. The ARR-COC
        layer runs on the VLM's device in float32 whatever the VLM's dtype (`methods.arrcoc.run_layer`), and the
        VLM's activations keep theirs. arr_coc: a trained layer's folder or hub id ("owner/name"), an
        `ARRCOCLayer`, an `ARRCOCConfig`, or None (the untrained layer).
        """
        if isinstance(arr_coc, (str, os.PathLike)):  # a layer that is not there, refused before the model loads
            arr_coc = check_layer_folder(arr_coc)
        model, processor = load_vlm(model_id_or_path, device=device, dtype=dtype,
                                    attn_implementation=attn_implementation, **kwargs)
        return cls(model, processor, arr_coc=arr_coc)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def runtime(self) -> Runtime:
        """Where and how the VLM runs, as loaded (`runtime.describe()`: e.g. "cpu, bfloat16, sdpa")."""
        return Runtime(self.model.device, self.model.dtype, getattr(self.model.config, "_attn_implementation", None))

    @property
    def text_hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[-1])

    @property
    def arr_coc_layer(self) -> ARRCOCLayer:
        """The ARR-COC layer, built on first use (so "none"/"grid"/"random" need no layer), on the VLM's device in
        float32 (moved there if the model was moved since)."""
        if self._arr_coc_layer is None:
            self._arr_coc_layer = build_layer(self._arr_coc_spec, self.text_hidden_size)
        if self._arr_coc_layer.device != self.device:
            self._arr_coc_layer.to(self.device)
        return self._arr_coc_layer

    # -- inputs ----------------------------------------------------------------------

    def build_inputs(self, images: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Processor tensors for a batch: images[b] is the list of images of question b (left padding)."""
        return encode_prompts(self.processor, images, questions)

    # -- the pruning path ------------------------------------------------------------

    @torch.no_grad()
    def prepare(
        self,
        inputs: dict[str, torch.Tensor],
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        kept_indices: Sequence[torch.Tensor] | None = None,
        budget_mode: BudgetMode | None = None,
        strict: bool = False,
        encode: EncodeConfig | EncodeMode | None = None,
        clock: Stopwatch | None = None,
    ) -> tuple[PrunedInputs, list[Trace]]:
        """Encode, select, rewrite the inputs (one look). Returns the pruned inputs and per-item traces;
        `prepare_state`'s docstring says what each argument does."""
        state = self.prepare_state(inputs, budget, method, kept_indices, budget_mode, strict, encode, clock)
        return state.pruned, state.traces

    @torch.no_grad()
    def prepare_state(
        self,
        inputs: dict[str, torch.Tensor],
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        kept_indices: Sequence[torch.Tensor] | None = None,
        budget_mode: BudgetMode | None = None,
        strict: bool = False,
        encode: EncodeConfig | EncodeMode | None = None,
        clock: Stopwatch | None = None,
    ) -> Prepared:
        """Encode, select, rewrite the inputs; -> `Prepared` (the pruned inputs, per-item traces and what a
        further look needs: the batch, the choice, the foveal encoding).

        budget: one budget for every image, or one entry per batch row (a budget, or a list with
        one budget per image of that row); passed to the selector untouched (arr_coc.budget).
        budget_mode: "exact" | "mean" | "adaptive" | None, for ARR-COC. kept_indices: explicit
        LongTensor[K_i] per image (overrides `method`). strict: a failing selector raises
        (`SelectorFailed`) instead of keeping every token of the items it failed on.
        encode: "after" (default: the vision tower on every patch, then select) or "before" (a gist,
        select, then the tower on the chosen cells only), or an `EncodeConfig` (gist, margin, periphery,
        windows). clock: where each stage's wall time goes (`arr_coc.stopwatch`; `Stopwatch(device, sync=True)`
        times a GPU's kernels per stage, at one synchronisation per stage); the traces carry its totals.
        """
        t_start = time.perf_counter()
        clock = (clock or Stopwatch()).start()
        budget_mode = check_mode(budget_mode)
        encoding = as_encode_config(encode)
        encoding.check_family(self.family)      # e.g. whole windows on a tower without windows: before any work
        before = encoding.mode == "before"
        name, fn = self._selector(method, kept_indices, before)
        if inputs.get("pixel_values_videos") is not None and fn is not None and not selects_video(fn):
            raise ValueError(f"method {name!r} cannot prune a video: it reads the unpruned prompt's layout itself; "
                             f"choose one of {video_methods()} for videos")
        batch = unpruned(self.model, self.tokens, inputs, encode_all=not before, clock=clock)
        budgets = expand_budgets(budget, batch.item_of_image, batch.rows, batch.units.visual_index)
        gist, gist_failed, gist_s = None, {}, 0.0
        if before and fn is not None and encoding.gist > 0:
            t0 = time.perf_counter()
            images = patch_images(batch, self.processor).images
            gist, gist_failed = self._gist(images, batch.grid_hw, encoding.gist, strict)
            gist_s = time.perf_counter() - t0
            batch.vision_s += gist_s
            clock.lap("gist")
            checkpoint("gist")

        t0 = time.perf_counter()
        choice = self._choose(batch, fn, name, kept_indices, gist, budgets, budget_mode, strict, clock)
        for i, why in gist_failed.items():   # no coarse view, no informed choice: this image keeps every token
            choice.keep_all(i, batch.n_tokens[i], f"gist failed: {why}")
        choice.kept, choice.fallback, choice.errors = validate_kept(choice.kept, batch.n_tokens, choice.fallback,
                                                                    choice.errors)
        select_s = time.perf_counter() - t0
        clock.lap("select")
        checkpoint("selection")

        visual, lm_cells, fovea = batch.visual, choice.kept, None
        if before:
            fovea = foveate(self.model, batch.inputs["pixel_values"], batch.grid_thw, batch.grid_hw, choice.kept,
                            encoding, gist, clock)
            visual, lm_cells = fovea.visual, fovea.lm_cells
            batch.vision_s += clock.seconds["vision"]
            checkpoint("vision")
        elif any(r is not None for r in choice.replaced):   # the selector replaced some tokens (VisionZip)
            visual = VisualRows.every_cell(choice.replacing(batch.feats), batch.deep)
        pruned = rewrite(batch.host["input_ids"], batch.host["attention_mask"], batch.pos3_host, batch.spans, visual,
                         lm_cells, batch.encoder_output_cls, batch.item_of_image, batch.grid_hw, self.pad_token_id,
                         self.device, batch.units.kind)
        clock.lap("packing")
        timing = {"vision_s": batch.vision_s, "gist_s": gist_s, "select_s": select_s,
                  "arr_coc_s": select_s + clock.seconds["packing"], "total_s": time.perf_counter() - t_start,
                  "stages_s": dict(clock.seconds)}
        traces = item_traces(name, budgets, budget_mode, batch, choice, lm_cells, pruned, encoding.mode, fovea, gist,
                             timing)
        return Prepared(pruned, traces, batch, choice, fovea, gist, encoding, budgets, budget_mode, fn)

    def _selector(self, method: str | Selector, kept_indices: Sequence[torch.Tensor] | None,
                  before: bool) -> tuple[str, Selector | None]:
        """(the method's name in traces, its selector; None when nothing is selected), refused before any work
        when it cannot choose before the tower but has to."""
        name = "explicit" if kept_indices is not None and method == "arr_coc" else selector_name(method)
        fn = None if kept_indices is not None or name == "none" else \
            get_selector(method) if isinstance(method, str) else method
        if before and fn is not None and not selects_before_encoding(fn):
            raise ValueError(f"method {name!r} reads the encoded visual tokens, so it cannot choose before the "
                             "vision tower; run it with encode='after'")
        return name, fn

    def _choose(self, batch: Unpruned, fn: Selector | None, name: str, kept_indices: Sequence[torch.Tensor] | None,
                gist: Gist | None, budgets: list[Budget | None], budget_mode: BudgetMode | None,
                strict: bool, clock: Stopwatch | None = None) -> Choice:
        """Every image's kept cells: given, all of them (no selector), or the selector's on the whole batch."""
        n = len(batch.n_tokens)
        if kept_indices is not None:
            return Choice.of([torch.as_tensor(k, dtype=torch.long) for k in kept_indices], n)
        if fn is None:
            return Choice.of([torch.arange(k) for k in batch.n_tokens], n)
        tokens = list(batch.feats) if batch.feats is not None else gist.on_full_grid if gist is not None else None
        ctx = selection_context(self.model, lambda: self.arr_coc_layer, self.tokens, self.processor, batch, tokens,
                                budgets, budget_mode, self.seed, clock)
        return run_selector(fn, ctx, name, strict=strict)

    def _gist(self, images: list[torch.Tensor], grid_hw: list[tuple[int, int]], share: float,
              strict: bool) -> tuple[Gist, dict[int, str]]:
        """The gist of every image; if it fails on the batch, image by image, and an image whose gist
        still fails gets zeros (it will keep every token): -> (gist, {image: why})."""
        try:
            return encode_gist(self.model, self.processor, images, grid_hw, share), {}
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the images that cause it
            if strict:
                raise
            logger.warning("the gist failed on the batch (%s); retrying image by image", exc)
        parts: list[Gist | None] = []
        failed: dict[int, str] = {}
        for i, (im, g) in enumerate(zip(images, grid_hw)):
            try:
                parts.append(encode_gist(self.model, self.processor, [im], [g], share))
            except Exception as exc:  # noqa: BLE001
                parts.append(None)
                failed[i] = f"{type(exc).__name__}: {exc}"
        return merge_gists(parts, grid_hw, self.text_hidden_size), failed

    # -- running the LM ---------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, pruned: PrunedInputs, **forward_kwargs: Any) -> Any:
        """One LM forward over the pruned prompt (what the evaluation counts FLOPs around)."""
        return self.model(**pruned.model_kwargs(), **forward_kwargs)

    @torch.no_grad()
    def forward_pruned(
        self, budget: BudgetSpec = None, method: str | Selector = "arr_coc",
        kept_indices: Sequence[torch.Tensor] | None = None, budget_mode: BudgetMode | None = None,
        encode: EncodeConfig | EncodeMode | None = None, **inputs: Any,
    ) -> PrefillOutput:
        """Prune the processor's tensors and run the prefill: logits [B, S', V] + pruned inputs + traces."""
        t0 = time.perf_counter()
        pruned, traces = self.prepare(model_tensors(inputs), budget=budget, method=method, kept_indices=kept_indices,
                                      budget_mode=budget_mode, encode=encode)
        t1 = time.perf_counter()
        out = self.prefill(pruned)
        t2 = time.perf_counter()
        for tr in traces:
            tr.prefill_s = t2 - t1
            tr.total_s = t2 - t0
        return PrefillOutput(logits=out.logits, pruned=pruned, traces=traces)

    @torch.no_grad()
    def generate_pruned(self, pruned: PrunedInputs, **gen_kwargs: Any) -> tuple[torch.Tensor, float]:
        """model.generate on fresh pruned kwargs (greedy unless told otherwise).

        -> (sequences [B * r, S' + new] as generate returns them on the pruned prompt, prefill seconds).
        """
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
            kw = stopping_kwargs(kw)
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
        budget_mode: BudgetMode | None = None,
        encode: EncodeConfig | EncodeMode | None = None,
        **gen_kwargs: Any,
    ) -> Answers:
        """Answer question(s) about image(s) with pruned visual tokens.

        Single item: `generate(image_or_list_of_images, "question")` -> (answer, trace).
        Batch: `generate([img_or_list, ...], ["q1", ...])` -> (answers, traces).
        Each image is pruned by its own budget (a share, a count or a string such as "10%",
        arr_coc.budget); budget_mode chooses how ARR-COC meets it ("exact", "mean", "adaptive";
        None: the layer's default); encode chooses what the vision tower encodes ("after": everything,
        "before": a gist, then only the chosen cells; see `prepare`). With num_return_sequences > 1,
        an item's answer is a list of strings. return_trace=False returns the answers only.
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
        item_images, questions, _ = check_items(item_images, questions, limits_for(self.processor),
                                                sampling=video_sampling(self.processor))
        max_new_tokens = check_max_new_tokens(max_new_tokens)   # issue 39: the validator's words, not transformers'
        inputs = self.build_inputs(item_images, questions)
        sequences, new_tokens, traces = self._generate_from_inputs(
            inputs, budget, method, budget_mode, encode, max_new_tokens=max_new_tokens, **gen_kwargs)
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
                              budget_mode: BudgetMode | None = None, encode: EncodeConfig | EncodeMode | None = None,
                              **gen_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, list[Trace]]:
        """-> (sequences as generate returns them on the pruned prompt, new tokens only, traces). With passes > 1
        the looks' prompts differ, so the sequences are the new tokens alone."""
        if inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is None:  # text only
            kw = {"do_sample": False, "pad_token_id": self.pad_token_id, **gen_kwargs}
            kw = stopping_kwargs(kw)
            with torch.no_grad():
                seqs = self.model.generate(**{k: v.to(self.device) for k, v in inputs.items()}, **kw)
            S = inputs["input_ids"].shape[1]
            r = int(gen_kwargs.get("num_return_sequences", 1))
            traces = [Trace(method=selector_name(method), budget=None, kept_tokens=0, total_tokens=0,
                            prompt_tokens=int(m.sum()), new_tokens=seqs.shape[1] - S)
                      for m in inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))]
            return seqs, seqs[:, S:], traces[: seqs.shape[0] // r]
        if as_encode_config(encode).passes > 1:      # look again where one look was not enough (saccades.py)
            from .saccades import look

            looked = look(self, inputs, budget, method, budget_mode, encode=encode, **gen_kwargs)
            seqs = new = looked.new_tokens
            traces, prefill_s = looked.traces, sum(p.prefill_s for p in looked.passes)
        else:
            pruned, traces = self.prepare(inputs, budget=budget, method=method, budget_mode=budget_mode, encode=encode)
            seqs, prefill_s = self.generate_pruned(pruned, **gen_kwargs)
            new = seqs[:, pruned.input_ids.shape[1]:]
        r = int(gen_kwargs.get("num_return_sequences", 1))
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        for b, tr in enumerate(traces):
            tr.new_tokens = count_new(new[b * r].tolist(), eos, self.pad_token_id)
            tr.prefill_s = prefill_s      # passes > 1: every look's prefill
        return seqs, new, traces

    def model_generate(
        self,
        budget: BudgetSpec = None,
        method: str | Selector = "arr_coc",
        return_trace: bool = False,
        budget_mode: BudgetMode | None = None,
        encode: EncodeConfig | EncodeMode | None = None,
        **kwargs: Any,
    ):
        """Drop-in for `model.generate(**processor_outputs, ...)` with pruning.

        Returns sequences laid out as the stock call returns them — the ORIGINAL
        (unpruned) prompt followed by the new tokens — so `out[:, len(input_ids[0]):]`
        trimming code keeps working. return_trace=True returns (sequences, traces).
        """
        inputs = model_tensors(kwargs)
        gen_kwargs = {k: v for k, v in kwargs.items() if k not in inputs}
        t0 = time.perf_counter()
        _, new, traces = self._generate_from_inputs(inputs, budget, method, budget_mode, encode, **gen_kwargs)
        r = new.shape[0] // inputs["input_ids"].shape[0]
        prompt = inputs["input_ids"].to(new.device).repeat_interleave(r, dim=0)
        sequences = torch.cat([prompt, new], dim=1)
        for tr in traces:
            tr.total_s = time.perf_counter() - t0
        return (sequences, traces) if return_trace else sequences


def count_new(row: list[int], eos: set[int], pad: int | None) -> int:
    """Generated tokens up to and including the first end-of-sequence token (generate pads after it)."""
    for j, t in enumerate(row):
        if t in eos:
            return j + 1
    n = len(row)
    while n > 0 and row[n - 1] == pad:
        n -= 1
    return n
