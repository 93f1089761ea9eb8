"""Every selector, one module each, all in the same allocation interface (`arr_coc.pipeline.selection`).

Every method returns, per image, the raster indices of the merged visual tokens the LM keeps
(ascending, exactly the budgeted count unless it says otherwise), so all of them run on the
same model, images, budgets and code path (`ARRCOC.prepare`). Each module is a pure
function over tensors plus a thin selector, and cites its paper:

| name             | module          | idea                                                        |
|------------------|-----------------|-------------------------------------------------------------|
| none             | none            | all tokens (the reference)                                  |
| random           | random_sampling | uniform random subset                                       |
| grid             | grid            | spatially uniform subsample                                 |
| downscale        | downscale       | a smaller input image (changes the input, not a selector)   |
| fastv            | fastv           | FastV: last-token attention at LM layer K (ECCV 2024)       |
| visionzip        | visionzip       | VisionZip: vision attention + merged context (CVPR 2025)    |
| divprune         | divprune        | DivPrune: max-min diversity (CVPR 2025)                     |
| cdpruner         | cdpruner        | CDPruner: conditional DPP (NeurIPS 2025)                    |
| oracle           | oracle          | cells under the answer's boxes, then grid (the ceiling)     |
| arr_coc          | arrcoc          | ARR-COC, the wrapper's layer                                |
| arr_coc_adaptive | arrcoc          | ARR-COC with adaptive budgets                               |
| arr_coc_trained  | arrcoc          | ARR-COC with trained weights (needs a folder)               |

Modules register their selectors when imported, and `arr_coc.pipeline.get_selector(name)`
imports the owning module on first use, so `wrapper.generate(..., method="fastv")` just works.
`downscale`, `oracle` and `arr_coc_trained` need more than a SelectionContext (a new input
image, the answer's boxes, a weights folder); `arr_coc.evaluation.plans` is the one place that
builds them per use.
"""

# Evaluation order of `--methods all` (plots and tables follow it).
METHODS: tuple[str, ...] = (
    "none", "random", "grid", "downscale", "fastv", "visionzip", "divprune", "cdpruner", "oracle",
    "arr_coc", "arr_coc_trained",
)

__all__ = ["METHODS"]
