"""How each method runs on one evaluation batch: the one place that knows the methods which need
more than a `SelectionContext`.

- `downscale` changes the input image (a smaller image, not a selection);
- `oracle` needs the answer's boxes of the batch's records;
- `visionzip` records the vision tower's last block while `prepare` encodes (no second pass);
- `fastv` scores at a configurable LM layer; `arr_coc_trained` needs a weights folder.

Every other name is a registered selector (`arr_coc.selection.get_selector`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Sequence

import torch

from ..budget import Budget
from ..data import VQARecord
from ..selection import get_selector, selects_before_encoding
from .flops import CountedSelector

if TYPE_CHECKING:
    from ..qwen import ARRCOCQwen

# Methods that cannot run from a SelectionContext alone, and what they need instead.
SPECIAL: dict[str, str] = {
    "downscale": "changes the input image: arr_coc.methods.downscale.downscale_inputs",
    "oracle": "needs the answer's boxes: arr_coc.methods.oracle.make_selector(boxes, image_sizes)",
    "arr_coc_trained": "needs a weights folder: arr_coc.methods.arrcoc.trained_selector(wrapper, folder)",
}


@dataclass
class BatchRun:
    """What `prepare` runs for one (method, budget) on one batch."""

    inputs: dict[str, torch.Tensor]            # the processor tensors (downscale: of its smaller images)
    prep_s: float                              # seconds spent building those inputs
    method: str | CountedSelector              # "none", or the selector wrapped to count its FLOPs
    around: ContextManager[Any] = field(default_factory=contextlib.nullcontext)   # e.g. VisionZip's recorder

    @property
    def counted(self) -> CountedSelector | None:
        return self.method if isinstance(self.method, CountedSelector) else None


class MethodPlan:
    """One method of an evaluation, built once; `for_batch` gives its run on each batch."""

    def __init__(self, name: str, wrapper: ARRCOCQwen, fastv_layer: int = 2, arr_coc_weights: str | None = None):
        from ..methods import arrcoc, fastv

        self.name = name
        self.selector = None
        if name == "fastv":
            self.selector = fastv.make_selector(fastv_layer)
        elif name == "arr_coc_trained":
            if not arr_coc_weights:
                raise ValueError("arr_coc_trained needs arr_coc_weights (a folder of trained ARR-COC weights)")
            self.selector = arrcoc.trained_selector(wrapper, arr_coc_weights)
        elif name not in ("none", "downscale", "oracle", "visionzip"):
            self.selector = get_selector(name)   # unknown names fail here, before any batch runs
        # encode="before" applies to methods that choose without the encoded tokens; the others (FastV,
        # VisionZip, DivPrune, CDPruner) and downscale (a new input) run after the tower, and say so.
        self.selects_before = name in ("none", "oracle") or (
            self.selector is not None and selects_before_encoding(self.selector))

    def for_batch(self, wrapper: ARRCOCQwen, records: Sequence[VQARecord], images: Sequence[Any],
                  inputs: dict[str, torch.Tensor], build_s: float, budget: Budget,
                  grids: Sequence[tuple[int, int]]) -> BatchRun:
        from ..budget import resolve_count
        from ..methods import downscale, oracle, visionzip

        if self.name == "none":
            return BatchRun(inputs, build_s, "none")
        if self.name == "downscale":
            ip = getattr(wrapper.processor, "image_processor", wrapper.processor)
            if all(downscale.downscale_grid(h, w, resolve_count(budget, h * w), downscale.min_tokens(ip)) == (h, w)
                   for h, w in grids):
                return BatchRun(inputs, build_s, "none")
            t0 = time.perf_counter()
            small, _ = downscale.downscale_inputs(wrapper, images, [r.question for r in records], budget, grids)
            return BatchRun(small, time.perf_counter() - t0, "none")
        if self.name == "oracle":
            fn = oracle.make_selector([r.boxes for r in records], [im.size for im in images])
            return BatchRun(inputs, build_s, CountedSelector(fn, self.name))
        if self.name == "visionzip":
            recorder = visionzip.LastBlockRecorder(wrapper.model)
            return BatchRun(inputs, build_s, CountedSelector(visionzip.make_selector(recorder), self.name), recorder)
        return BatchRun(inputs, build_s, CountedSelector(self.selector, self.name))
