"""The backend seam: what the pruning pipeline needs of a vision-language model, as a small core and capabilities.

The core (`VLMBackend`: nine methods, four facts) is what pruning after the vision tower needs: the processor's
tensors, the prompt read as units, the units' pictures, the question's tokens and embeddings, the rewrite to the
kept tokens at their original positions, a prefill and a decoding. Everything else is a capability a backend may
implement, each a small Protocol below, checked where a request needs it (`require`: one line naming what is
missing, before any work):

    ChecksInputs    the validator's limits, a video's sampling          default: `inputs.LIMITS`, the reader's
    AnswersText     questions without a picture                           refused without it
    EncodesBefore   the tower on chosen cells only (encode="before")      refused without it
    RemembersTower  a later look attends to earlier looks' keys           a later look's own segment without it
    Adapts          LoRA adapters for pruned requests                     the stock model without it
    TextAttention   FastV's language-model attention                      FastV refused without it
    TowerAttention  VisionZip's last-block attention                      VisionZip refused without it
    CostsTower      the stock tower's cost (the evaluation's FLOPs)       refused without it
    TrainsThrough   losses through the frozen VLM (training)              refused without it
    TrainsAdapters  trainable adapters (train-adapter)                    refused without it
    FixedShapes     compiled fixed-shape execution (`--fast`)             refused without it
    LaysOutVisuals  the processor's grids of a batch, its image scale      the prompt's grids; downscale refused
    SharesWeights   another backend over the same weights (the app)       refused without it
    Describes       where it runs, its tokenizer (what tools report)       the device alone; no tokenizer notes

`arr_coc.qwen.QwenBackend` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL on transformers) implements all of them; a new family
registers its backend (`arr_coc.pipeline.registry`); docs/DESIGN.md, "Adding a backend", shows one.

Shapes: N units in the batch, B rows, D the tower's output width (the language model's hidden size).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from .layout import ImageScale, VisualGrid
from .prompt import Prompt
from .tokens import VisualRows

if TYPE_CHECKING:
    from ..encode import EncodeConfig
    from ..execution import Execution
    from ..validation.limits import InputLimits
    from ..stopwatch import Stopwatch
    from ..core.texture import WorkImages
    from ..core.grid import GridBatch
    from ..runtime import Runtime


@runtime_checkable
class UnitPixels(Protocol):
    """The units' pictures as a selector reads them: at the texture's resolution on the device, or on the host."""

    def work(self, px: int, grid: GridBatch | None = None) -> WorkImages:
        """Every unit at `px` pixels per cell, padded to the batch's largest grid, on the device."""

    @property
    def images(self) -> list[torch.Tensor]:
        """Per unit [3, H, W] in [0, 1] on the host (rebuilt once, when something asks)."""

    def subset(self, which: Sequence[int]) -> UnitPixels:
        """These units only, in this order."""


def is_unit_pixels(x: Any) -> bool:
    """isinstance(x, UnitPixels) as Python 3.12 checks it, members looked up statically (`inspect.getattr_static`):
    Python 3.11's protocol check calls hasattr on the instance, which runs `images` (a `PatchImages` rebuilds every
    picture on the host for it: 4.8 ms per 448 px picture)."""
    return all(inspect.getattr_static(x, m, _ABSENT) is not _ABSENT for m in _members(UnitPixels))


_ABSENT = object()


@runtime_checkable
class PrunedPrompt(Protocol):
    """A prompt after the rewrite: what the language model reads (the backend's own tensors behind it)."""

    kept_indices: list[torch.Tensor]   # per unit, LongTensor[K_i] ascending: the cells the LM reads
    lengths: list[int]                 # per row, tokens without padding
    width: int                         # the rows' length, padding included
    adapted: list[bool] | None         # per row, the backend's adapter runs for it (set by `look.prepare`); None: never

    def rows(self, rows: Sequence[int]) -> PrunedPrompt:
        """Batch rows `rows` on their own, in that order."""


