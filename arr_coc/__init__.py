"""ARR-COC: query-aware visual-token allocation for vision-language models.

    from arr_coc import ARRCOCConfig, ARRCOCLayer
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(1536))
    out = layer(images, grid_hw, query_embeds=..., visual_tokens=..., budget=0.25)
    out.kept_indices   # per image, raster indices of the visual tokens to keep

    from arr_coc import ARRCOC
    vlm = ARRCOC.from_pretrained("checkpoints/shapes-qwen2vl")      # the backend by the model's type
    answer, trace = vlm.generate(image, "What color is the star?", budget=0.1)
    chosen = vlm.choose(image, "What color is the star?", budget=0.1)   # the pure choice: which cells

    from arr_coc import choose                                  # the same choice with no model object at all
    chosen = choose(pictures, grid_hw, question_ids, embed, layer=layer, budget=0.1)

    from arr_coc import load_clip
    clip = load_clip("walk.mp4", fps=2.0)   # a Clip: sampled frames, timestamps, frame rate

Every name is imported on first use, so `import arr_coc` (and the command line's help) loads
neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> module that owns it
_EXPORTS = {
    "ARRCOCConfig": "arr_coc.core.config",
    "ARRCOCLayer": "arr_coc.core.layer",
    "ARRCOCOutput": "arr_coc.core.output",
    "channel_names": "arr_coc.core.texture",
    "generate_texture_array": "arr_coc.core.texture",
    "ARRCOC": "arr_coc.front",
    "ARRCOCQwen": "arr_coc.qwen",   # the thin alias of ARRCOC for users who built on it; no tool uses it
    "choose": "arr_coc.pipeline.pure",
    "Chosen": "arr_coc.pipeline.pure",
    "register_backend": "arr_coc.pipeline.registry",
    "BackendEntry": "arr_coc.pipeline.registry",
    "Trace": "arr_coc.pipeline.trace",
    "Pruning": "arr_coc.pipeline",
    "register_selector": "arr_coc.pipeline",
    "Budget": "arr_coc.budget",
    "BudgetError": "arr_coc.budget",
    "DEFAULT_BUDGET": "arr_coc.budget",
    "parse_budget": "arr_coc.budget",
    "InputError": "arr_coc.errors",
    "InputLimits": "arr_coc.validation.limits",
    "LIMITS": "arr_coc.validation.limits",
    "Clip": "arr_coc.video.clip",
    "load_clip": "arr_coc.video.reading",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .budget import DEFAULT_BUDGET, Budget, BudgetError, parse_budget
    from .core.config import ARRCOCConfig
    from .errors import InputError
    from .validation.limits import LIMITS, InputLimits
    from .front import ARRCOC
    from .core.layer import ARRCOCLayer
    from .core.output import ARRCOCOutput
    from .pipeline import Pruning, register_selector
    from .pipeline.pure import Chosen, choose
    from .pipeline.registry import BackendEntry, register_backend
    from .pipeline.trace import Trace
    from .qwen import ARRCOCQwen
    from .core.texture import channel_names, generate_texture_array
    from .video.clip import Clip
    from .video.reading import load_clip


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'arr_coc' has no attribute {name!r}")
