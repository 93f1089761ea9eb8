"""What happened to one item: the trace every pipeline call returns beside its answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..budget import Budget, BudgetMode, budget_label, count_of
from ..resolution import (FOVEAL, GIST_ONLY, NOT_ENCODED, PERIPHERY, RESOLUTION_LEVELS,  # noqa: F401 - re-exported
                          UNREAD)
from ..core.temporal import minimum_count
from .choose import Choice, slice_output
from .fovea import nearest_cells

if TYPE_CHECKING:
    from ..core.output import ARRCOCOutput
    from .backend import PrunedPrompt
    from .fovea import Foveated, Gist
    from .prompt import Prompt

GRID_REASON = "low-structure image: its tokens were spread over an even grid instead of top-k"
ADAPTIVE = "adaptive"


@dataclass
class Look:
    """One look of encode="before" for one item (`Trace.looks`; passes > 1): what it added and what followed."""

    cells: list[torch.Tensor]        # per image: cells this look added to what the LM reads (look 1: its choice)
    encoded: list[torch.Tensor]      # per image: cells the tower encoded on this look (never one encoded before)
    prompt_tokens: int               # the prompt the LM prefilled on this look
    uncertainty: float               # of the first answer token after this look (`arr_coc.saccade.uncertainty`)
    strength: float                  # the gate's soft decision, sigmoid((uncertainty - threshold) * sharpness)
    go: bool                         # the gate's hard decision: look again (strength > 0.5)
    saccade: bool                    # another look followed (go, and passes were left)

    def to_dict(self) -> dict[str, Any]:
        return {"added_per_image": [int(c.numel()) for c in self.cells],
                "encoded_per_image": [int(c.numel()) for c in self.encoded], "prompt_tokens": self.prompt_tokens,
                "uncertainty": round(self.uncertainty, 6), "strength": round(self.strength, 6), "go": self.go,
                "saccade": self.saccade}


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
    fallback_reason: list[str | None] = field(default_factory=list)  # per image: why it fell back (None: it did not)
    prompt_tokens: int = 0                       # pruned prompt length (no padding)
    new_tokens: int = 0                          # generated tokens (first returned sequence)
    vision_s: float = 0.0                        # vision tower + merger (the gist included)
    gist_s: float = 0.0                          # of vision_s: the gist (encode="before" with a gist)
    select_s: float = 0.0                        # selector (ARR-COC layer incl. texture)
    arr_coc_s: float = 0.0                       # ARR-COC's own work: the selector + packing the chosen cells and
                                                 # the prompt (tower, gist and language model excluded)
    stages_s: dict[str, float] = field(default_factory=dict)   # wall time per stage of the batch's pass
    prefill_s: float = 0.0                       # first LM forward (the prefill)
    encode: str = "after"                        # "after": every patch encoded; "before": chosen cells only
    encoded_cells: list[torch.Tensor] = field(default_factory=list)   # per image: cells encoded at full resolution
    # (before mode: the chosen + context; `to_dict`'s margin_per_image counts the context, whole windows included)
    periphery_cells: list[torch.Tensor] = field(default_factory=list)  # per image: cells carrying a gist token
    gist_grid: list[tuple[int, int]] = field(default_factory=list)    # per image: the gist's grid (before mode)
    total_s: float = 0.0                         # the whole call
    # Per image: -1, or the item's video it is a temporal group of (a video reaches the trace as its groups),
    # and that group's index in its video.
    clip_per_image: list[int] = field(default_factory=list)
    group_per_image: list[int] = field(default_factory=list)
    # encode="before" with passes > 1: every look in order (the first one's choice, then each saccade);
    # kept_indices / encoded_cells / kept_tokens are then the union over the looks. Empty with one look.
    looks: list[Look] = field(default_factory=list)
    model: str = ""                              # which model answered (its folder or hub id; "" when not known)
    adapter: str = ""                            # the adapter that ran for this item (its folder or hub id); "": none
                                                 # (no adapter loaded, or every token kept: then the stock model ran)
    notes: list[str] = field(default_factory=list)   # what the user should know: a clip's minimum applied, ...
    bucket: dict[str, Any] | None = None         # fixed shapes, per image: "chosen" (the method's cells), "filled"
                                                 # (after filling to the bucket: what the LM read), and "prompt",
                                                 # the padded prompt length it ran at
    execution: str = "eager"                     # how it ran: "eager" or "fast" (fixed shapes, compiled)

    @property
    def kept_per_group(self) -> list[list[int]]:
        """Per video of the item, the tokens kept in each temporal group, in time order."""
        out: dict[int, list[int]] = {}
        for c, k in zip(self.clip_per_image, self.kept_per_image):
            if c >= 0:
                out.setdefault(c, []).append(k)
        return [out[c] for c in sorted(out)]

    @property
    def kept_ratio(self) -> float:
        return self.kept_tokens / max(1, self.total_tokens)

    def resolution(self, j: int = 0) -> torch.Tensor:
        """LongTensor[h_j * w_j] (raster): what each merged cell of image j became, a RESOLUTION_LEVELS index.

        FOVEAL: the chosen cells (`kept_indices`); UNREAD: encoded at full resolution and dropped before the
        language model (`encoded_cells` minus the chosen: the context in before mode, i.e. the margin and the
        rest of whole windows; the pruned cells in after mode); PERIPHERY: the footprint of every gist cell
        whose token the LM reads (`periphery_cells` holds the cell each token stands at); GIST_ONLY: the rest
        of an image that had a gist; NOT_ENCODED: the rest.
        """
        h, w = self.grid_hw[j]
        codes = torch.full((h * w,), GIST_ONLY if self.gist_grid else NOT_ENCODED, dtype=torch.long)
        if self.gist_grid and self.periphery_cells and self.periphery_cells[j].numel():
            under = nearest_cells((h, w), self.gist_grid[j])                 # [h * w] the gist cell under each cell
            codes[torch.isin(under, under[self.periphery_cells[j].long()])] = PERIPHERY
        encoded = self.encoded_cells[j] if self.encoded_cells else torch.arange(h * w)
        codes[encoded.long().cpu()] = UNREAD
        codes[self.kept_indices[j].long().cpu()] = FOVEAL
        return codes

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no tensors)."""
        return {
            "method": self.method, "budget": self.budget, "budget_mode": self.budget_mode,
            "kept_tokens": self.kept_tokens,
            "total_tokens": self.total_tokens, "kept_per_image": self.kept_per_image,
            "total_per_image": self.total_per_image, "grid_hw": [list(g) for g in self.grid_hw],
            "fallback": self.fallback, "error": self.error, "fallback_reason": self.fallback_reason,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "vision_s": self.vision_s, "gist_s": self.gist_s, "select_s": self.select_s,
            "arr_coc_s": self.arr_coc_s, "stages_s": {k: round(v, 6) for k, v in self.stages_s.items()},
            "prefill_s": self.prefill_s, "total_s": self.total_s, "encode": self.encode,
            "encoded_per_image": [int(c.numel()) for c in self.encoded_cells],
            "margin_per_image": [int(c.numel()) - int(k.numel()) for c, k in zip(self.encoded_cells, self.kept_indices)]
            if self.encode == "before" else [0] * len(self.encoded_cells),
            "periphery_per_image": [int(c.numel()) for c in self.periphery_cells],
            "gist_grid": [list(g) for g in self.gist_grid],
            "clip_per_image": self.clip_per_image, "group_per_image": self.group_per_image,
            "kept_per_group": self.kept_per_group,
            # the cells each image's question needs, by the layer's extent head (None: it has none)
            "extent_per_image": None if self.arr_coc is None or self.arr_coc.extent is None
            else [round(float(c), 2) for c in self.arr_coc.extent],
            "looks": [look.to_dict() for look in self.looks],
            "model": self.model,
            "adapter": self.adapter,
            "notes": list(self.notes),
            "bucket": self.bucket,
            "execution": self.execution,
        }


