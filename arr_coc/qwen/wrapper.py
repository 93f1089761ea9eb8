"""ARRCOCQwen: query-aware visual-token pruning inside Qwen-VL `generate()`, the library's front door.

A thin facade: a `QwenBackend` (the model and its processor behind the pipeline's backend interface), the
ARR-COC layer, and the pipeline (`arr_coc.pipeline`) doing the work:

    respond / generate     validate -> the processor's tensors -> one or more looks -> decoding -> text
    prepare / prefill      one look, for callers that run the language model themselves (evaluation, tests)

The VLM is pruned by rewriting its inputs, never by hooking the language model. Kept-all (method="none" or
budget 1.0) reproduces the stock forward exactly.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

from ..budget import BudgetMode, BudgetSpec
from ..encode import EncodeConfig, EncodeMode
from ..execution import Execution, read_fast_flag
from ..core.layer import ARRCOCLayer
from ..paths import check_layer_folder
from ..pipeline.answer import Answered, Response, answer, respond
from ..pipeline.look import Prepared, prepare
from ..pipeline.request import Pruning
from ..pipeline.selection import Selector
from ..pipeline.trace import PrefillOutput, Trace
from ..runtime import Runtime
from ..stopwatch import Stopwatch
from ..core.persistence import LayerCard
from .adapter import SUBFOLDER, Adapter, AdapterCard, adapter_folder, load_adapter
from .backend import QwenBackend
from .loading import LayerSpec, build_layer, load_vlm
from .processing import QwenProcessor
from .rewrite import PrunedInputs, model_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# What `generate` returns: for one question (a string), (answer, trace) or the answer alone
# (return_trace=False); for a batch (a list of questions), (answers, traces) or the answers alone. An answer is
# a list of strings with num_return_sequences > 1. `respond` returns one shape: a `Response`.
Answer = Union[str, list[str]]
Answers = Union[tuple[Answer, Trace], Answer, tuple[list[Answer], list[Trace]], list[Answer]]


class ARRCOCQwen:
    """A frozen Qwen2-VL / Qwen2.5-VL / Qwen3-VL model that answers with pruned visual tokens.

        wrapper = ARRCOCQwen.from_pretrained("Qwen/Qwen2-VL-2B-Instruct", arr_coc="checkpoints/arr_coc")
        answer, trace = wrapper.generate(image, "What colour is the circle?", budget=0.1)
    """

    def __init__(self, model: PreTrainedModel, processor: QwenProcessor, arr_coc: LayerSpec = None, seed: int = 0,
                 name: str = "", execution: Execution | None = None,
                 adapter: str | os.PathLike | Adapter | None = None):
        self.backend = QwenBackend(model.eval().requires_grad_(False), processor)   # refuses other families
        if isinstance(arr_coc, (str, os.PathLike)):  # refused here, not kept-all at the first request
            arr_coc = check_layer_folder(arr_coc)    # a hub id: its snapshot in the cache
        if adapter is not None:                      # checked against the model before it runs (AdapterError)
            self.backend.set_adapter(adapter if isinstance(adapter, Adapter) else load_adapter(model, adapter))
        self.family = self.backend.family
        self.model = model
        self.processor = processor
        self.seed = seed
        self.name = name or str(getattr(model.config, "_name_or_path", "") or "")
        self._arr_coc_spec = arr_coc
        self._arr_coc_layer: ARRCOCLayer | None = None
        self.tokenizer = self.backend.tokenizer
        self.tokens = self.backend.tokens
        self.image_token_id = self.tokens.image
        self.vision_end_id = self.tokens.vision_end
        self.im_end_id = self.tokens.im_end
        self.pad_token_id = self.backend.pad_token_id
        self.merge = self.backend.merge
        self.execution = Execution.eager()
        if execution is not None:
            self.use(execution)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_id_or_path: str | os.PathLike,
        arr_coc: LayerSpec = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = "auto",
        attn_implementation: str | None = None,
        fast: bool | str | None = False,
        adapter: str | os.PathLike | None = None,
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
        `ARRCOCLayer`, an `ARRCOCConfig`, or None (the untrained layer). fast: True / "on" runs requests as
        fixed-shape compiled graphs (`arr_coc.execution`), "auto" on a GPU only, False / "off" (the default)
        eagerly. adapter: LoRA adapters in peft's format (a folder, a layer folder holding `adapter/`, or a hub
        id), run only for requests that prune tokens (`arr_coc.qwen.adapter`); refused before the model runs
        when it does not fit the model.
        """
        if isinstance(arr_coc, (str, os.PathLike)):  # a layer that is not there, refused before the model loads
            arr_coc = check_layer_folder(arr_coc)
        if adapter is not None:                      # so is an adapter that is not there
            adapter_folder(adapter)
        model, processor = load_vlm(model_id_or_path, device=device, dtype=dtype,
                                    attn_implementation=attn_implementation, **kwargs)
        return cls(model, processor, arr_coc=arr_coc, name=os.fspath(model_id_or_path),
                   execution=read_fast_flag(fast, model.device), adapter=adapter)

    def use(self, execution: Execution) -> ARRCOCQwen:
        """Run every later request as `execution` says (`Execution.fast(device)`: buckets, compiled layer, tower and
        language model; `Execution.eager()`: every request its own shapes, eagerly). Returns self."""
        self.execution = execution
        self.backend.use(execution)
        if self._arr_coc_layer is not None:
            self.compile_layer(self._arr_coc_layer)
        return self

    def compile_layer(self, layer: ARRCOCLayer) -> None:
        """Run `layer`'s device pass as this wrapper's execution says (compiled, its questions on buckets)."""
        ex = self.execution
        layer.compile_device_pass(ex.compile if ex.compiled else None,
                                  ex.buckets.question_for if ex.buckets is not None else (lambda n: n))

    def pruning(self, pruning: Pruning) -> Pruning:
        """`pruning` with this wrapper's fixed shapes (its execution's buckets) where it names none."""
        if pruning.buckets is None and self.execution.buckets is not None:
            return dataclasses.replace(pruning, buckets=self.execution.buckets)
        return pruning

    @property
    def adapter(self) -> Adapter | None:
        """The LoRA adapters (`arr_coc.qwen.adapter.Adapter`), or None."""
        return self.backend.adapter

    def save_pretrained(self, folder: str | os.PathLike, card: LayerCard | None = None,
                        adapter_card: AdapterCard | None = None) -> None:
        """The ARR-COC layer into `folder` (config.json, model.safetensors, README.md) and, when there is one, the
        adapter beside it in `folder/adapter/` (peft's files): `from_pretrained(..., arr_coc=folder, adapter=folder)`
        loads both."""
        self.arr_coc_layer.save_pretrained(folder, card)
        if self.adapter is not None:
            self.adapter.save_pretrained(os.path.join(os.fspath(folder), SUBFOLDER), adapter_card)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def runtime(self) -> Runtime:
        """Where and how the VLM runs, as loaded (`runtime.describe()`: e.g. "cpu, bfloat16, sdpa")."""
        return Runtime(self.model.device, self.model.dtype, getattr(self.model.config, "_attn_implementation", None))

    @property
    def text_hidden_size(self) -> int:
        return self.backend.text_hidden_size

    @property
    def arr_coc_layer(self) -> ARRCOCLayer:
        """The ARR-COC layer, built on first use (so "none"/"grid"/"random" need no layer), on the VLM's device in
        float32 (moved there if the model was moved since)."""
        if self._arr_coc_layer is None:
            self._arr_coc_layer = build_layer(self._arr_coc_spec, self.text_hidden_size)
            self.compile_layer(self._arr_coc_layer)
        if self._arr_coc_layer.device != self.device:
            self._arr_coc_layer.to(self.device)
        return self._arr_coc_layer

    def layer(self) -> ARRCOCLayer:
        """The layer, as the pipeline asks for it (built on first use)."""
        return self.arr_coc_layer

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse (ValueError) an encoding this model cannot run, e.g. whole windows on a tower without windows."""
        self.backend.check_encode(encode)

    # -- inputs ---------------------------------------------------------------------------------------------

    def build_inputs(self, images: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Processor tensors for a batch: images[b] is the list of images of question b (left padding)."""
        return self.backend.build_inputs(images, questions)

    # -- the pipeline ---------------------------------------------------------------------------------------

    def respond(self, images: Sequence[Any], questions: Sequence[str], pruning: Pruning | None = None,
                max_new_tokens: int = 32, **gen_kwargs: Any) -> Response:
        """Answer questions[b] about images[b] (an image, a clip, or a list of them): one shape, a `Response`
        (answers, traces, the validator's notes, every look). pruning: `Pruning.of(...)` (default: ARR-COC at
        the layer's budget)."""
        visuals = [list(im) if isinstance(im, (list, tuple)) else ([] if im is None else [im]) for im in images]
        response = respond(self.backend, visuals, questions, self.pruning(pruning or Pruning.of()), self.layer,
                           self.seed, max_new_tokens, **gen_kwargs)
        for tr in response.traces:
            tr.model, tr.execution = self.name, self.execution.label
        return response

    def answer(self, inputs: dict[str, torch.Tensor], pruning: Pruning, clock: Stopwatch | None = None,
               **gen_kwargs: Any) -> Answered:
        """The processor's tensors answered through the pipeline (every look, every trace)."""
        done = answer(self.backend, model_tensors(inputs), self.pruning(pruning), self.layer, self.seed, clock,
                      **gen_kwargs)
        for tr in done.traces:
            tr.model, tr.execution = self.name, self.execution.label
        return done

    @torch.no_grad()
    def prepare(self, inputs: dict[str, torch.Tensor], budget: BudgetSpec = None, method: str | Selector = "arr_coc",
                kept_indices: Sequence[torch.Tensor] | None = None, budget_mode: BudgetMode | None = None,
                strict: bool = False, encode: EncodeConfig | EncodeMode | None = None,
                clock: Stopwatch | None = None) -> tuple[PrunedInputs, list[Trace]]:
        """One look: encode, select, rewrite. -> (the pruned inputs, per-item traces); `prepare_state` says more."""
        state = self.prepare_state(inputs, budget, method, kept_indices, budget_mode, strict, encode, clock)
        return state.pruned, state.traces

    @torch.no_grad()
    def prepare_state(self, inputs: dict[str, torch.Tensor], budget: BudgetSpec = None,
                      method: str | Selector = "arr_coc", kept_indices: Sequence[torch.Tensor] | None = None,
                      budget_mode: BudgetMode | None = None, strict: bool = False,
                      encode: EncodeConfig | EncodeMode | None = None, clock: Stopwatch | None = None) -> Prepared:
        """One look (`arr_coc.pipeline.look.prepare`) -> `Prepared`.

        budget: one budget for every image, or one entry per batch row (a budget, or a list with one budget per
        image of that row); None: the method's default (`Pruning`). budget_mode: "exact" | "mean" | "adaptive" |
        None. kept_indices: explicit LongTensor[K_i] per image (overrides `method`). strict: a failing selector
        raises (`SelectorFailed`) instead of keeping every token of the items it failed on. encode: "after"
        (default), "before", or an `EncodeConfig`. clock: where each stage's wall time goes (`Stopwatch`).
        """
        pruning = self.pruning(Pruning.of(method, budget, budget_mode, encode, strict, kept_indices))
        state = prepare(self.backend, model_tensors(inputs), pruning, self.layer, self.seed, clock)
        for tr in state.traces:
            tr.model, tr.execution = self.name, self.execution.label
        return state

    @torch.no_grad()
    def prefill(self, pruned: PrunedInputs, **forward_kwargs: Any) -> Any:
        """One LM forward over the pruned prompt (what the evaluation counts FLOPs around)."""
        return self.backend.prefill(pruned, **forward_kwargs)

    @torch.no_grad()
    def forward_pruned(self, budget: BudgetSpec = None, method: str | Selector = "arr_coc",
                       kept_indices: Sequence[torch.Tensor] | None = None, budget_mode: BudgetMode | None = None,
                       encode: EncodeConfig | EncodeMode | None = None, **inputs: Any) -> PrefillOutput:
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
        """model.generate on the pruned prompt (greedy unless told otherwise).
        -> (sequences [B * r, S' + new] as generate returns them on the pruned prompt, prefill seconds)."""
        decoded = self.backend.decode(pruned, **gen_kwargs)
        return decoded.sequences, decoded.prefill_s

    def generate(self, images: Any, questions: str | Sequence[str], budget: BudgetSpec = None,
                 method: str | Selector = "arr_coc", max_new_tokens: int = 32, return_trace: bool = True,
                 budget_mode: BudgetMode | None = None, encode: EncodeConfig | EncodeMode | None = None,
                 **gen_kwargs: Any) -> Answers:
        """Answer question(s) about image(s) with pruned visual tokens.

        Single item: `generate(image_or_list_of_images, "question")` -> (answer, trace).
        Batch: `generate([img_or_list, ...], ["q1", ...])` -> (answers, traces).
        Each image is pruned by its own budget (a share, a count or a string such as "10%",
        arr_coc.budget); budget_mode chooses how ARR-COC meets it ("exact", "mean", "adaptive";
        None: the layer's default); encode chooses what the vision tower encodes ("after": everything,
        "before": a gist, then only the chosen cells; see `prepare`). With num_return_sequences > 1,
        an item's answer is a list of strings. return_trace=False returns the answers only.
        `respond` is the same call with one result type.
        """
        single = isinstance(questions, str)
        if single:
            questions, images = [questions], [images]
        questions = list(questions)
        if len(images) != len(questions):
            raise ValueError(f"got {len(images)} image entries for {len(questions)} questions; pass one per question")
        pruning = Pruning.of(method, budget, budget_mode, encode)
        got = self.respond(images, questions, pruning, max_new_tokens, **gen_kwargs)
        if single:
            return (got.answers[0], got.traces[0]) if return_trace else got.answers[0]
        return (got.answers, got.traces) if return_trace else got.answers

    def model_generate(self, budget: BudgetSpec = None, method: str | Selector = "arr_coc", return_trace: bool = False,
                       budget_mode: BudgetMode | None = None, encode: EncodeConfig | EncodeMode | None = None,
                       **kwargs: Any):
        """Drop-in for `model.generate(**processor_outputs, ...)` with pruning.

        Returns sequences laid out as the stock call returns them — the ORIGINAL (unpruned) prompt followed by
        the new tokens — so `out[:, len(input_ids[0]):]` trimming code keeps working. return_trace=True returns
        (sequences, traces).
        """
        inputs = model_tensors(kwargs)
        gen_kwargs = {k: v for k, v in kwargs.items() if k not in inputs}
        t0 = time.perf_counter()
        done = self.answer(inputs, Pruning.of(method, budget, budget_mode, encode), **gen_kwargs)
        new = done.new_tokens
        r = new.shape[0] // inputs["input_ids"].shape[0]
        prompt = inputs["input_ids"].to(new.device).repeat_interleave(r, dim=0)
        sequences = torch.cat([prompt, new], dim=1)
        for tr in done.traces:
            tr.total_s = time.perf_counter() - t0
        return (sequences, done.traces) if return_trace else sequences


__all__ = ["ARRCOCQwen", "Answer", "Answers"]
