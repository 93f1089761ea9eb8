"""`ARRCOC`: the library's front door, for any VLM a backend serves.

    vlm = ARRCOC.from_pretrained("checkpoints/shapes-qwen2vl", arr_coc="checkpoints/arr-coc-shapes")
    answer, trace = vlm.generate(image, "What color is the star?", budget=0.1)

`from_pretrained` picks the backend by the checkpoint's `config.model_type` (`arr_coc.pipeline.registry`: Qwen2-VL,
Qwen2.5-VL and Qwen3-VL built in, others through the `arr_coc.backends` entry points); `ARRCOC(backend, ...)` wraps
a backend you built. Its public entry points:

    generate / respond   answer a request (images or clips + questions): friendly shapes / one result type
    answer               the same request from the processor's tensors (evaluation, the lmms-eval plugin)
    choose               the pure choice for one request: which cells this model's request would keep
    prepare              one look without decoding: what training and the evaluation's FLOP counts need

Each request runs with one `RequestContext` (backend, pruning, layer, seed, clock) built here; the fast path's
state is this object's `execution` (the backend's compiled stages and the layer's compiled pass follow it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence, Union

import torch

from .budget import BudgetMode, BudgetSpec
from .conversation import Conversation
from .encode import EncodeConfig, EncodeMode, as_encode_config
from .execution import Execution, read_fast_flag
from .core.layer import ARRCOCLayer, LayerSpec, build_layer
from .paths import check_layer_folder
from .pipeline.answer import Answered, Response, answer, respond
from .pipeline.backend import (Adapts, ChecksInputs, Describes, EncodesBefore, FixedShapes, VLMBackend, adapter_name,
                               has, require)
from .pipeline.context import RequestContext
from .pipeline.look import Prepared, prepare
from .pipeline.pure import Chosen, choose
from .pipeline.registry import load_backend
from .pipeline.request import Pruning
from .pipeline.selection import Selector
from .pipeline.trace import Trace
from .runtime import Runtime, check_supported
from .stopwatch import Stopwatch
from .validation.limits import LIMITS, InputLimits

# What `generate` returns: for one question (a string), (answer, trace) or the answer alone (return_trace=False);
# for a batch (a list of questions), (answers, traces) or the answers alone. An answer is a list of strings with
# num_return_sequences > 1. `respond` returns one shape: a `Response`.
Answer = Union[str, list[str]]
Answers = Union[tuple[Answer, Trace], Answer, tuple[list[Answer], list[Trace]], list[Answer]]


class ARRCOC:
    """A frozen VLM that answers with the visual tokens ARR-COC keeps (module docstring)."""

    def __init__(self, backend: VLMBackend, arr_coc: LayerSpec = None, execution: Execution | None = None,
                 seed: int = 0, name: str = "", adapter: Any = None):
        if isinstance(arr_coc, (str, os.PathLike)):  # refused here, not kept-all at the first request
            arr_coc = check_layer_folder(arr_coc)    # a hub id: its snapshot in the cache
        if adapter is not None:                      # checked against the model before it runs (AdapterError)
            require(backend, Adapts, "run LoRA adapters").load_adapter(adapter)
        self.backend = backend
        self.seed = seed
        self.name = name
        self._layer_spec = arr_coc
        self._layer: ARRCOCLayer | None = None
        self.execution = Execution.eager()
        if execution is not None:
            self.use(execution)

    @classmethod
    def from_pretrained(cls, model_id_or_path: str | os.PathLike, arr_coc: LayerSpec = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype | str | None = "auto",
                        attn_implementation: str | None = None, fast: bool | str | None = False,
                        adapter: Any = None, **kwargs: Any) -> ARRCOC:
        """The checkpoint's backend (by its model type), the layer and the adapter, checked before the model loads.

        device ("auto", "cpu", "cuda", "cuda:N"), dtype ("auto", "float32", "bfloat16", "float16") and
        attn_implementation mean what they mean on every command (`arr_coc.runtime`); the device defaults to the
        CPU here. arr_coc: a trained layer's folder or hub id, an `ARRCOCLayer`, an `ARRCOCConfig`, or None (the
        untrained layer). fast: True / "on" runs requests as fixed-shape compiled graphs, "auto" on a GPU only.
        adapter: LoRA adapters in peft's format (a folder, a layer folder holding `adapter/`, or a hub id), run only
        for requests that prune tokens; None (the default): the adapter the layer's folder holds when it was trained
        for this model (`Adapts.default_adapter`); False: none.
        """
        check_supported(Runtime.resolve(device, dtype, attn_implementation))   # wrong names: before anything is read
        if isinstance(arr_coc, (str, os.PathLike)):  # a layer that is not there, refused before the model loads
            arr_coc = check_layer_folder(arr_coc)
        backend = load_backend(model_id_or_path, adapter=adapter or None, device=device, dtype=dtype,  # checks the
                               attn_implementation=attn_implementation, **kwargs)          # adapter before loading
        if adapter is None and has(backend, Adapts):     # the layer's own, where it holds one for this model
            adapter = backend.default_adapter(arr_coc, os.fspath(model_id_or_path))
        return cls(backend, arr_coc=arr_coc, name=os.fspath(model_id_or_path),
                   execution=read_fast_flag(fast, backend.device), adapter=adapter or None)

    # -- state ----------------------------------------------------------------------------------------------

    def use(self, execution: Execution) -> ARRCOC:
        """Run every later request as `execution` says (`Execution.fast(device)`: buckets, compiled layer, tower and
        language model; `Execution.eager()`: every request its own shapes, eagerly). Returns self."""
        if execution.compiled or execution.buckets is not None:
            require(self.backend, FixedShapes, "run fixed shapes (fast=True, --fast on)")
        if isinstance(self.backend, FixedShapes):
            self.backend.use(execution)
        self.execution = execution
        if self._layer is not None:
            self.compile_layer(self._layer)
        return self

    def compile_layer(self, layer: ARRCOCLayer) -> None:
        """`layer`'s device pass as this object's execution says (compiled, its questions on buckets): what a second
        layer run on this model (`arr_coc_trained`) needs too."""
        ex = self.execution
        layer.compile_device_pass((lambda fn: ex.compile(fn, "the ARR-COC layer's device pass")) if ex.compiled else None,
                                  ex.buckets.question_for if ex.buckets is not None else (lambda n: n))

    @property
    def layer(self) -> ARRCOCLayer:
        """The ARR-COC layer, built on first use (so "none"/"grid"/"random" need none), on the VLM's device in
        float32 (moved there if the model was moved since)."""
        if self._layer is None:
            self._layer = build_layer(self._layer_spec, self.backend.text_hidden_size)
            self.compile_layer(self._layer)
        if self._layer.device != self.backend.device:
            self._layer.to(self.backend.device)
        return self._layer

    def save_pretrained(self, folder: str | os.PathLike, card: Any | None = None, adapter_card: Any | None = None
                        ) -> None:
        """The layer into `folder` (config.json, model.safetensors, README.md; `card`: a `core.persistence.LayerCard`)
        and the backend's loaded adapter, where it has one, into `folder/adapter/` (`adapter_card`: an
        `adapter_files.AdapterCard`): `from_pretrained(model, arr_coc=folder)` loads both back (the adapter as the
        layer folder's default)."""
        from .adapter_files import SUBFOLDER

        self.layer.save_pretrained(folder, card)
        if has(self.backend, Adapts):
            self.backend.save_adapter(os.path.join(os.fspath(folder), SUBFOLDER), adapter_card)

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def runtime(self) -> Runtime:
        """Where and how the VLM runs, as loaded (`runtime.describe()`: e.g. "cpu, bfloat16, sdpa"); a backend
        without `Describes` says its device alone."""
        return self.backend.runtime if has(self.backend, Describes) else Runtime(self.backend.device, None)

    @property
    def tokenizer(self) -> Any:
        """The backend's text tokenizer (`Describes`), or None."""
        return self.backend.tokenizer if has(self.backend, Describes) else None

    @property
    def adapter_name(self) -> str:
        """The loaded adapter's name, "" for none (or a backend without `Adapts`)."""
        return adapter_name(self.backend)

    def input_limits(self) -> InputLimits:
        """The validator's limits for this model (`ChecksInputs`; the library's defaults without it)."""
        return self.backend.input_limits() if has(self.backend, ChecksInputs) else LIMITS

    def video_sampling(self) -> dict[str, Any]:
        """How this model samples a video's frames (`ChecksInputs`; the clip reader's defaults without it)."""
        return dict(self.backend.video_sampling()) if has(self.backend, ChecksInputs) else {}

    def check_encode(self, encode: EncodeConfig | EncodeMode | None) -> None:
        """Refuse (ValueError, one line, before any work) an encoding this model cannot run: encode before on a
        backend without `EncodesBefore`, or what its tower cannot do (whole windows without windows)."""
        config = as_encode_config(encode)
        if config.mode == "before":
            require(self.backend, EncodesBefore, "encode before the vision tower (encode='before')"
                    ).check_encode(config)

    def request(self, pruning: Pruning, clock: Stopwatch | None = None) -> RequestContext:
        """The context one request runs with: this object's execution's buckets where the pruning names none."""
        if pruning.buckets is None and self.execution.buckets is not None:
            pruning = dataclasses.replace(pruning, buckets=self.execution.buckets)
        return RequestContext(self.backend, pruning, lambda: self.layer, self.seed, clock or Stopwatch())

    def _named(self, traces: Sequence[Trace]) -> None:
        for tr in traces:
            tr.model, tr.execution = self.name, self.execution.label

    # -- answering ------------------------------------------------------------------------------------------

    def respond(self, images: Sequence[Any], questions: Sequence[str], pruning: Pruning | None = None,
                max_new_tokens: int = 32, **gen_kwargs: Any) -> Response:
        """Answer questions[b] about images[b] (an image, a clip, or a list of them): one shape, a `Response`
        (answers, traces, the validator's notes, every look). pruning: `Pruning.of(...)` (default: ARR-COC at
        the layer's budget)."""
        visuals = [list(im) if isinstance(im, (list, tuple)) else ([] if im is None else [im]) for im in images]
        response = respond(self.request(pruning or Pruning.of()), visuals, questions, max_new_tokens, **gen_kwargs)
        self._named(response.traces)
        return response

    def generate(self, images: Any, questions: str | Sequence[str], budget: BudgetSpec = None,
                 method: str | Selector = "arr_coc", max_new_tokens: int = 32, return_trace: bool = True,
                 budget_mode: BudgetMode | None = None, encode: EncodeConfig | EncodeMode | None = None,
                 **gen_kwargs: Any) -> Answers:
        """Answer question(s) about image(s) with pruned visual tokens.

        Single item: `generate(image_or_list_of_images, "question")` -> (answer, trace); the question may be a
        conversation (`arr_coc.conversation.Conversation`, or its list of chat messages), whose last user turn
        is the question the cells are chosen for.
        Batch: `generate([img_or_list, ...], ["q1", ...])` -> (answers, traces).
        Each image is pruned by its own budget (a share, a count or a string such as "10%", arr_coc.budget);
        budget_mode chooses how ARR-COC meets it ("exact", "mean", "adaptive"; None: the layer's default); encode
        chooses what the vision tower encodes ("after": everything, "before": a gist, then only the chosen cells).
        With num_return_sequences > 1, an item's answer is a list of strings. return_trace=False returns the
        answers only. `respond` is the same call with one result type.
        """
        if _is_messages(questions):
            questions = Conversation.of(questions)
        single = isinstance(questions, (str, Conversation))
        if single:
            questions, images = [questions], [images]
        questions = [Conversation.of(q) if _is_messages(q) else q for q in questions]
        if len(images) != len(questions):
            raise ValueError(f"got {len(images)} image entries for {len(questions)} questions; pass one per question")
        got = self.respond(images, questions, Pruning.of(method, budget, budget_mode, encode), max_new_tokens,
                           **gen_kwargs)
        if single:
            return (got.answers[0], got.traces[0]) if return_trace else got.answers[0]
        return (got.answers, got.traces) if return_trace else got.answers

    def answer(self, inputs: dict[str, Any], pruning: Pruning, clock: Stopwatch | None = None,
               **gen_kwargs: Any) -> Answered:
        """The processor's tensors answered through the pipeline (every look, every trace)."""
        done = answer(self.request(pruning, clock), inputs, **gen_kwargs)
        self._named(done.traces)
        return done

    @torch.no_grad()
    def prepare(self, inputs: dict[str, Any], pruning: Pruning | None = None, clock: Stopwatch | None = None,
                **how: Any) -> Prepared:
        """One look (choose, encode, rewrite) without decoding -> `Prepared` (`.pruned`, `.traces`, and what a
        further look builds on); `backend.prefill(prepared.pruned)` runs the language model on it. pruning: a
        `Pruning`, or `Pruning.of`'s keywords in `how` (method, budget, budget_mode, encode, strict,
        kept_indices)."""
        state = prepare(self.request(pruning or Pruning.of(**how), clock), inputs)
        self._named(state.traces)
        return state

    # -- the pure choice ------------------------------------------------------------------------------------

    @torch.no_grad()
    def choose(self, image: Any, question: str, budget: BudgetSpec = None, method: str | Selector = "arr_coc",
               budget_mode: BudgetMode | None = None, encode: EncodeMode = "after") -> Chosen:
        """Which cells of `image` this model's request would keep for `question` (`arr_coc.pipeline.pure.choose`
        on the backend's pictures, grid and question tokens; encode "after" gives the selector the tower's tokens,
        as the pipeline does after the tower; "before" chooses from the pictures and the question alone)."""
        backend = self.backend
        prompt = backend.read_prompt(backend.build_inputs([[image]], [question]), encode_all=encode == "after")
        ids = backend.question_tokens(prompt)
        texts = [backend.decode_text(ids[b]) for b in prompt.item_of_image] if prompt.has_video else None
        return choose(backend.pixels(prompt), prompt.grid_hw, [ids[b] for b in prompt.item_of_image],
                      backend.embed_tokens, layer=lambda: self.layer, method=method, budget=budget,
                      budget_mode=budget_mode, visual_tokens=None if prompt.feats is None else list(prompt.feats),
                      seed=self.seed, pad_token_id=backend.pad_token_id, clips=list(prompt.clip) or None,
                      groups=list(prompt.group) or None, questions=texts)


def _is_messages(value: Any) -> bool:
    """A chat's list of messages (dicts with a role), as a client sends it."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m
                                                                      for m in value)


__all__ = ["ARRCOC", "Answer", "Answers"]
