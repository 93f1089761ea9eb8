"""ARRCOCLayer: texture -> knowing -> balancing -> attending, on the VLM's merged-token grid.

The layer is built from one `ARRCOCConfig` but receives its stages, so an
ablation swaps one part (`ARRCOCLayer(cfg, perspectival=MyScorer(...))`).
It never crashes its caller: if a stage raises or yields NaN/Inf for an image,
that image keeps all its tokens and the output says why (`fallback`, `errors`).

It runs where its weights are (`layer.to(device)`: the wrapper puts it on the VLM's device), in float32,
over the whole batch at once, in two steps:

- `decide(batch)` queues every stage on the device for all items (padded grids and masks, no loop over
  images, nothing read back): relevance, budgets and the kept cells as a mask;
- `read(decision)` reads the decision back in ONE transfer and turns it into per-image indices (the grid of
  a low-structure image is drawn there, on the host). A non-finite score keeps that image's tokens; a
  fixed-step part that had not converged (a long winding object's components) is redone to convergence,
  so the decisions never depend on the step count (on the eager CPU, where reading back costs nothing, that
  part settles inside the one pass instead: `components.settles_at_once`).

`forward` does both from Python lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np
import torch
import torch.nn as nn

from ..budget import Budget, BudgetError, BudgetMode, check_budget
from ..stopwatch import Stopwatch, lap
from .attending import Decision, Plan, TokenAllocator, finish_on_host
from .balancing import AdaptiveTensionBalancer
from .batch import LayerBatch, layer_batch
from .config import ARRCOCConfig
from .extent import ExtentHead
from .grid import GridBatch
from .knowing import InformationScorer, ParticipatoryScorer, PerspectivalScorer
from .output import ARRCOCOutput, pad_grid
from .persistence import LayerPersistence
from .texture import ImageLike, channel_names, texture_array


@dataclass
class LayerDecision:
    """Everything `decide` queued for a batch, on the layer's device (nothing read back yet)."""

    grid: GridBatch
    budget: Budget | Sequence[Budget | None] | None
    budget_mode: BudgetMode | None
    maps: dict[str, torch.Tensor]  # information, perspectival, participatory, relevance [B, Hm, Wm]; weights [B, 3]
    texture: torch.Tensor  # [F, C, Hm, Wm]
    extent: torch.Tensor | None  # [B] cells each question needs, or None
    allocation: Decision
    finite: torch.Tensor  # [B] bool: every score of the item is finite
    converged: torch.Tensor | None  # [B] bool: the fixed-step parts converged (None: the config has none)