def item_traces(name: str, budgets: list[Budget | None], budget_mode: BudgetMode | None, prompt: Prompt,
                choice: Choice, lm_cells: list[torch.Tensor], pruned: PrunedPrompt, encode: str,
                fovea: Foveated | None, gist: Gist | None, timing: dict[str, Any]) -> list[Trace]:
    """One `Trace` per batch row (its units in prompt order), from what one look did. Host only.

    The budget is the one the units were pruned by (a missing one already resolved to the method's default),
    "adaptive" where the budget mode made the layer ignore it, 1.0 for every token."""
    traces = []
    for b in range(prompt.rows):
        imgs = prompt.units_of(b)
        asked = [1.0 if name == "none" else ADAPTIVE if budget_mode == ADAPTIVE else budgets[i] for i in imgs] or [None]
        fallback, errors = choice.fallback, choice.errors
        traces.append(Trace(
            method=name,
            budget=asked[0] if len(set(map(repr, asked))) == 1 else asked,
            budget_mode=budget_mode,
            kept_tokens=sum(int(lm_cells[i].numel()) for i in imgs),
            total_tokens=sum(prompt.n_tokens[i] for i in imgs),
            kept_per_image=[int(lm_cells[i].numel()) for i in imgs],
            total_per_image=[prompt.n_tokens[i] for i in imgs],
            kept_indices=[choice.kept[i].cpu() for i in imgs],
            grid_hw=[prompt.grid_hw[i] for i in imgs],
            arr_coc=slice_output(choice.arr_out, imgs) if choice.arr_out is not None and imgs else None,
            fallback=[fallback[i] for i in imgs],
            error="; ".join(e for e in (errors[i] for i in imgs) if e) or None,
            fallback_reason=[errors[i] or (GRID_REASON if fallback[i] == "grid" else fallback[i]) for i in imgs],
            prompt_tokens=pruned.lengths[b],
            encode=encode,
            encoded_cells=[fovea.encoded[i] for i in imgs] if fovea else [torch.arange(prompt.n_tokens[i]) for i in imgs],
            periphery_cells=[fovea.periphery[i] for i in imgs] if fovea else [],
            gist_grid=[gist.grid_hw[i] for i in imgs] if gist else [],
            clip_per_image=[prompt.clip[i] for i in imgs],
            group_per_image=[prompt.group[i] for i in imgs],
            notes=budget_notes(name, budgets, budget_mode, prompt, imgs, lm_cells),
            **timing,
        ))
    return traces


