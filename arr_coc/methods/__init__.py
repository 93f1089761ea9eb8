"""Anchor methods: what a user would pick instead of ARR-COC, in the same allocation interface.

Every method returns, per image, the raster indices of the merged visual tokens the LM
keeps (ascending, exactly the budgeted count), so all of them run on the same model,
images, budgets and code path (`ARRCOCQwen.prepare`). One module per method, each a
pure function over tensors plus a thin selector, each citing its paper:

| name            | module            | idea                                                        |
|-----------------|-------------------|-------------------------------------------------------------|
| none            | (arr_coc.model)   | all tokens (the reference)                                  |
| random          | random_sampling   | uniform random subset                                       |
| grid            | grid              | spatially uniform subsample                                 |
| downscale       | downscale         | a smaller input image (changes the input, not a selector)   |
| fastv           | fastv             | FastV: last-token attention at LM layer K (ECCV 2024)       |
| visionzip       | visionzip         | VisionZip: vision attention + merged context (CVPR 2025)    |
| divprune        | divprune          | DivPrune: max-min diversity (CVPR 2025)                     |
| cdpruner        | cdpruner          | CDPruner: conditional DPP (NeurIPS 2025)                    |
| oracle          | oracle            | cells under the answer's boxes, then grid (the ceiling)     |
| arr_coc         | arrcoc            | ARR-COC, untrained layer                                    |
| arr_coc_trained | arrcoc            | ARR-COC with trained weights (needs a folder)               |

Importing this package registers fastv, visionzip, divprune and cdpruner with
`arr_coc.model.register_selector`, so `wrapper.generate(..., method="fastv")` works.
`downscale`, `oracle` and `arr_coc_trained` need more than a SelectionContext (a new
input image, the answer's boxes, a weights folder) and are built per use:
`downscale.downscale_inputs`, `oracle.make_selector(boxes, sizes)`,
`arrcoc.trained_selector(wrapper, folder)`.
"""

from __future__ import annotations

from . import arrcoc, cdpruner, divprune, downscale, fastv, grid, oracle, random_sampling, visionzip

# Evaluation order of `--methods all` (plots and tables follow it).
METHODS: tuple[str, ...] = (
    "none", "random", "grid", "downscale", "fastv", "visionzip", "divprune", "cdpruner", "oracle",
    "arr_coc", "arr_coc_trained",
)

# Methods that cannot run from a SelectionContext alone.
SPECIAL: dict[str, str] = {
    "downscale": "changes the input image: use arr_coc.methods.downscale.downscale_inputs",
    "oracle": "needs the answer's boxes: use arr_coc.methods.oracle.make_selector(boxes, image_sizes)",
    "arr_coc_trained": "needs a weights folder: use arr_coc.methods.arrcoc.trained_selector(wrapper, folder)",
}

__all__ = ["METHODS", "SPECIAL", "arrcoc", "cdpruner", "divprune", "downscale", "fastv", "grid", "oracle",
           "random_sampling", "visionzip"]
