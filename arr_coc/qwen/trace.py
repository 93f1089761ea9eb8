"""What happened to one item: the trace every wrapper call returns beside its answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..budget import Budget, BudgetMode
from .rewrite import PrunedInputs

if TYPE_CHECKING:
    from ..layer import ARRCOCOutput


@dataclass
class Trace:
    """What happened to one item (one question with its images).

    Times are for the whole batch the item ran in (one prefill serves the batch).
    Per-image lists follow the item's images in prompt order.
    """

    method: str
    budget: Budget | list[Budget | None] | str | None   # as asked (per-image list when it differed; None: default)
    kept_tokens: int                             # visual tokens the LM saw, summed over the item's images
    total_tokens: int                            # visual tokens before pruning
    kept_per_image: list[int] = field(default_factory=list)
    total_per_image: list[int] = field(default_factory=list)
    kept_indices: list[torch.Tensor] = field(default_factory=list)   # LongTensor[K_i] raster indices, ascending
    grid_hw: list[tuple[int, int]] = field(default_factory=list)     # merged grid (h_i, w_i) per image
    budget_mode: BudgetMode | None = None        # as asked (None: the layer's default; arr_coc.budget)
    arr_coc: ARRCOCOutput | None = None          # the layer's output sliced to this item's images, or None
    fallback: list[str | None] = field(default_factory=list)        # per image: None | "grid" | "keep_all"
    error: str | None = None                     # why an image kept all its tokens, if it did
    prompt_tokens: int = 0                       # pruned prompt length (no padding)
    new_tokens: int = 0                          # generated tokens (first returned sequence)
    vision_s: float = 0.0                        # vision tower + merger
    select_s: float = 0.0                        # selector (ARR-COC layer incl. texture)
    prefill_s: float = 0.0                       # first LM forward (the prefill)
    encode: str = "after"                        # "after": every patch encoded; "before": chosen cells only
    encoded_cells: list[torch.Tensor] = field(default_factory=list)   # per image: cells encoded at full resolution
    periphery_cells: list[torch.Tensor] = field(default_factory=list)  # per image: cells carrying a gist token
    gist_grid: list[tuple[int, int]] = field(default_factory=list)    # per image: the gist's grid (before mode)
    total_s: float = 0.0                         # the whole call

    @property
    def kept_ratio(self) -> float:
        return self.kept_tokens / max(1, self.total_tokens)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no tensors)."""
        return {
            "method": self.method, "budget": self.budget, "budget_mode": self.budget_mode,
            "kept_tokens": self.kept_tokens,
            "total_tokens": self.total_tokens, "kept_per_image": self.kept_per_image,
            "total_per_image": self.total_per_image, "grid_hw": [list(g) for g in self.grid_hw],
            "fallback": self.fallback, "error": self.error, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "vision_s": self.vision_s, "select_s": self.select_s,
            "prefill_s": self.prefill_s, "total_s": self.total_s, "encode": self.encode,
            "encoded_per_image": [int(c.numel()) for c in self.encoded_cells],
            "periphery_per_image": [int(c.numel()) for c in self.periphery_cells],
            "gist_grid": [list(g) for g in self.gist_grid],
        }


@dataclass
class PrefillOutput:
    """logits [B, S', V] of the pruned prompt, the pruned inputs and per-item traces."""

    logits: torch.Tensor
    pruned: PrunedInputs
    traces: list[Trace]