def budget_notes(name: str, budgets: list[Budget | None], budget_mode: BudgetMode | None, prompt: Prompt,
                 units: list[int], lm_cells: list[torch.Tensor]) -> list[str]:
    """What a row's clips kept beyond their budget, and why: a budget below a clip's minimum of one token per
    temporal group keeps that minimum (`temporal.allocate`), and says so here; nothing else may exceed it."""
    if name == "none" or budget_mode in (ADAPTIVE, "mean"):
        return []
    out = []
    for clip in sorted({prompt.clip[i] for i in units if prompt.clip[i] >= 0}):
        members = [i for i in units if prompt.clip[i] == clip]
        t, n = len(members), prompt.n_tokens[members[0]]
        allowed = count_of(budgets[members[0]], t * n)
        kept = sum(int(lm_cells[i].numel()) for i in members)
        if kept <= allowed:
            continue
        if kept <= minimum_count(t, n):
            out.append(f"The clip's budget ({budget_label(budgets[members[0]])}: {allowed} token"
                       f"{'s' if allowed != 1 else ''}) is below its minimum of one token per temporal group: it "
                       f"kept {kept}, one for each of its {t} groups.")
        else:
            out.append(f"The clip kept {kept} tokens, more than its budget's {allowed}.")
    return out


@dataclass
class PrefillOutput:
    """logits [B, S', V] of the pruned prompt, the pruned inputs and per-item traces."""

    logits: torch.Tensor
    pruned: PrunedPrompt
    traces: list[Trace]