@runtime_checkable
class Decoded(Protocol):
    """What `VLMBackend.decode` returns."""

    new_tokens: torch.Tensor             # [B * r, T] the answers' tokens only (pad after the end)
    sequences: torch.Tensor              # what the backend's generation returned (prompt + answer)
    prefill_s: float                     # the first forward's wall time
    first_logits: torch.Tensor | None    # [B * r, V] when asked for


@runtime_checkable
class VLMBackend(Protocol):
    """The core: what pruning after the vision tower needs of a VLM (nine methods and four facts).

    Everything else a backend may offer is a capability below; the pipeline asks for one where it needs it
    (`require`) and refuses in one line where the backend lacks it."""

    pad_token_id: int           # what left-pads a row
    eos_token_ids: set[int]     # what ends an answer

    @property
    def device(self) -> torch.device: ...

    @property
    def text_hidden_size(self) -> int:
        """Width of the language model's embeddings (what the ARR-COC layer's question reader takes)."""

    def build_inputs(self, visuals: Sequence[Sequence[Any]], questions: Sequence[str]) -> Mapping[str, Any]:
        """The processor's tensors for a batch: visuals[b] are question b's images and clips, in order."""

    def read_prompt(self, inputs: Mapping[str, Any], encode_all: bool, clock: Stopwatch | None = None) -> Prompt:
        """Units, grids and rows of the processor's tensors; with encode_all the tower on every cell
        (`Prompt.visual`, `feats`, `side`)."""

    def pixels(self, prompt: Prompt) -> UnitPixels:
        """The units' pictures (the texture's input), made once per prompt."""

    def question_tokens(self, prompt: Prompt) -> list[list[int]]:
        """Per row, the question's token ids."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[N, L] token ids on the device -> [N, L, D] input embeddings (the VLM's dtype)."""

    def decode_text(self, ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens dropped."""

    def rewrite(self, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor]) -> PrunedPrompt:
        """The prompt with only `lm_cells` of each unit, every token at its unpruned position."""

    def prefill(self, pruned: PrunedPrompt, **forward: Any) -> Any:
        """One language-model forward over the pruned prompt (an output with `.logits`); with `Adapts`, the adapter
        running for the rows `pruned.adapted` marks."""

    def decode(self, pruned: PrunedPrompt, first_logits: bool = False, **generate: Any) -> Decoded:
        """Generation from the pruned prompt (greedy unless told otherwise) -> `Decoded`; first_logits keeps the
        first answer token's logits (what a saccade's gate reads)."""


# ----------------------------------------------------------------------------- capabilities


@runtime_checkable
class ChecksInputs(Protocol):
    """The validator's limits and a video's sampling for this model (without it: `validation.limits.LIMITS`, the
    clip reader's defaults)."""

    def input_limits(self) -> InputLimits: ...

    def video_sampling(self) -> dict[str, Any]:
        """How this model samples a video's frames (`arr_coc.video.load_clip` keywords)."""


@runtime_checkable
class AnswersText(Protocol):
    """Questions without a picture: nothing to prune, the stock generation."""

    def visual_kinds(self, inputs: Mapping[str, Any]) -> frozenset[str]:
        """What the processor's tensors hold: "image", "video", both or neither (a text-only batch)."""

    def generate_text_only(self, inputs: Mapping[str, Any], **generate: Any) -> tuple[Decoded, list[int]]:
        """The stock generation of a batch without visuals -> (what it generated, each row's prompt length)."""


@runtime_checkable
class EncodesBefore(Protocol):
    """The tower on chosen cells only (encode="before"): a gist, the chosen cells' context, one packed pass."""

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse (ValueError, before any work) an encoding this model cannot run."""

    def encode_gist(self, prompt: Prompt, units: Sequence[int], grids: Sequence[tuple[int, int]]
                    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
        """The tower on each of `units` downscaled to its grid in `grids`: per unit [h_g * w_g, D] (+ per unit,
        one [h_g * w_g, D] per side-feature layer the LM reads, e.g. Qwen3-VL's deepstack)."""

    def context_cells(self, prompt: Prompt, units: Sequence[int], chosen: Sequence[torch.Tensor],
                      encode: EncodeConfig) -> list[torch.Tensor]:
        """Per unit, ascending cells to encode for the chosen ones (the chosen + the context the tower needs)."""

    def encode_cells(self, prompt: Prompt, units: Sequence[int], cells: Sequence[np.ndarray],
                     clock: Stopwatch | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The tower on `cells` of `units` (one packed pass, every cell at its true position):
        -> (tokens [sum K_i, D] unit after unit, side-feature layers [sum K_i, D] each, or None)."""

    def cost_by_count(self) -> bool:
        """Whether the tower's cost on a unit's cells depends on its grid and their number only (what the
        evaluation memoises FLOP counts by); False where it depends on which cells (window attention)."""


@runtime_checkable
class RemembersTower(Protocol):
    """A later look's tower attends to earlier looks' keys and values (without it, a later look's cells form a
    segment of their own)."""

    def new_tower_memory(self) -> Any | None:
        """A memory for later looks' tower passes; None where this model's tower cannot use one."""

    def remembering(self, memory: Any, units: Sequence[int] | None) -> AbstractContextManager[Any]:
        """Keep in `memory` the tower's keys and values of the pass run inside (segment j is units[j]; None: j)."""

    def attending(self, memory: Any, units: Sequence[int]) -> AbstractContextManager[Any]:
        """Inside, the tower's queries of `units` attend to what `memory` kept as well as to their own."""


@runtime_checkable
class Adapts(Protocol):
    """LoRA adapters run for pruned requests only (docs/DESIGN.md, "Adapters")."""

    @property
    def adapter_name(self) -> str:
        """The adapter's name (folder or hub id) as traces report it; "" when the backend has none loaded."""

    def load_adapter(self, adapter: Any) -> None:
        """Load adapters (a folder, a layer folder holding `adapter/`, a hub id, or an adapter object); the
        project's AdapterError when they do not fit the model."""

    def default_adapter(self, layer: Any, model_name: str) -> Any | None:
        """The adapter a trained layer's folder holds for this model (what `from_pretrained` loads unless told
        `adapter=False`), or None."""

    def adapted(self, on: bool) -> AbstractContextManager[Any]:
        """Inside, the model runs with its adapter when `on` and it has one, the stock model otherwise."""

    def save_adapter(self, folder: str, card: Any | None) -> bool:
        """The loaded adapter into `folder` in the format `load_adapter` reads, with `card` (an
        `adapter_files.AdapterCard`) or the adapter's own; -> False (nothing written) when none is loaded."""

    def adapter_flops(self, tower_cells: int, lm_tokens: int) -> int:
        """The adapter's extra FLOPs for a tower pass over `tower_cells` cells and an LM prefill of `lm_tokens`."""


@runtime_checkable
class TextAttention(Protocol):
    """The language model's attention to the visual tokens (FastV)."""

    def text_attention(self, prompt: Prompt, units: Sequence[int], visual_tokens: Sequence[torch.Tensor],
                       side: Sequence[Sequence[torch.Tensor]] | None, layer: int) -> list[torch.Tensor]:
        """Per unit [n_i]: the attention its tokens get from their row's last prompt token at LM layer `layer`
        (1-based, mean over heads), running only layers 1..layer of the unpruned prompt; `side`: the units' side
        features (`SelectionContext.side_features`), or None."""


@runtime_checkable
class TowerAttention(Protocol):
    """The tower's last-block attention (VisionZip)."""

    def read_prompt_recording(self, inputs: Mapping[str, Any], clock: Stopwatch | None = None) -> Prompt:
        """`read_prompt(inputs, encode_all=True)` with the tower's last-block attention kept for `tower_attention`
        (so the selector needs no second tower pass)."""

    def tower_attention(self, prompt: Prompt, units: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per unit: (attention each cell receives in the tower's last block [n_i], its key [n_i, C])."""


@runtime_checkable
class CostsTower(Protocol):
    """The stock tower on every cell of some units (what a full encoding costs: the evaluation's FLOP counts)."""

    def encode_units(self, prompt: Prompt, units: Sequence[int]) -> torch.Tensor: ...


@runtime_checkable
class TrainsThrough(Protocol):
    """Losses through the frozen VLM for training the layer (`soft_answer_loss`) and adapters
    (`pruned_answer_loss`)."""

    def answer_prompts(self, inputs: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
        """Per batch row of `build_inputs`' tensors, the backend's own tensors of its unpruned prompt, on the host:
        what `soft_answer_loss` reads (kept with an item's cached training features)."""

    def soft_answer_loss(self, prompt: Mapping[str, torch.Tensor], visual_tokens: torch.Tensor, answer: str,
                         keep: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of `answer` after one row's unpruned prompt (an `answer_prompts` entry) whose visual tokens
        [n, D] are `visual_tokens`, each weighted in the language model's attention by keep [n] in (0, 1]:
        differentiable in `keep` (and in `visual_tokens`)."""

    def pruned_answer_loss(self, pruned: PrunedPrompt, answers: Sequence[str]) -> torch.Tensor: ...

    def fingerprint(self) -> str:
        """A content hash of the weights and the processor (what a cache of features is keyed by)."""


@runtime_checkable
class TrainableAdapter(Protocol):
    """An adapter being trained (`TrainsAdapters.train_adapter`): its parameters, its dropout switch, its files."""

    name: str          # its folder or hub id as traces report it ("" until saved)
    trainable: bool    # its parameters take gradients when it runs

    def parameters(self) -> Any:
        """Its trainable parameters (an iterable of torch parameters)."""

    def dropout(self, on: bool) -> None:
        """Its dropout on (training steps) or off (validation)."""

    def save_pretrained(self, folder: Any, card: Any = None) -> None:
        """Its files into `folder` (`arr_coc.adapter_files`'s layout), with its card (`AdapterCard`)."""


@runtime_checkable
class TrainsAdapters(Protocol):
    """Adapters trained through the frozen VLM (`train-adapter`)."""

    def train_adapter(self, init: Any | None, rank: int, alpha: float, targets: Sequence[str], dropout: float,
                      seed: int) -> TrainableAdapter:
        """A trainable adapter on this model: the saved one at `init` (a folder or hub id), else a fresh LoRA of
        `rank` / `alpha` on the target groups (`adapter_files.TARGET_GROUPS`); `Adapts.load_adapter(it)` runs it."""


@runtime_checkable
class FixedShapes(Protocol):
    """Fixed-shape execution (`arr_coc.execution`): compiled stages, and rows padded to a bucket's length."""

    def use(self, execution: Execution) -> None:
        """Run the tower and the language model as `execution` says from now on."""

    def rewrite_fixed(self, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor],
                      round_length: Callable[[int], int]) -> PrunedPrompt:
        """`rewrite`, the rows padded to `round_length(longest row)` (`Buckets.prompt_for`)."""


@runtime_checkable
class LaysOutVisuals(Protocol):
    """The processor's layout of a batch's visuals, read from its tensors without the prompt (the evaluation's
    counts and coverage, the clip oracle), and how it scales an image to cells (`downscale`)."""

    def visual_grids(self, inputs: Mapping[str, Any]) -> list[VisualGrid]:
        """Per picture or clip of the batch (`build_inputs`' tensors), in prompt order."""

    def image_scale(self) -> ImageScale:
        """Pixels per cell side and the fewest cells of any image, as this model's processor makes them."""


@runtime_checkable
class SharesWeights(Protocol):
    """More front doors over one model's weights (the app's layers side by side), each with its own state."""

    def sibling(self) -> VLMBackend:
        """Another backend over the same weights (nothing copied), with its own adapter and execution state."""


@runtime_checkable
class Describes(Protocol):
    """What a tool reports of the model: where and how it runs, and its tokenizer (answer notes)."""

    @property
    def runtime(self) -> Runtime:
        """The device, dtype and attention kernels as loaded (`Runtime.describe()`: e.g. "cpu, float32, sdpa")."""

    @property
    def tokenizer(self) -> Any:
        """The text tokenizer (a transformers tokenizer: `unk_token_id`, called on text)."""


CAPABILITIES = (ChecksInputs, AnswersText, EncodesBefore, RemembersTower, Adapts, TextAttention, TowerAttention,
                CostsTower, TrainsThrough, TrainsAdapters, FixedShapes, LaysOutVisuals, SharesWeights, Describes)


class MissingCapability(ValueError):
    """A request needs what this model's backend does not implement (one line, before any work)."""


def has(backend: Any, capability: type) -> bool:
    """Whether `backend` implements `capability` (every member present)."""
    return isinstance(backend, capability)


def require(backend: Any, capability: type, what: str) -> Any:
    """`backend`, checked to implement `capability`; else MissingCapability saying what the request needed."""
    if not isinstance(backend, capability):
        missing = [m for m in _members(capability) if not hasattr(backend, m)]
        raise MissingCapability(f"this model's backend ({type(backend).__name__}) cannot {what}: it does not "
                                f"implement {capability.__name__} (missing {', '.join(missing)})")
    return backend


def _members(protocol: type) -> list[str]:
    return sorted(getattr(protocol, "__protocol_attrs__", ()) or
                  [n for n in vars(protocol) if not n.startswith("_")])


def adapted(backend: Any, on: bool) -> AbstractContextManager[Any]:
    """The backend's adapter switched to `on` (nothing to switch on a backend without `Adapts`)."""
    return backend.adapted(on) if isinstance(backend, Adapts) else nullcontext()


def adapter_name(backend: Any) -> str:
    """The loaded adapter's name, "" for none (or a backend without `Adapts`)."""
    return backend.adapter_name if isinstance(backend, Adapts) else ""


def visual_grids(backend: VLMBackend, inputs: Mapping[str, Any]) -> list[VisualGrid]:
    """Per picture or clip of the batch, in prompt order: the backend's `LaysOutVisuals.visual_grids`, or the
    prompt's units grouped by visual (a core-only backend: `read_prompt` without the tower)."""
    if has(backend, LaysOutVisuals):
        return backend.visual_grids(inputs)
    prompt = backend.read_prompt(inputs, encode_all=False)
    seen: dict[tuple[int, int], int] = {}     # (row, visual) -> its place in the list
    grids: list[VisualGrid] = []
    for i, row in enumerate(prompt.item_of_image):
        key = (row, prompt.visual_index[i])
        if key in seen:                       # a clip's later temporal group
            g = grids[seen[key]]
            grids[seen[key]] = VisualGrid(g.row, g.kind, g.groups + 1, g.grid_hw)
        else:
            seen[key] = len(grids)
            grids.append(VisualGrid(row, prompt.kind[i], 1, prompt.grid_hw[i]))
    return grids


def by_flag(flags: Sequence[bool]) -> list[tuple[list[int], bool]]:
    """Positions grouped by their flag, [(positions, flag)]: one group when all agree (the adapter's one split:
    a batch whose rows or units differ in whether the adapter runs is run once per setting, then merged)."""
    flags = [bool(f) for f in flags]
    if not flags or all(f == flags[0] for f in flags):
        return [(list(range(len(flags))), bool(flags and flags[0]))]
    return [([j for j, f in enumerate(flags) if f == on], on) for on in (False, True)]


__all__ = ["Adapts", "AnswersText", "CAPABILITIES", "ChecksInputs", "CostsTower", "Decoded", "Describes",
           "EncodesBefore", "FixedShapes", "LaysOutVisuals", "MissingCapability", "PrunedPrompt", "RemembersTower",
           "SharesWeights", "TextAttention", "TowerAttention", "TrainableAdapter", "TrainsAdapters", "TrainsThrough",
           "UnitPixels", "VLMBackend", "adapted", "adapter_name", "by_flag", "has", "is_unit_pixels", "require",
           "visual_grids"]
