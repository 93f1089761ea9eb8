"""The pure choice: which cells to keep, for these pixels and this question, at this budget.

No backend, no prompt, no processor: a unit's pictures (or any `UnitPixels`, e.g. the processor's patches), its
merged-cell grid, its question's token ids with the embedding that reads them, a budget and a layer in; the kept
cells and what the microscope shows of the choice out. It is what a serving engine's model class calls (vLLM:
the cells are chosen where its encoder runs, before or after the tower), and what the pipeline itself runs: both
build the same `SelectionContext` and run the same selector through `choose.run_selector`, so a cell chosen here is
the cell the pipeline would choose.

    chosen = choose(pictures, grid_hw, question_ids, embed, layer=layer, budget=0.1)
    chosen.kept[0]     # LongTensor[K_0], ascending raster indices of unit 0's kept cells
    chosen.output      # the layer's maps (relevance, the three scorers, the texture), or None for other methods

Every registered method runs this way except those that read the VLM itself (`Method.vlm`: FastV, VisionZip),
which are refused in one line; methods that read the encoded visual tokens (DivPrune, CDPruner) need them passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..budget import Budget, BudgetMode, BudgetSpec
from ..core.grid import GridBatch
from ..core.texture import WorkImages, work_images
from .backend import UnitPixels, is_unit_pixels
from .choose import (every_token_units, keep_every_token, padded_questions, run_selector, unit_counts,
                     validate_kept)
from .prompt import clip_members
from .request import Pruning, uses_layer
from .selection import SelectionContext, Selector, method_info, selects_before_encoding

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer
    from ..core.output import ARRCOCOutput


@dataclass
class HostPixels:
    """Pictures as tensors ([3, H, W] in [0, 1], each already at its grid's size in pixels or any size: the texture
    resizes each to its grid), as a selector reads them (`UnitPixels`)."""

    pictures: list[torch.Tensor]

    def work(self, px: int, grid: GridBatch | None = None) -> WorkImages:
        return work_images(self.pictures, grid, px)

    @property
    def images(self) -> list[torch.Tensor]:
        return self.pictures

    def subset(self, which: Sequence[int]) -> HostPixels:
        return HostPixels([self.pictures[i] for i in which])


@dataclass
class Chosen:
    """The pure choice's answer, per unit: kept cells (ascending, on the host), the count and budget it met, and
    why a unit kept every cell where it did (`fallback` "keep_all" / "grid", `errors`)."""

    kept: list[torch.Tensor]
    counts: list[int]
    budgets: list[Budget]
    budget_mode: BudgetMode | None
    output: ARRCOCOutput | Any | None       # the layer's output (the microscope's maps) for the ARR-COC methods
    fallback: list[str | None]
    errors: list[str | None]


def choose(pictures: Sequence[torch.Tensor] | UnitPixels, grid_hw: Sequence[tuple[int, int]],
           question_ids: Sequence[Sequence[int]], embed: Callable[[torch.Tensor], torch.Tensor], *,
           layer: ARRCOCLayer | Callable[[], ARRCOCLayer] | None = None, method: str | Selector = "arr_coc",
           budget: BudgetSpec = None, budget_mode: BudgetMode | None = None,
           visual_tokens: Sequence[torch.Tensor] | None = None, seed: int = 0, strict: bool = False,
           pad_token_id: int = 0, clips: Sequence[int] | None = None, groups: Sequence[int] | None = None,
           questions: Sequence[str] | None = None) -> Chosen:
    """The kept cells of N units (module docstring).

    pictures       per unit [3, H, W] in [0, 1], or a `UnitPixels` (e.g. `arr_coc.qwen.pixels.PatchImages`)
    grid_hw        per unit its merged-cell grid (h, w)
    question_ids   per unit its question's token ids (units of one question repeat them)
    embed          [N, L] token ids -> [N, L, D] embeddings (the VLM's input embedding), on the layer's device
    layer          the ARR-COC layer (or a function building it); None: the untrained default for the ARR-COC
                   methods, built at the embedding's width
    budget         one for every unit, or one per unit (a share, a count, "10%", "64tok"); None: the method's
                   default (the layer's budget for the ARR-COC methods)
    visual_tokens  per unit [n_i, D], the tower's output: what methods reading encoded tokens need
    clips, groups  per unit: the clip it is a temporal group of (-1: an image) and its group; a clip's budget is
                   the clip's, spread over space and time; questions: per unit its question's text (a clip's
                   temporal allocator reads its words)
    """
    n = len(grid_hw)
    pruning = Pruning.of(method, _spec(budget, n), budget_mode)
    if pruning.selector is None:
        raise ValueError(f"method {pruning.method!r} chooses nothing; the pure choice runs a selector")
    _check_pure(pruning.selector, pruning.method, visual_tokens)
    ids = [list(q) for q in question_ids]
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} questions for {n} units; pass one list of token ids per unit")
    layer_fn = _layer_of(layer, pruning.selector, embed, ids)
    budgets = _unit_budgets(pruning, n, layer_fn)
    mode = pruning.unit_mode(layer_fn)
    pixels = pictures if is_unit_pixels(pictures) else HostPixels(list(pictures))
    device = _device_of(embed, layer_fn, pruning.selector)
    query, mask, lengths = padded_questions(ids, pad_token_id, embed, device)
    clip_of = list(clips) if clips is not None else [-1] * n
    group_of = list(groups) if groups is not None else [0] * n
    clip_units = clip_members(clip_of, group_of)
    full = every_token_units(budgets, grid_hw, clip_units)     # a budget of every token keeps every token
    if all(full):
        every = [torch.arange(h * w) for h, w in grid_hw]
        return Chosen(every, [h * w for h, w in grid_hw], budgets, mode, None, [None] * n, [None] * n)
    ctx = SelectionContext(
        backend=None, prompt=None, layer=layer_fn, pixels=pixels, grid_hw=[tuple(g) for g in grid_hw],
        visual_tokens=None if visual_tokens is None else list(visual_tokens), query=query, query_mask=mask,
        query_lengths=lengths, budgets=budgets, counts=unit_counts(budgets, grid_hw, clip_units),
        item_of_image=_rows_of(ids), budget_mode=mode, image_ids=list(range(n)), seed=seed,
        clips=clip_of if clips is not None else [], groups=group_of if clips is not None else [],
        questions=list(questions) if questions is not None else [])
    choice = keep_every_token(run_selector(pruning.selector, ctx, pruning.method, strict=strict), full,
                              [h * w for h, w in grid_hw])
    kept, fallback, errors = validate_kept(choice.kept, [h * w for h, w in grid_hw], choice.fallback, choice.errors)
    return Chosen(kept, list(ctx.counts), budgets, mode, choice.arr_out, fallback, errors)


def _spec(budget: BudgetSpec, n: int) -> BudgetSpec:
    """A per-unit list is read entry by entry (`Pruning.of` reads a list as one entry per row: here a unit)."""
    if isinstance(budget, (list, tuple)) and len(budget) != n:
        raise ValueError(f"got {len(budget)} budgets for {n} units; pass one per unit (or one for all)")
    return budget


def _unit_budgets(pruning: Pruning, n: int, layer: Callable[[], ARRCOCLayer] | None) -> list[Budget]:
    spec = pruning.budget                  # read once, by `Pruning.of`
    given = list(spec) if isinstance(spec, (list, tuple)) else [spec] * n
    default = pruning.default_budget(layer)
    return [default if b is None else b for b in given]


def _check_pure(selector: Selector, name: str, visual_tokens: Sequence[torch.Tensor] | None) -> None:
    """Refuse, in one line, a method that needs what a pure choice does not have."""
    try:
        info = method_info(name)
    except ValueError:
        info = None
    if info is not None and info.vlm is not None:
        raise ValueError(f"method {name!r} reads {info.vlm}, so it needs the VLM: run it through ARRCOC.respond; "
                         "the pure choice runs the methods that read pixels, the question and, when given, the "
                         "encoded visual tokens")
    if visual_tokens is None and not selects_before_encoding(selector):
        raise ValueError(f"method {name!r} reads the encoded visual tokens: pass visual_tokens (per unit [n_i, D], "
                         "the tower's output)")


def _layer_of(layer: Any, selector: Selector, embed: Callable[[torch.Tensor], torch.Tensor],
              ids: list[list[int]]) -> Callable[[], ARRCOCLayer] | None:
    """The layer as a selection context asks for it (built on first call); the untrained default at the
    embedding's width when an ARR-COC method is given none."""
    if callable(layer) and not isinstance(layer, torch.nn.Module):
        return layer
    if layer is not None:
        return lambda: layer
    if not uses_layer(selector):
        return None
    built: list[ARRCOCLayer] = []

    def default() -> ARRCOCLayer:
        if not built:
            from ..core.layer import build_layer

            probe = torch.as_tensor([ids[0][:1] or [0]])
            built.append(build_layer(None, int(embed(probe).shape[-1])))
        return built[0]
    return default


def _device_of(embed: Any, layer: Callable[[], ARRCOCLayer] | None, selector: Selector) -> torch.device:
    """Where the question's token ids go: the embedding's device (an `nn.Embedding`'s weight), else the layer's for
    the ARR-COC methods, else the CPU."""
    weight = getattr(embed, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    if layer is not None and uses_layer(selector):
        return layer().device
    return torch.device("cpu")


def _rows_of(ids: list[list[int]]) -> list[int]:
    """Units asking the same question in a row share a row (a clip's groups, a question's images)."""
    rows, row = [], -1
    for i, q in enumerate(ids):
        row += 1 if i == 0 or q != ids[i - 1] else 0
        rows.append(row)
    return rows


__all__ = ["Chosen", "HostPixels", "choose"]
