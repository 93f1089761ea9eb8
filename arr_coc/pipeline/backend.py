"""The backend seam: everything the pruning pipeline needs of a vision-language model, and nothing more.

The pipeline (`look.py`, `looks.py`, `answer.py`) is written once against `VLMBackend`; a backend turns a
processor's output into a `Prompt`, encodes cells of its units with its vision tower, rewrites the prompt
to the kept tokens at their original positions, and runs its language model. Selectors reach a backend
only through `SelectionContext.backend`, for the two services the published methods need: attention from
a language-model layer (FastV) and the tower's last-block attention (VisionZip).

`arr_coc.qwen.QwenBackend` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL on transformers) is the first backend; a compiled
execution path or a serving engine is a second one, or an execution strategy of this one. docs/DESIGN.md,
"Adding a backend", shows one in twenty lines.

Shapes: N units in the batch, B rows, D the tower's output width (the language model's hidden size).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from .prompt import Prompt
from .tokens import VisualRows

if TYPE_CHECKING:
    from ..encode import EncodeConfig
    from ..validation.limits import InputLimits
    from ..stopwatch import Stopwatch
    from ..core.texture import WorkImages
    from ..core.grid import GridBatch


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
    """What the pipeline needs of a VLM (one implementation per model family group; see the module doc)."""

    family: str                 # e.g. "qwen2_vl": how traces and errors name the model
    pad_token_id: int           # what left-pads a row
    eos_token_ids: set[int]     # what ends an answer

    @property
    def device(self) -> torch.device: ...

    @property
    def text_hidden_size(self) -> int:
        """Width of the language model's embeddings (what the ARR-COC layer's question reader takes)."""

    # -- an adapter (run for pruned requests only; docs/DESIGN.md, "Adapters") -------------------------------

    @property
    def adapter_name(self) -> str:
        """The adapter's name (folder or hub id) as traces report it; "" when the backend has none."""

    def adapted(self, on: bool) -> AbstractContextManager[Any]:
        """Inside, the model runs with its adapter when `on` and it has one, the stock model otherwise. `prefill` and
        `decode` switch by themselves from `PrunedPrompt.adapted`; the tower is switched by the pipeline."""

    def adapter_flops(self, tower_cells: int, lm_tokens: int) -> int:
        """The adapter's extra FLOPs for a tower pass over `tower_cells` cells and an LM prefill of `lm_tokens`
        tokens (0 without one)."""

    # -- the request ----------------------------------------------------------------------------------------

    def input_limits(self) -> InputLimits:
        """The validator's limits for this model (its largest input size)."""

    def video_sampling(self) -> dict[str, Any]:
        """How this model samples a video's frames (`arr_coc.video.load_clip` keywords)."""

    def build_inputs(self, visuals: Sequence[Sequence[Any]], questions: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's tensors for a batch: visuals[b] are question b's images and clips, in order."""

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse (ValueError, before any work) an encoding this model cannot run."""

    def visual_kinds(self, inputs: Mapping[str, Any]) -> frozenset[str]:
        """What the processor's tensors hold: "image", "video", both or neither (a text-only batch)."""

    # -- the unpruned prompt --------------------------------------------------------------------------------

    def read_prompt(self, inputs: Mapping[str, Any], encode_all: bool, clock: Stopwatch | None = None,
                    record_attention: bool = False) -> Prompt:
        """Units, grids and rows of the processor's tensors; with encode_all the tower on every cell
        (`Prompt.visual`, `feats`, `deep`), its last-block attention recorded when asked (`tower_attention`)."""

    def pixels(self, prompt: Prompt) -> UnitPixels:
        """The units' pictures (the texture's input), made once per prompt."""

    def question_tokens(self, prompt: Prompt) -> list[list[int]]:
        """Per row, the question's token ids."""

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[N, L] token ids on the device -> [N, L, D] input embeddings (the VLM's dtype)."""

    def decode_text(self, ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens dropped."""

    # -- the tower on chosen cells (encode="before") ---------------------------------------------------------

    def encode_gist(self, prompt: Prompt, units: Sequence[int], grids: Sequence[tuple[int, int]]
                    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
        """The tower on each of `units` downscaled to its grid in `grids`: per unit [h_g * w_g, D] (+ per unit,
        one [h_g * w_g, D] per deepstack layer)."""

    def context_cells(self, prompt: Prompt, units: Sequence[int], chosen: Sequence[torch.Tensor],
                      encode: EncodeConfig) -> list[torch.Tensor]:
        """Per unit, ascending cells to encode for the chosen ones: + `encode.margin` rings, + whole windows."""

    def encode_cells(self, prompt: Prompt, units: Sequence[int], cells: Sequence[np.ndarray],
                     clock: Stopwatch | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The tower on `cells` of `units` (one packed pass, every cell at its true position):
        -> (tokens [sum K_i, D] unit after unit, deepstack per layer [sum K_i, D] or None)."""

    def encode_units(self, prompt: Prompt, units: Sequence[int]) -> torch.Tensor:
        """The tower on every cell of `units`, as the stock model encodes them: [sum n_i, D] (cost counting)."""

    def new_tower_memory(self) -> Any | None:
        """A memory for later looks' tower passes; None where the tower cannot attend to earlier looks' keys
        (then a later look's cells form a segment of their own)."""

    def remembering(self, memory: Any, units: Sequence[int] | None) -> AbstractContextManager[Any]:
        """Keep in `memory` the tower's keys and values of the pass run inside (segment j is units[j]; None: j)."""

    def attending(self, memory: Any, units: Sequence[int]) -> AbstractContextManager[Any]:
        """Inside, the tower's queries of `units` attend to what `memory` kept as well as to their own."""

    # -- the language model ---------------------------------------------------------------------------------

    def rewrite(self, prompt: Prompt, visual: VisualRows, lm_cells: Sequence[torch.Tensor],
                round_length: Callable[[int], int] | None = None) -> PrunedPrompt:
        """The prompt with only `lm_cells` of each unit, every token at its unpruned position; round_length: the
        rows' padded length from the longest row's (fixed shapes: `Buckets.prompt_for`)."""

    def prefill(self, pruned: PrunedPrompt, **forward: Any) -> Any:
        """One language-model forward over the pruned prompt (an output with `.logits`), the adapter running for the
        rows `pruned.adapted` marks."""

    def decode(self, pruned: PrunedPrompt, first_logits: bool = False, **generate: Any) -> Decoded:
        """Generation from the pruned prompt (greedy unless told otherwise) -> `Decoded`; first_logits keeps the
        first answer token's logits (what a saccade's gate reads); the adapter runs for the rows `pruned.adapted`
        marks."""

    def generate_text_only(self, inputs: Mapping[str, Any], **generate: Any) -> tuple[Decoded, list[int]]:
        """Generation for a batch without visuals (nothing to prune): the stock call -> (what it generated, each
        row's prompt length)."""

    # -- services for selectors -----------------------------------------------------------------------------

    def text_attention(self, prompt: Prompt, units: Sequence[int], visual_tokens: Sequence[torch.Tensor],
                       deepstack: Sequence[Sequence[torch.Tensor]] | None, layer: int) -> list[torch.Tensor]:
        """Per unit [n_i]: the attention its tokens get from their row's last prompt token at LM layer `layer`
        (1-based, mean over heads), running only layers 1..layer of the unpruned prompt (FastV)."""

    def tower_attention(self, prompt: Prompt, units: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per unit: (attention each cell receives in the tower's last block [n_i], its key [n_i, C]) (VisionZip)."""


__all__ = ["Decoded", "PrunedPrompt", "UnitPixels", "VLMBackend"]
