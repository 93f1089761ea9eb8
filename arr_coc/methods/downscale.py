"""`downscale`: give the VLM a smaller image, so the processor itself yields about K tokens.

The plain baseline recent pruning benchmarks found hard to beat: instead of choosing
tokens of the full-resolution image, shrink the image so that it has about as many
merged tokens as the budget allows. Every region survives, at lower resolution; no token
is dropped, so positions, attention and the KV cache are those of an ordinary, smaller
image. C. Liao, W. Wang, Z. Wen et al., "Are We Using the Right Benchmark: An Evaluation
Framework for Visual Token Compression Methods" (arXiv:2510.07143, 2025) found that simple
image downsampling consistently outperforms many advanced compression methods.

Unlike the other anchors this changes the INPUT, so it cannot be a selector over the
visual tokens of the original image (`SelectionContext` comes after the vision tower).
It is a pre-processing step instead: `downscale_image` resizes one image for a budget,
`downscale_inputs` builds a batch of downscaled inputs for `ARRCOC.prepare(...,
method="none")`, through the backend's `LaysOutVisuals` (its processor's `ImageScale`).
Token counts must be reported against the ORIGINAL image: a 16x16
merged grid (256 tokens) shrunk to 3x4 keeps 12 of 256 tokens (4.7%), not 12 of 12.

Sizing: the scale s = sqrt(K / n) of the area, the new grid (h', w') from rounding
h s and w s down or up (four candidates), the one with the token count nearest to K
(ties: fewer tokens), never below the processor's min_pixels. The image is resized by
PIL (bicubic, antialiased) to exactly (w' u, h' u) px, u = patch size x merge size, so
the processor does not resize it again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

from ..budget import resolve_count

if TYPE_CHECKING:
    from ..pipeline.backend import VLMBackend
    from ..pipeline.layout import ImageScale


def downscale_grid(h: int, w: int, k: int, min_count: int = 1) -> tuple[int, int]:
    """The merged grid (h', w') <= (h, w) nearest to k tokens with about the aspect ratio h:w."""
    k = max(int(min_count), min(int(k), h * w))
    s = math.sqrt(k / (h * w))
    best: tuple[int, int] | None = None
    for hh in {max(1, math.floor(h * s)), max(1, math.ceil(h * s))}:
        for ww in {max(1, math.floor(w * s)), max(1, math.ceil(w * s))}:
            hh2, ww2 = min(hh, h), min(ww, w)
            if hh2 * ww2 < min_count:
                continue
            key = (abs(hh2 * ww2 - k), hh2 * ww2)
            if best is None or key < (abs(best[0] * best[1] - k), best[0] * best[1]):
                best = (hh2, ww2)
    if best is None:  # min_count forced a larger grid than the rounding offered
        hh = min(h, math.ceil(math.sqrt(min_count * h / w)))
        best = (hh, min(w, math.ceil(min_count / hh)))
    return best


def downscale_image(image: Any, grid_hw: tuple[int, int], budget: float | int, scale: ImageScale):
    """Resize a PIL image so the processor yields about `budget` of its grid_hw tokens.

    grid_hw: the merged grid the processor makes of the ORIGINAL image; scale: the processor's pixels per cell
    side and fewest cells (`LaysOutVisuals.image_scale`). Returns (resized PIL image, (h', w') its merged grid).
    """
    from PIL import Image

    h, w = grid_hw
    k = resolve_count(budget, h * w)
    hh, ww = downscale_grid(h, w, k, scale.min_cells)
    if (hh, ww) == (h, w):
        return image, (h, w)
    u = scale.cell_px
    return image.convert("RGB").resize((ww * u, hh * u), Image.BICUBIC), (hh, ww)


def downscale_inputs(backend: VLMBackend, images: Sequence[Any], questions: Sequence[str], budget: float | int,
                     original_grids: Sequence[tuple[int, int]] | None = None):
    """The backend's tensors of a batch with each (single) image downscaled for `budget` (a backend with
    `LaysOutVisuals`).

    original_grids: merged grids of the original images (read from the backend's inputs of them if None).
    Returns (inputs, original token counts per item).
    """
    from ..pipeline.backend import LaysOutVisuals, require
    from ..pipeline.layout import image_cells

    scale = require(backend, LaysOutVisuals, "downscale its images (downscale)").image_scale()
    if original_grids is None:
        original = backend.build_inputs([[im] for im in images], list(questions))
        original_grids = image_cells(backend.visual_grids(original))
    small = [downscale_image(im, g, budget, scale)[0] for im, g in zip(images, original_grids)]
    inputs = backend.build_inputs([[im] for im in small], list(questions))
    return inputs, [h * w for h, w in original_grids]


__all__ = ["downscale_grid", "downscale_image", "downscale_inputs"]
