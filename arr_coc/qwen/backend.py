"""`QwenBackend`: Qwen2-VL, Qwen2.5-VL and Qwen3-VL on transformers, as the pruning pipeline's backend.

Every call of `arr_coc.pipeline.backend.VLMBackend` is a few lines here over the modules that do the work:

    prompt.py      the prompt read as units (their pads, patch rows, the unpruned M-RoPE positions)
    pixels.py      the processor's patches as the texture's input, on the device
    encoding.py    the tower on chosen cells at their true positions (windows, position tables), the gist
    rewrite.py     the kept tokens at their original positions (`PrunedInputs`)
    attention.py   FastV's LM-prefix attention and VisionZip's last-block attention
    tower_memory.py  a later look's tower attends to earlier looks' keys and values
    families.py    what differs between the three families, one entry each

The language model is pruned by rewriting its inputs, never by hooking it (an in-forward hook is silently
wrong for padded batches); `forward(mm_encoder_outputs=...)` scatters the kept tokens into their pads.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..cancel import stopping_kwargs
from ..encode import EncodeConfig
from ..execution import Execution
from ..validation.limits import InputLimits, limits_for
from ..pipeline.backend import by_flag
from ..pipeline.layout import ImageScale, VisualGrid
from ..pipeline.prompt import IMAGE, Prompt
from ..pipeline.tokens import VisualRows
from ..runtime import Runtime
from ..stopwatch import Stopwatch
from .attention import LastBlockRecorder, attention_received, encoder_output, last_token_attention
from .compiled import CompiledQwen
from .encoding import cells_to_encode, encode_every_cell, encode_packed, encoder_output_class, gist_tokens
from .families import Family, family_of
from .pixels import PatchImages
from .processing import IM_END, VISION_END, QwenProcessor, encode_prompts, video_sampling
from .prompt import PromptTokens, question_tokens, read_prompt, user_header
from .rewrite import PrunedInputs, model_tensors, rewrite
from .tower_memory import TowerMemory, attending, remembering
from .train_inputs import answer_prompts, fingerprint
from .visuals import image_scale, visual_grids

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .adapter import Adapter


@dataclass
class Decoded:
    """What `QwenBackend.decode` returns.

    new_tokens    [B * r, T] the answers' tokens only
    sequences     [B * r, S' + T] as transformers' generate returns them on the pruned prompt
    prefill_s     the first forward's wall time (the prefill)
    first_logits  [B * r, V] the first answer token's logits, when asked for (else None)
    """

    new_tokens: torch.Tensor
    sequences: torch.Tensor
    prefill_s: float
    first_logits: torch.Tensor | None = None


class QwenBackend:
    """A frozen Qwen-VL model and its processor, behind the pipeline's `VLMBackend` interface."""

    def __init__(self, model: PreTrainedModel, processor: QwenProcessor):
        self.info: Family = family_of(model)       # ValueError naming the three families otherwise
        self.family = self.info.name
        self.model = model
        self.processor = processor
        tok = getattr(processor, "tokenizer", processor)
        self.tokenizer = tok
        cfg = model.config
        self.pad_token_id = (
            tok.pad_token_id if tok.pad_token_id is not None
            else model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None
            else 0
        )
        self.tokens = PromptTokens(image=int(cfg.image_token_id), video=int(cfg.video_token_id),
                                   vision_end=tok.convert_tokens_to_ids(VISION_END),
                                   im_end=tok.convert_tokens_to_ids(IM_END), pad=self.pad_token_id,
                                   special=frozenset(getattr(tok, "all_special_ids", []) or []),
                                   user_turn=user_header(tok))
        self.merge = int(cfg.vision_config.spatial_merge_size)
        self._encoder_output_cls: type | None = None
        self.compiled: CompiledQwen | None = None   # the fast path's compiled stages (`use`); None: eager
        self._memory_depth = 0                     # > 0 inside `remembering` / `attending`: the stock tower runs
        self.adapter: Adapter | None = None      # LoRA adapters (`adapter.py`), run only inside `adapted(True)`
        self._adapter_flops: tuple[int, int] | None = None

    def use(self, execution: Execution) -> None:
        """Run the tower and the language model as `execution` says (compiled: `CompiledQwen`)."""
        self.compiled = CompiledQwen(self.model, execution) if execution.compiled else None

    def _tower(self) -> AbstractContextManager:
        """The compiled tower, or the stock one: eager execution, or a look that reads or writes the tower's
        memory (`tower_memory.py` swaps the attention of its blocks: a graph of its own per look, not captured)."""
        stock = self.compiled is None or self._memory_depth > 0
        return nullcontext() if stock else self.compiled.tower()

    @contextmanager
    def _with_memory(self, inner: AbstractContextManager) -> Iterator[None]:
        self._memory_depth += 1
        try:
            with inner:
                yield
        finally:
            self._memory_depth -= 1

    def _language_model(self) -> AbstractContextManager:
        return self.compiled.language_model() if self.compiled is not None else nullcontext()

    def _encode_every_cell(self) -> Callable | None:
        """The full encoding through the compiled tower (every cell chosen), or None: the stock call."""
        if self.compiled is None:
            return None

        def encode(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[tuple, list[tuple] | None]:
            with self._tower():
                return encode_every_cell(self.model, pixel_values, grid_thw)
        return encode

    # -- facts ----------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def text_hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[-1])

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    @property
    def encoder_output_cls(self) -> type:
        if self._encoder_output_cls is None:
            self._encoder_output_cls = encoder_output_class(self.model)
        return self._encoder_output_cls

    # -- the adapter ----------------------------------------------------------------------------------------

    @property
    def adapter_name(self) -> str:
        """The adapter's folder or hub id ("adapter" for one not saved yet); "" when there is none."""
        return "" if self.adapter is None else (self.adapter.name or "adapter")

    def set_adapter(self, adapter: Adapter | None) -> None:
        self.adapter, self._adapter_flops = adapter, None

    def load_adapter(self, adapter: Any) -> None:
        """LoRA adapters from a folder, a layer folder holding `adapter/`, a hub id, or an `Adapter` (AdapterError
        when they do not fit this model)."""
        from .adapter import Adapter, load_adapter

        self.set_adapter(adapter if isinstance(adapter, Adapter) else load_adapter(self.model, adapter))

    def save_adapter(self, folder: str, card: Any | None) -> bool:
        """The adapter in peft's files (`Adapter.save_pretrained`); False when none is loaded."""
        if self.adapter is None:
            return False
        self.adapter.save_pretrained(folder, card)
        return True

    def train_adapter(self, init: Any | None, rank: int, alpha: float, targets: Sequence[str], dropout: float,
                      seed: int) -> Adapter:
        """A trainable adapter on this model: loaded from `init` (a folder or hub id), else a fresh peft LoRA."""
        from .adapter import attach_adapter, load_adapter

        if init:
            return load_adapter(self.model, init, trainable=True)
        return attach_adapter(self.model, rank, alpha, targets, dropout, seed)

    def default_adapter(self, layer: Any, model_name: str) -> str | None:
        """The layer folder whose `adapter/` was trained for this base model (`adapter.layer_adapter`), or None."""
        from .adapter import layer_adapter

        return layer_adapter(layer, self.model, model_name)

    def adapted(self, on: bool) -> AbstractContextManager:
        """Inside, the adapter runs when `on` (and there is one); the stock model otherwise."""
        return self.adapter.active(on) if self.adapter is not None else nullcontext()

    def adapter_flops(self, tower_cells: int, lm_tokens: int) -> int:
        """The adapter's extra FLOPs for a tower pass over `tower_cells` merged cells (merge^2 patch rows each, every
        block) and a language-model prefill over `lm_tokens` tokens (every layer): 2 r (d_in + d_out) per token
        per adapted linear. 0 without an adapter."""
        if self.adapter is None:
            return 0
        if self._adapter_flops is None:
            self._adapter_flops = self.adapter.flops_per_token()
        tower, lm = self._adapter_flops
        return tower * int(tower_cells) * self.merge ** 2 + lm * int(lm_tokens)

    def sibling(self) -> QwenBackend:
        """Another backend over this model and processor (no copy): its own adapter and compiled stages."""
        return QwenBackend(self.model.eval().requires_grad_(False), self.processor)

    @property
    def runtime(self) -> Runtime:
        """Where and how the VLM runs, as loaded (`runtime.describe()`: e.g. "cpu, bfloat16, sdpa")."""
        return Runtime(self.model.device, self.model.dtype, getattr(self.model.config, "_attn_implementation", None))

    # -- the request ----------------------------------------------------------------------------------------

    def visual_grids(self, inputs: Mapping[str, Any]) -> list[VisualGrid]:
        return visual_grids(inputs, self.tokens, self.merge)

    def image_scale(self) -> ImageScale:
        return image_scale(self.processor)

    def input_limits(self) -> InputLimits:
        return limits_for(self.processor)

    def video_sampling(self) -> dict[str, Any]:
        return video_sampling(self.processor)

    def build_inputs(self, visuals: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
        return encode_prompts(self.processor, visuals, questions)

    def check_encode(self, encode: EncodeConfig) -> None:
        self.info.check_encode(encode)

    def visual_kinds(self, inputs: Mapping[str, Any]) -> frozenset[str]:
        return frozenset(kind for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos"))
                         if inputs.get(key) is not None)

    # -- the unpruned prompt --------------------------------------------------------------------------------

    def read_prompt(self, inputs: Mapping[str, Any], encode_all: bool, clock: Stopwatch | None = None) -> Prompt:
        """The processor's tensors (any other keyword a caller passed along is left out) read as units."""
        return read_prompt(self.model, self.tokens, model_tensors(inputs), encode_all, self.encoder_output_cls, clock,
                           self._encode_every_cell())

    def read_prompt_recording(self, inputs: Mapping[str, Any], clock: Stopwatch | None = None) -> Prompt:
        """The full encoding through the stock tower (recording needs its stock call), its last-block attention
        kept for `tower_attention`."""
        with LastBlockRecorder(self.model) as recorder:
            prompt = read_prompt(self.model, self.tokens, model_tensors(inputs), True, self.encoder_output_cls, clock)
        prompt.native.tower_record = recorder.last
        return prompt

    def pixels(self, prompt: Prompt) -> PatchImages:
        if prompt.pixels is None:
            native = prompt.native
            prompt.pixels = PatchImages.of(native.inputs["pixel_values"], native.grid_thw, self.processor)
        return prompt.pixels

    def question_tokens(self, prompt: Prompt) -> list[list[int]]:
        return question_tokens(self.tokens, prompt)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def decode_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the tower on chosen cells --------------------------------------------------------------------------

    def encode_gist(self, prompt: Prompt, units: Sequence[int], grids: Sequence[tuple[int, int]]
                    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
        images = self.pixels(prompt).images
        return gist_tokens(self.model, self.processor, [images[i] for i in units], grids, self._encode_every_cell())

    def context_cells(self, prompt: Prompt, units: Sequence[int], chosen: Sequence[torch.Tensor],
                      encode: EncodeConfig) -> list[torch.Tensor]:
        grid_thw = prompt.native.grid_thw[list(units)]
        return cells_to_encode(self.model, grid_thw, [prompt.grid_hw[i] for i in units], chosen, encode)

    def encode_cells(self, prompt: Prompt, units: Sequence[int], cells: Sequence[np.ndarray],
                     clock: Stopwatch | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        native, units = prompt.native, list(units)
        kinds = native.units.kind
        calls = [c for c in ([j for j, u in enumerate(units) if kinds[u] == IMAGE],
                             [j for j, u in enumerate(units) if kinds[u] != IMAGE]) if c]
        if len(calls) == 1:
            return self._encode_packed(prompt, units, cells, clock)
        # Images and video groups in separate calls, as the stock model encodes them (a matrix product's rounding
        # can depend on how many rows it is given): keep-all equals the stock model bit for bit.
        done = [(c, self._encode_packed(prompt, [units[j] for j in c], [cells[j] for j in c], clock)) for c in calls]
        tokens: list[torch.Tensor | None] = [None] * len(units)
        deep: list[list[torch.Tensor | None]] | None = None
        for c, (out, layers) in done:
            for j, piece in zip(c, out.split([len(cells[j]) for j in c])):
                tokens[j] = piece
            if layers is not None:
                deep = deep or [[None] * len(units) for _ in layers]
                for d, layer in zip(deep, layers):
                    for j, piece in zip(c, layer.split([len(cells[j]) for j in c])):
                        d[j] = piece
        return torch.cat(tokens), None if deep is None else [torch.cat(d) for d in deep]

    def _encode_packed(self, prompt: Prompt, units: list[int], cells: Sequence[np.ndarray],
                       clock: Stopwatch | None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        native = prompt.native
        pixels = native.inputs["pixel_values"]
        if units != list(range(len(prompt.grid_hw))):
            pixels = _patch_rows(pixels, native.grid_thw, units)
        with self._tower():
            return encode_packed(self.model, pixels, native.grid_thw[units], cells, clock)

    @torch.no_grad()
    def cost_by_count(self) -> bool:
        return not self.info.windows      # Qwen2.5-VL's windows: which cells share a window changes the cost

    def encode_units(self, prompt: Prompt, units: Sequence[int]) -> torch.Tensor:
        """The stock tower + merger on every cell of `units` (what a full encoding of them costs)."""
        native, units = prompt.native, list(units)
        pixels = _patch_rows(native.inputs["pixel_values"], native.grid_thw, units)
        grid = native.grid_thw[units].to(self.device)
        return torch.cat(list(self.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output))

    def new_tower_memory(self) -> TowerMemory | None:
        """A memory for a later look's tower (None where the family's tower cannot use one: window order)."""
        return TowerMemory() if self.info.tower_memory else None

    def remembering(self, memory: TowerMemory, units: Sequence[int] | None) -> AbstractContextManager:
        return self._with_memory(remembering(self.model, memory, units))

    def attending(self, memory: TowerMemory, units: Sequence[int]) -> AbstractContextManager:
        return self._with_memory(attending(self.model, memory, units))

    # -- the language model ---------------------------------------------------------------------------------

    def rewrite(self, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor]) -> PrunedInputs:
        return self.rewrite_fixed(prompt, visual, lm_cells, None)

    def rewrite_fixed(self, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor],
                      round_length: Callable[[int], int] | None) -> PrunedInputs:
        """The rewrite, the rows padded to `round_length(longest row)` when given (a bucket's length)."""
        native = prompt.native
        return rewrite(native.host["input_ids"], native.host["attention_mask"], native.pos3_host, native.spans,
                       visual, list(lm_cells), native.encoder_output_cls, prompt.item_of_image, prompt.grid_hw,
                       self.pad_token_id, self.device, native.units.kind, round_length)

    @torch.no_grad()
    def prefill(self, pruned: PrunedInputs, **forward: Any) -> Any:
        """One forward; the adapter runs for the rows `pruned.adapted` marks (a batch of both: one forward each,
        the logits left-padded back into one batch)."""
        groups = by_flag(pruned.adapted or [False] * pruned.input_ids.shape[0])
        if len(groups) == 1:
            with self.adapted(groups[0][1]), self._language_model():
                return self.model(**pruned.model_kwargs(), **forward)
        outs = []
        for rows, on in groups:
            with self.adapted(on), self._language_model():
                outs.append((rows, self.model(**pruned.rows(rows).model_kwargs(), **forward)))
        width = max(o.logits.shape[1] for _, o in outs)
        logits = outs[0][1].logits.new_zeros(pruned.input_ids.shape[0], width, outs[0][1].logits.shape[-1])
        for rows, o in outs:
            logits[rows, width - o.logits.shape[1]:] = o.logits
        return type(outs[0][1])(logits=logits)

    @torch.no_grad()
    def decode(self, pruned: PrunedInputs, first_logits: bool = False, **generate: Any) -> Decoded:
        """model.generate on fresh pruned kwargs (greedy unless told otherwise); the adapter runs for the rows
        `pruned.adapted` marks (a batch of both: one generation each, merged as one batch's would be)."""
        groups = by_flag(pruned.adapted or [False] * pruned.input_ids.shape[0])
        if len(groups) == 1:
            with self.adapted(groups[0][1]):
                return self._generate(pruned, first_logits, **generate)
        parts = []
        for rows, on in groups:
            with self.adapted(on):
                parts.append((rows, self._generate(pruned.rows(rows), first_logits, **generate)))
        return merge_decoded(parts, pruned.input_ids.shape[0], pruned.input_ids.shape[1], self.pad_token_id)

    def _generate(self, pruned: PrunedInputs, first_logits: bool = False, **generate: Any) -> Decoded:
        """model.generate on fresh pruned kwargs, its prefill timed by hooks on this instance, removed right after."""
        marks: list[float] = []

        def pre_hook(module, args, kwargs):
            if len(marks) == 0:
                marks.append(time.perf_counter())

        def post_hook(module, args, kwargs, output):
            if len(marks) == 1:
                marks.append(time.perf_counter())

        h1 = self.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        h2 = self.model.register_forward_hook(post_hook, with_kwargs=True)
        kw = {"do_sample": False, "pad_token_id": self.pad_token_id,
              **(self.compiled.generate_kwargs() if self.compiled is not None else {}), **generate}
        if first_logits:
            kw.update(output_logits=True, return_dict_in_generate=True)
        try:
            with self._language_model():
                out = self.model.generate(**pruned.model_kwargs(), **stopping_kwargs(kw))
        finally:
            h1.remove()
            h2.remove()
        prefill_s = marks[1] - marks[0] if len(marks) == 2 else float("nan")
        seqs = out.sequences if first_logits else out
        return Decoded(seqs[:, pruned.input_ids.shape[1]:], seqs, prefill_s, out.logits[0] if first_logits else None)

    @torch.no_grad()
    def generate_text_only(self, inputs: Mapping[str, Any], **generate: Any) -> tuple[Decoded, list[int]]:
        """The stock generation of a batch without visuals -> (what it generated, each row's prompt length)."""
        kw = stopping_kwargs({"do_sample": False, "pad_token_id": self.pad_token_id, **generate})
        seqs = self.model.generate(**{k: v.to(self.device) for k, v in inputs.items()}, **kw)
        width = inputs["input_ids"].shape[1]
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))
        return Decoded(seqs[:, width:], seqs, float("nan")), [int(m.sum()) for m in mask]

    # -- training through the frozen model ------------------------------------------------------------------

    def answer_prompts(self, inputs: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
        """Per row, its unpruned prompt on the host (`train_inputs.answer_prompts`): input_ids, image_grid_thw."""
        return answer_prompts(inputs, self.tokens, self.merge)

    def fingerprint(self) -> str:
        return fingerprint(self.model, self.processor)

    def soft_answer_loss(self, prompt: Mapping[str, torch.Tensor], visual_tokens: torch.Tensor, answer: str,
                         keep: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of `answer` (+ <|im_end|>) after the unpruned prompt of one image (an `answer_prompts`
        entry: input_ids [1, S], image_grid_thw [1, 3]), with each visual token's attention column weighted by
        keep[i] in (0, 1] (log keep added to the causal mask), so the loss is differentiable in `keep` [n].
        visual_tokens [n, D]: what the language model reads."""
        input_ids, image_grid_thw = prompt["input_ids"], prompt["image_grid_thw"]
        model, dev = self.model, keep.device
        answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.tokens.im_end]
        full = torch.cat([input_ids, torch.tensor([answer_ids])], 1).to(dev)
        is_image = full == self.tokens.image
        pos, _ = model.model.get_rope_index(full, is_image.int(), image_grid_thw=image_grid_thw.to(dev))
        with torch.no_grad():
            embeds = model.get_input_embeddings()(full)
        # differentiable in the visual tokens (an adapter's tower trains through them; frozen features have no grad)
        embeds = embeds.masked_scatter(is_image[..., None], visual_tokens.to(dev, embeds.dtype))
        s = full.shape[1]
        bias = torch.zeros(s, device=dev).index_put((torch.nonzero(is_image[0])[:, 0],), torch.log(keep.clamp_min(1e-6)))
        causal = torch.full((s, s), float("-inf"), device=dev).triu(1)
        mask = (causal + bias[None, :]).to(embeds.dtype)[None, None]
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=pos[-3:],
                                            attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[0, -len(answer_ids) - 1: -1])
        return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(answer_ids, device=dev))

    def pruned_answer_loss(self, pruned: PrunedInputs, answers: Sequence[str]) -> torch.Tensor:
        """Mean over rows of the cross-entropy of answers[b] (+ <|im_end|>) after row b of the pruned prompt: the
        model reads exactly what it reads when it answers (the kept tokens at their original positions, the answer
        at the positions generate gives it), the adapter running for the rows `pruned.adapted` marks.
        Differentiable in the pruned features and in whatever trains inside the model (an adapter)."""
        losses = []
        for b, text in enumerate(answers):
            row = pruned.rows([b])
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokens.im_end]
            kw = row.model_kwargs()
            new = torch.tensor([ids], device=kw["input_ids"].device, dtype=kw["input_ids"].dtype)
            pos = kw["position_ids"]                                   # [4, 1, S]: +1 per token on every row
            kw["position_ids"] = torch.cat([pos, pos[:, :, -1:] + torch.arange(1, len(ids) + 1, device=pos.device)], 2)
            kw["input_ids"] = torch.cat([kw["input_ids"], new], 1)
            kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(new).to(kw["attention_mask"])], 1)
            with self.adapted(bool(row.adapted and row.adapted[0])):
                logits = self.model(**kw, logits_to_keep=len(ids) + 1).logits[0, :-1]
            losses.append(torch.nn.functional.cross_entropy(logits.float(), new[0]))
        return torch.stack(losses).mean()

    # -- services for selectors -----------------------------------------------------------------------------

    def text_attention(self, prompt: Prompt, units: Sequence[int], visual_tokens: Sequence[torch.Tensor],
                       side: Sequence[Sequence[torch.Tensor]] | None, layer: int) -> list[torch.Tensor]:
        """FastV's score per unit; `units` must hold every unit of their rows (a selection context split by item)."""
        native = prompt.native
        rows = sorted({prompt.item_of_image[i] for i in units})
        ids = native.inputs["input_ids"][rows]
        mask = native.inputs["attention_mask"][rows]
        enc = encoder_output(self.model, list(visual_tokens),
                                       None if side is None else [list(d) for d in side])
        attn = last_token_attention(self.model, ids, mask, native.pos3[:, rows], enc, layer)  # [R, S]
        local = {b: j for j, b in enumerate(rows)}
        return [attn[local[b], s:e] for b, s, e in (native.spans[i] for i in units)]

    @torch.no_grad()
    def tower_attention(self, prompt: Prompt, units: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """VisionZip's (received, keys) per unit, from the pipeline's own tower pass when it was recorded
        (`read_prompt_recording`), else from a second pass under a recorder."""
        native = prompt.native
        record = getattr(native, "tower_record", None)
        if record is None:
            with LastBlockRecorder(self.model) as own:
                self.model.model.get_image_features(native.inputs["pixel_values"], native.inputs["image_grid_thw"],
                                                    return_dict=True)
            record = native.tower_record = own.last
        per_unit = attention_received(self.model.model.visual, record, native.inputs["image_grid_thw"])
        return [per_unit[i] for i in units]


def merge_decoded(parts: Sequence[tuple[list[int], Decoded]], rows: int, width: int, pad: int) -> Decoded:
    """One batch's `Decoded` from generations over some of its rows each: answers right-padded, each sequence's
    prompt left-padded to the whole batch's width `width` (what one generation of the batch returns)."""
    reps = parts[0][1].new_tokens.shape[0] // len(parts[0][0])        # num_return_sequences
    longest = max(d.new_tokens.shape[1] for _, d in parts)
    ref = parts[0][1].new_tokens
    new = ref.new_full((rows * reps, longest), pad)
    seqs = ref.new_full((rows * reps, width + longest), pad)
    logits = None
    for rs, d in parts:
        at = torch.tensor([b * reps + j for b in rs for j in range(reps)], device=ref.device)
        t, s = d.new_tokens.shape[1], d.sequences.shape[1] - d.new_tokens.shape[1]
        new[at, :t] = d.new_tokens
        seqs[at, width - s: width + t] = d.sequences
        if d.first_logits is not None:
            if logits is None:
                logits = d.first_logits.new_zeros(rows * reps, d.first_logits.shape[-1])
            logits[at] = d.first_logits
    return Decoded(new, seqs, sum(d.prefill_s for _, d in parts), logits)


def _patch_rows(pixel_values: torch.Tensor, grid_thw: torch.Tensor, units: Sequence[int]) -> torch.Tensor:
    """The patch rows of `units` (processor order), concatenated."""
    sizes = [int(t) * int(h) * int(w) for t, h, w in grid_thw.tolist()]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in units])
    return pixel_values.index_select(0, torch.as_tensor(rows, device=pixel_values.device))


__all__ = ["Decoded", "QwenBackend", "merge_decoded"]
