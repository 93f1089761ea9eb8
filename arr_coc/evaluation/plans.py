"""How each method runs on one evaluation batch, images or clips: the one place that knows the methods which need
more than a `SelectionContext` (the registry's `Method.needs`).

- `downscale` changes the input image (a smaller image, not a selection);
- `oracle` needs the answer's boxes: on images a selector over the record's boxes, on clips the cells under each
  temporal group's boxes (`boxes_over_time`), given as explicit cells;
- `fastv` scores at a configurable LM layer; `arr_coc_trained` needs a weights folder.

Every other name is a registered selector (`arr_coc.pipeline.selection.get_selector`), counted by
`CountedSelector`. A method is written `name` or `name@encode` (`arr_coc@before`): the encoding of its rows;
without one a method that can choose before the tower takes the evaluation's `--encode`, the others run after
it (and their rows say so). With an adapter loaded (`eval --adapter`), `+adapter` / `-adapter` at the end
(`arr_coc@before-adapter`) runs the method's pruned rows with it / without it (default: with it), so one
evaluation pairs the two at equal cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..budget import Budget, count_of
from ..encode import ENCODE_MODES, EncodeConfig
from ..pipeline.request import Pruning
from ..pipeline.selection import get_selector, method_info, selects_before_encoding
from .flops import CountedSelector

if TYPE_CHECKING:
    from ..front import ARRCOC
    from ..pipeline.backend import VLMBackend
    from .items import Item


@dataclass
class BatchRun:
    """What the pipeline runs for one (method, budget) on one batch."""

    inputs: dict[str, torch.Tensor]            # the processor tensors (downscale: of its smaller images)
    prep_s: float                              # seconds spent building those inputs
    pruning: Pruning
    counted: CountedSelector | None = None     # the selector, counting its FLOPs; None: nothing selected


ADAPTER_SUFFIXES = {"+adapter": True, "-adapter": False}


def split_adapter(spec: str) -> tuple[str, bool]:
    """'arr_coc@before-adapter' -> ('arr_coc@before', False): whether the model's adapter (`eval --adapter`) runs
    for the rows the method prunes; without a suffix it does (a row that keeps every token never runs it)."""
    for suffix, on in ADAPTER_SUFFIXES.items():
        if spec.endswith(suffix):
            return spec[: -len(suffix)], on
    return spec, True


def split_spec(spec: str) -> tuple[str, str | None]:
    """'arr_coc@before' -> ('arr_coc', 'before'); 'grid' -> ('grid', None); an adapter suffix is dropped."""
    name, _, mode = split_adapter(spec)[0].partition("@")
    if mode and mode not in ENCODE_MODES:
        raise ValueError(f"{spec!r}: the encoding after '@' is one of {list(ENCODE_MODES)}")
    return name, mode or None


class MethodPlan:
    """One method of an evaluation (a `name` or `name@encode` spec), built once; `for_batch` gives its run on each
    batch."""

    def __init__(self, spec: str, vlm: ARRCOC, fastv_layer: int = 2, arr_coc_weights: str | None = None,
                 encode: EncodeConfig | None = None, adapter_for: str = "pruned"):
        from ..methods import arrcoc, fastv

        self.spec = spec
        self.name, mode = split_spec(spec)
        self.adapter = split_adapter(spec)[1]
        if spec != split_adapter(spec)[0] and not vlm.adapter_name:
            raise ValueError(f"{spec!r} names the adapter, and none is loaded: pass --adapter FOLDER")
        info = method_info(self.name)       # unknown names fail here, before any batch runs
        if self.name == "downscale":        # what the backend lacks for it, too (MissingCapability, one line)
            from ..pipeline.backend import LaysOutVisuals, require

            require(vlm.backend, LaysOutVisuals, "downscale its images (downscale)")
        self.selector = None
        if self.name == "fastv":
            self.selector = fastv.make_selector(fastv_layer)
        elif self.name == "arr_coc_trained":
            if not arr_coc_weights:
                raise ValueError("arr_coc_trained needs arr_coc_weights (a folder of trained ARR-COC weights)")
            self.selector = arrcoc.trained_selector(vlm.backend, arr_coc_weights, vlm.compile_layer)
        elif not info.needs and self.name != "none":
            self.selector = get_selector(self.name)
        if adapter_for == "trained" and spec == split_adapter(spec)[0] and self.name != "arr_coc_trained":
            self.adapter = False     # the trained layer folder's own adapter, on by default: for that layer's rows
        # Methods that read the encoded tokens (FastV, VisionZip, DivPrune, CDPruner) and downscale (a new input)
        # run after the tower whatever the evaluation's encoding, and say so.
        self.selects_before = self.name in ("none", "oracle") or (
            self.selector is not None and selects_before_encoding(self.selector))
        if mode == "before" and not self.selects_before:
            raise ValueError(f"{spec!r}: {self.name} reads the encoded visual tokens, so it cannot choose before the "
                             "vision tower")
        base = encode or EncodeConfig()
        self.encode = base if mode is None or mode == base.mode else EncodeConfig(mode=mode)
        if not self.selects_before:
            self.encode = EncodeConfig()

    @property
    def encode_mode(self) -> str:
        return self.encode.mode

    def for_batch(self, vlm: ARRCOC, items: Sequence[Item], visuals: Sequence[Any],
                  inputs: dict[str, torch.Tensor], build_s: float, budget: Budget, budget_mode: Any,
                  strict: bool, cells: Sequence[int]) -> BatchRun:
        """The run of this method at `budget` on a batch (cells: each item's visual tokens)."""
        if self.name == "none":
            return BatchRun(inputs, build_s, Pruning.of("none"))
        if self.name == "downscale":
            return self._downscale(vlm.backend, items, visuals, inputs, build_s, budget)
        if self.name == "oracle" and items and items[0].kind == "clip":
            kept = clip_oracle(vlm.backend, inputs, items)     # encoded and read: only the answer's cells
            return BatchRun(inputs, build_s, Pruning.of("oracle", encode=self.encode, kept_indices=kept))
        fn = self.selector
        if self.name == "oracle":
            from ..methods import oracle

            fn = oracle.make_selector([it.boxes for it in items], [v.size for v in visuals])
        counted = CountedSelector(fn, self.name)
        pruning = Pruning.of(counted, budget, budget_mode, self.encode, strict, adapter=self.adapter)
        return BatchRun(inputs, build_s, pruning, counted)

    def _downscale(self, backend: VLMBackend, items: Sequence[Item], visuals: Sequence[Any],
                   inputs: dict[str, torch.Tensor], build_s: float, budget: Budget) -> BatchRun:
        from ..methods import downscale
        from ..pipeline.backend import LaysOutVisuals, require
        from ..pipeline.layout import image_cells

        scale = require(backend, LaysOutVisuals, "downscale its images (downscale)").image_scale()
        grids = image_cells(backend.visual_grids(inputs))
        if all(downscale.downscale_grid(h, w, count_of(budget, h * w), scale.min_cells) == (h, w)
               for h, w in grids):
            return BatchRun(inputs, build_s, Pruning.of("none"))
        t0 = time.perf_counter()
        small, _ = downscale.downscale_inputs(backend, visuals, [it.question for it in items], budget, grids)
        return BatchRun(small, time.perf_counter() - t0, Pruning.of("none"))


def clip_oracle(backend: VLMBackend, inputs: dict[str, Any], items: Sequence[Item]) -> list[torch.Tensor]:
    """Every temporal group's oracle cells, in unit order (the batch holds one clip per item)."""
    from ..geometry import box_cell_set
    from ..pipeline.backend import LaysOutVisuals, require
    from ..pipeline.prompt import VIDEO

    require(backend, LaysOutVisuals, "map a clip's boxes onto its cells (oracle on clips)")
    unit = backend.image_scale().cell_px
    clips = [g for g in backend.visual_grids(inputs) if g.kind == VIDEO]
    kept: list[torch.Tensor] = []
    for v, clip in enumerate(clips):
        h, w = clip.grid_hw
        rec = items[v].record
        for g in range(clip.groups):
            found: set[int] = set()
            for f in range(g * 2, min(len(rec["boxes_over_time"]), (g + 1) * 2)):   # temporal patch: 2 frames
                if rec["boxes_over_time"][f]:
                    found |= box_cell_set(rec["boxes_over_time"][f], (h, w), (w * unit, h * unit),
                                          tuple(rec["size"]))
            kept.append(torch.tensor(sorted(found) or [(h // 2) * w + w // 2]))
    return kept


__all__ = ["BatchRun", "MethodPlan", "clip_oracle", "split_adapter", "split_spec"]
