"""`arr_coc` and `arr_coc_trained`: the project's own allocator as an entry of the method list.

ARR-COC (DESIGN.md; arr_coc/layer.py): texture of the resized image -> three scorers
(information, perspectival, participatory = the question) -> tension balancing ->
top-K relevance, with a grid fallback for low-structure images.

- `arr_coc` is the layer as `ARRCOCQwen` builds it (untrained, default config, unless
  the wrapper was given weights); its selector is registered in `arr_coc.model`.
- `arr_coc_trained` runs a layer loaded from a folder written by
  `ARRCOCLayer.save_pretrained` (config.json + model.safetensors) on the SAME VLM,
  through a second wrapper that shares the model (no copy). It has no default: without
  weights the evaluation skips it and says so.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..model import SELECTORS, Selection, SelectionContext

select = SELECTORS["arr_coc"]


def trained_selector(wrapper: Any, weights: str | os.PathLike):
    """A selector running the ARR-COC layer saved in `weights` on `wrapper`'s VLM."""
    from ..model import ARRCOCQwen

    folder = os.fspath(weights)
    if not os.path.isfile(os.path.join(folder, "config.json")) or \
            not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise FileNotFoundError(
            f"{folder} holds no trained ARR-COC layer (config.json + model.safetensors); pass the folder that "
            "ARRCOCLayer.save_pretrained wrote, or leave arr_coc_trained out")
    trained = ARRCOCQwen(wrapper.model, wrapper.processor, arr_coc=folder, seed=wrapper.seed)
    trained.arr_coc_layer  # load now, so a bad folder fails before the evaluation starts

    def select_trained(ctx: SelectionContext) -> Selection:
        return select(dataclasses.replace(ctx, wrapper=trained))

    select_trained.__name__ = "arr_coc_trained"
    return select_trained


__all__ = ["select", "trained_selector"]