class ARRCOCLayer(LayerPersistence, nn.Module):
    def __init__(
        self,
        config: ARRCOCConfig | None = None,
        *,
        information: nn.Module | None = None,
        perspectival: nn.Module | None = None,
        participatory: nn.Module | None = None,
        balancer: nn.Module | None = None,
        allocator: nn.Module | None = None,
    ):
        super().__init__()
        self.config = config = config or ARRCOCConfig()
        self.information = information or InformationScorer(config.texture, config.knowing)
        self.perspectival = perspectival or PerspectivalScorer(config.texture, config.knowing)
        self.participatory = participatory or ParticipatoryScorer(config.texture, config.knowing)
        self.balancer = balancer or AdaptiveTensionBalancer(config.balancing, config.knowing)
        self.allocator = allocator or TokenAllocator(config.attending)
        # The question-following budget's estimate of the answer's cells (only layers fitted with one).
        self.extent = ExtentHead(config.knowing.query_dim) if config.attending.spread_source == "extent" else None
        self.channel_names = channel_names(config.texture)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    # ------------------------------------------------------------------ stages
    def score(
        self,
        texture: torch.Tensor,
        valid: torch.Tensor,
        query: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        visual_tokens: torch.Tensor | None = None,
        clock: Stopwatch | None = None,
    ) -> dict[str, torch.Tensor]:
        """Differentiable part on a padded batch: texture [B, C, Hm, Wm] -> maps and relevance.

        This is what training optimises (learn scores, select by top-k later).
        visual_tokens: [B, Hm * Wm, D] on the padded grid, or None.
        clock: laps "scorers.information", ".perspectival", ".participatory" (knowing) and ".balancing".
        """
        info = self.information(texture, valid)
        lap(clock, "scorers.information")
        persp = self.perspectival(texture, valid)
        lap(clock, "scorers.perspectival")
        part = self.participatory(texture, valid, query, query_mask, visual_tokens)
        lap(clock, "scorers.participatory")
        relevance, weights = self.balancer(torch.stack([info, persp, part], 1), valid, query, query_mask)
        lap(clock, "scorers.balancing")
        return {
            "information": info,
            "perspectival": persp,
            "participatory": part,
            "relevance": relevance,
            "weights": weights,
        }

    def batch(self, images: Sequence[ImageLike], grid_hw: Sequence[tuple[int, int]],
              query_embeds: Sequence[torch.Tensor] | torch.Tensor | None = None,
              visual_tokens: Sequence[torch.Tensor] | None = None) -> LayerBatch:
        """The padded batch from per-image lists, on the layer's device (see `forward`)."""
        grid = GridBatch.of_images(grid_hw, self.device)
        return layer_batch(images, grid, self.config.texture.work_px, query_embeds, visual_tokens)

    def pad_inputs(
        self,
        images: Sequence[ImageLike],
        grid_hw: Sequence[tuple[int, int]],
        query_embeds: Sequence[torch.Tensor] | None = None,
        visual_tokens: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The padded batch `score` reads (grids padded to the largest (Hm, Wm), bottom/right):
        texture [B, C, Hm, Wm], valid [B, Hm, Wm], query [B, L, D] + its mask [B, L] (or None),
        visual tokens [B, Hm * Wm, D] (or None). Training calls it; its texture is always converged."""
        batch = self.batch(images, grid_hw, query_embeds, visual_tokens)
        with torch.no_grad():
            tex, converged = texture_array(batch.work, self.config.texture)
            if converged is not None and not bool(converged.all()):
                tex = texture_array(batch.work, self.config.texture, converge=True)[0]
        return tex, batch.grid.frame_valid, batch.query, batch.query_mask, batch.visual_tokens

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        images: Sequence[ImageLike] | torch.Tensor,
        grid_hw: Sequence[tuple[int, int]],
        query_embeds: Sequence[torch.Tensor] | torch.Tensor | None = None,
        visual_tokens: Sequence[torch.Tensor] | None = None,
        budget: Budget | Sequence[Budget | None] | None = None,
        budget_mode: BudgetMode | None = None,
    ) -> ARRCOCOutput:
        """Score and allocate a batch.

        images: list of B images at the processor's resized size ([3, H_i, W_i] floats in
            [0, 1], PIL or HxWx3 arrays), or a [B, 3, H, W] tensor.
        grid_hw: list of B merged-token grids (h_i, w_i).
        query_embeds: list of B [L_i, D] question-token embeddings (a [B, L, D] tensor means
            every row is fully valid), or None for question-free scoring.
        visual_tokens: list of B [h_i * w_i, D] merged visual tokens (raster order), or None.
        budget: None (config), a share in (0, 1], a count, or one of those per image (arr_coc.budget).
        budget_mode: "exact" | "mean" | "adaptive" | None (the layer's default), see arr_coc.budget.
        """
        images = list(images)
        grid_hw = [(int(h), int(w)) for h, w in grid_hw]
        b = len(images)
        budget = check_budgets(budget)      # the layer's own edge: `run` trusts what it is given
        if len(grid_hw) != b:
            raise ValueError(f"got {b} images but {len(grid_hw)} grids; pass one (h, w) per image")
        if query_embeds is not None and len(query_embeds) != b:
            raise ValueError(f"got {b} images but {len(query_embeds)} question embeddings")
        if visual_tokens is not None and len(visual_tokens) != b:
            raise ValueError(f"got {b} images but {len(visual_tokens)} visual-token sets")
        try:
            batch = self.batch(images, grid_hw, query_embeds, visual_tokens)
        except Exception as exc:  # noqa: BLE001 - graceful degradation is the contract
            if self.config.strict or b == 1 or isinstance(exc, BudgetError):
                if self.config.strict or isinstance(exc, BudgetError):
                    raise
                return self._keep_all(grid_hw[0], exc)
            return ARRCOCOutput.merge([self.forward(
                images[i: i + 1], grid_hw[i: i + 1], None if query_embeds is None else [query_embeds[i]],
                None if visual_tokens is None else [visual_tokens[i]], _budget_of(budget, i), budget_mode)
                for i in range(b)])
        return self.run(batch, budget, budget_mode)

    def run(self, batch: LayerBatch, budget: Budget | Sequence[Budget | None] | None = None,
            budget_mode: BudgetMode | None = None, clock: Stopwatch | None = None) -> ARRCOCOutput:
        """`decide` + `read` a padded batch; a batch that raises is retried item by item, and an item that
        still raises keeps every token (its error said). What the caller asked for wrong raises first."""
        self.allocator.check(budget, budget_mode, len(batch))
        try:
            return self.read(self.decide(batch, budget, budget_mode, clock=clock), batch, clock)
        except Exception as exc:  # noqa: BLE001 - graceful degradation is the contract
            if self.config.strict or isinstance(exc, BudgetError):
                raise
            if len(batch) == 1:
                return self._keep_all(batch.grid.grid_hw[0], exc)
            return ARRCOCOutput.merge([self.run(batch.item(i), _budget_of(budget, i), budget_mode)
                                       for i in range(len(batch))])

    @torch.no_grad()
    def decide(self, batch: LayerBatch, budget: Budget | Sequence[Budget | None] | None = None,
               budget_mode: BudgetMode | None = None, converge: bool = False,
               clock: Stopwatch | None = None) -> LayerDecision:
        """Queue every stage for the whole batch on the layer's device; nothing is read back.

        converge: run iterative parts until they converge (reading flags back) instead of a fixed number of
        steps: `read` redoes a batch this way when a fixed-step part had not converged. The budgets are planned
        on the host first; the device pass runs compiled when `compile_device_pass` set one (and converge is off:
        converging reads flags back, which no captured graph can)."""
        plan = self.allocator.plan(batch.grid, budget, budget_mode)
        compiled = self.__dict__.get("_compiled_pass")
        if compiled is not None and not converge:
            query_length = self.__dict__["_query_length"]
            if batch.query is not None:
                batch = batch.with_query_length(query_length(batch.query.shape[1]))
            if not self.__dict__.get("_warm"):   # module-level constants (filters, weights) built once, eagerly,
                self.device_pass(batch, plan)    # so no graph is traced while they are being created
                self.__dict__["_warm"] = True
            maps, texture, extent, allocation, finite, converged = compiled(batch, plan)
            lap(clock, "allocator")          # one captured pass: its time is reported as the last stage's
        else:
            maps, texture, extent, allocation, finite, converged = self.device_pass(batch, plan, converge, clock)
        return LayerDecision(batch.grid, budget, budget_mode, maps, texture, extent, allocation, finite, converged)

    def device_pass(self, batch: LayerBatch, plan: Plan, converge: bool = False, clock: Stopwatch | None = None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None, Decision, torch.Tensor,
                               torch.Tensor | None]:
        """Texture -> scorers -> balancer -> allocator on the device: (maps, texture, extent, allocation,
        finite, converged), the fields of `LayerDecision` (see there). Pure device work on tensors and the
        host's plan: what `compile_device_pass` captures as one graph per batch shape."""
        grid = batch.grid
        texture, converged = texture_array(batch.work, self.config.texture, converge, clock)
        valid = grid.frame_valid
        maps = self.score(texture, valid, batch.query, batch.query_mask, batch.visual_tokens, clock)
        finite = (torch.isfinite(maps["relevance"]).flatten(1).all(1) & torch.isfinite(maps["weights"]).all(1))
        relevance = torch.nan_to_num(maps["relevance"], nan=0.0, posinf=0.0, neginf=0.0)
        # Bottom-up structure (question-independent) decides whether the image is a "void".
        structure = torch.nan_to_num(0.5 * (maps["information"] + maps["perspectival"]), nan=0.0, posinf=0.0, neginf=0.0)
        lap(clock, "scorers")
        extent = None if self.extent is None else self.extent(relevance, valid, batch.query, batch.query_mask)
        allocation = self.allocator.decide_planned(relevance, grid, plan, structure, extent)
        lap(clock, "allocator")
        return {**maps, "relevance": relevance}, texture, extent, allocation, finite, None if converge else converged

    def compile_device_pass(self, compile_fn: Callable[[Callable], Callable] | None,
                            query_length: Callable[[int], int] = lambda n: n) -> None:
        """Run `device_pass` through `compile_fn` from now on (e.g. `Execution.compile`: torch.compile with
        fullgraph), the question's tokens padded to `query_length(n)` (masked: a fixed shape per bucket, not per
        question); None: eager again. The scorers' zero-initialised terms are read first, so the captured graph
        holds no read-back (`ParticipatoryScorer.know_weights`)."""
        if compile_fn is None:
            self.__dict__.pop("_compiled_pass", None)
            return
        know = getattr(self.participatory, "know_weights", None)
        if know is not None:
            know()
        self.__dict__["_compiled_pass"] = compile_fn(self._captured_pass)
        self.__dict__["_query_length"] = query_length

    def _captured_pass(self, batch: LayerBatch, plan: Plan):
        return self.device_pass(batch, plan)

    def read(self, decision: LayerDecision, batch: LayerBatch | None = None,
             clock: Stopwatch | None = None) -> ARRCOCOutput:
        """Read a decision back in one transfer -> `ARRCOCOutput` (per-image indices on the host). A fixed-step
        part that had not converged is redone to convergence (that needs the batch)."""
        d, grid = decision, decision.grid
        alloc = d.allocation
        flags = [d.finite] + ([] if d.converged is None else [d.converged])
        flat = torch.cat([alloc.keep.reshape(-1).long(), alloc.counts, alloc.void.long()]
                         + [f.long() for f in flags]).cpu()                       # the one transfer
        b = len(grid)
        head, ok = flat[: -len(flags) * b], flat[-len(flags) * b:].numpy().reshape(len(flags), b) != 0
        if self.config.strict and not ok[0].all():
            raise FloatingPointError(f"non-finite relevance for images {np.flatnonzero(~ok[0]).tolist()}")
        if len(flags) > 1 and not ok[1].all():
            if batch is None:
                raise RuntimeError("a fixed-step part did not converge; pass the batch to read() to redo it")
            return self.read(self.decide(batch, d.budget, d.budget_mode, converge=True), clock=clock)
        alloc_host = finish_on_host(head, grid)
        kept, fallback, budgets = list(alloc_host.kept_indices), alloc_host.fallback, alloc_host.budgets
        keep_mask = alloc_host.keep_mask
        errors: list[str | None] = [None] * b
        for i, (h, w) in enumerate(grid.grid_hw):
            if not ok[0, i]:
                errors[i] = "non-finite scores (NaN/Inf); kept all tokens"
                kept[i], fallback[i] = torch.from_numpy(np.arange(h * w)), "keep_all"
                budgets.numpy()[i] = h * w
                keep_mask.numpy()[i, :h, :w] = True
        lap(clock, "read")
        return ARRCOCOutput(
            kept_indices=kept, budgets=budgets, keep_mask=keep_mask, relevance=d.maps["relevance"],
            grid_hw=grid.grid_hw, valid=grid.frame_valid, fallback=list(fallback), errors=errors,
            information=d.maps["information"], perspectival=d.maps["perspectival"],
            participatory=d.maps["participatory"], weights=d.maps["weights"], texture=d.texture,
            channel_names=list(self.channel_names), extent=d.extent,
        )

    def _keep_all(self, grid_hw: tuple[int, int], exc: BaseException) -> ARRCOCOutput:
        h, w = grid_hw
        kept = torch.arange(h * w)
        return ARRCOCOutput(
            kept_indices=[kept], budgets=torch.tensor([h * w]), keep_mask=torch.ones(1, h, w, dtype=torch.bool),
            relevance=torch.zeros(1, h, w), grid_hw=[(h, w)], valid=torch.ones(1, h, w, dtype=torch.bool),
            fallback=["keep_all"], errors=[f"{type(exc).__name__}: {exc}"], channel_names=list(self.channel_names),
        )


def check_budgets(budget: Budget | Sequence[Budget | None] | None) -> Budget | list[Budget | None] | None:
    """A budget, or one per image, each checked (`arr_coc.budget.check_budget`); None entries stay None."""
    if budget is None or isinstance(budget, (int, float, str)):
        return None if budget is None else check_budget(budget)
    return [None if b is None else check_budget(b) for b in budget]


def _budget_of(budget: Budget | Sequence[Budget | None] | None, i: int) -> Budget | Sequence[Budget | None] | None:
    """Item i's budget, for a one-item retry."""
    return budget if budget is None or isinstance(budget, (int, float)) else [list(budget)[i]]



# What `ARRCOC(backend, arr_coc=...)` accepts: a layer, a config, a folder of trained weights, or None (untrained).
LayerSpec = Union[ARRCOCLayer, ARRCOCConfig, str, os.PathLike, None]


def build_layer(spec: LayerSpec, text_hidden_size: int) -> ARRCOCLayer:
    """The ARR-COC layer for a VLM whose question embeddings are `text_hidden_size` wide."""
    d = text_hidden_size
    if spec is None:
        layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(d))
    elif isinstance(spec, ARRCOCConfig):
        layer = ARRCOCLayer(spec if spec.knowing.query_dim == d else spec.with_query_dim(d))
    elif isinstance(spec, (str, os.PathLike)):
        layer = ARRCOCLayer.from_pretrained(os.fspath(spec))
    elif isinstance(spec, ARRCOCLayer):
        layer = spec
    else:
        raise TypeError(f"arr_coc must be an ARRCOCLayer, an ARRCOCConfig, a folder of trained weights or None; "
                        f"got {type(spec).__name__}")
    if hasattr(layer.participatory, "know_weights"):
        layer.eval().participatory.know_weights()   # what the forward would otherwise read back from the GPU once
    if layer.config.knowing.query_dim != d:
        raise ValueError(
            f"the ARR-COC layer expects question embeddings of width {layer.config.knowing.query_dim} but this "
            f"VLM's text hidden size is {d}; train or build the layer with ARRCOCConfig().with_query_dim({d})")
    return layer.eval()


__all__ = ["ARRCOCLayer", "ARRCOCOutput", "LayerDecision", "LayerSpec", "build_layer", "check_budgets", "pad_grid"]
