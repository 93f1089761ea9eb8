"""The pictures of a request, drawn with `arr_coc.viz` on what was asked about as the processor resized it (one
cell per merged token): config A's relevance with its kept tokens, every scorer's map and texture channel, and per
config what was encoded at which resolution. A clip gets one picture per temporal group, side by side in time
order (a strip, STRIP_HEIGHT px high, each group labelled with its time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc_microscope.asked import Asked

STRIP_HEIGHT = 160   # px per group picture in a clip's strips


def relevance(asked: Asked, trace: Any, cell_px: int) -> Image:
    """Config A's relevance over each unit with its kept cells outlined (or, without maps, the kept cells)."""
    from arr_coc import viz

    out = trace.arr_coc.cpu() if trace.arr_coc is not None else None

    def one(j: int) -> Image:
        shown = asked.frame(trace, j, cell_px)
        if out is not None and getattr(out, "relevance", None) is not None:
            return viz.overlay_heatmap(shown, out, j)
        return viz.outline_kept(shown, trace.kept_indices[j], trace.grid_hw[j])

    return one(0) if asked.kind == "image" else strip([one(j) for j in range(len(trace.grid_hw))], trace)


def resolution(asked: Asked, trace: Any, cell_px: int, title: str) -> Image:
    """What a config encoded at which resolution (`Trace.resolution`), with its legend (a clip: per group)."""
    from arr_coc import viz

    if asked.kind == "image":
        tokens = trace.periphery_cells[0] if trace.periphery_cells else None
        return viz.resolution_picture(asked.frame(trace, 0, cell_px), trace.resolution(0), trace.grid_hw[0], tokens,
                                      title=title)
    import numpy as np

    codes = [trace.resolution(j) for j in range(len(trace.grid_hw))]
    pictures = [viz.resolution_picture(asked.frame(trace, j, cell_px), codes[j], trace.grid_hw[j], legend=False)
                for j in range(len(codes))]
    counts = np.bincount(np.concatenate([c.numpy() for c in codes]), minlength=len(viz.RESOLUTION_COLOURS))
    return strip(pictures, trace, legend=viz.level_legend(counts, max(480, 120 * len(codes)), title))


def layer_maps(trace: Any) -> tuple[list, list, str]:
    """(scorer maps, texture channels, balancer weights as Markdown) of config A's layer output (an image's, or a
    clip's first group's), or nothing when the method has none."""
    from arr_coc import viz

    out = trace.arr_coc.cpu() if trace.arr_coc is not None else None
    if out is None:
        return [], [], ""
    maps, weights = [], ""
    if getattr(out, "relevance", None) is not None and out.information is not None:
        maps = viz.scorer_maps(out)
        weights = weights_markdown(viz.balancer_weights(out))
    channels = viz.texture_gallery(out) if out.texture is not None else []
    return maps, channels, weights


def weights_markdown(weights: dict[str, float]) -> str:
    if not weights:
        return ""
    rows = "\n".join(f"| {name} | {w:.3f} |" for name, w in weights.items())
    return ("**Balancer weights** (relevance = sum of weight x map / 3)\n\n| scorer | weight |\n| --- | --- |\n" + rows)


def strip(pictures: list[Image], trace: Any, legend: Image | None = None) -> Image:
    """Pictures side by side in time order, each labelled with its temporal group ("group 3"), with an optional
    legend below."""
    from PIL import Image as PILImage
    from PIL import ImageDraw

    label_h = 16
    scaled = [p.resize((max(1, int(p.size[0] * STRIP_HEIGHT / p.size[1])), STRIP_HEIGHT)) for p in pictures]
    width = sum(p.size[0] for p in scaled) + 4 * (len(scaled) - 1)
    height = STRIP_HEIGHT + label_h + (legend.size[1] if legend is not None else 0)
    out = PILImage.new("RGB", (max(width, legend.size[0] if legend is not None else 0), height), "white")
    draw = ImageDraw.Draw(out)
    x = 0
    for j, p in enumerate(scaled):
        out.paste(p, (x, label_h))
        draw.text((x + 2, 2), f"group {trace.group_per_image[j] if trace.group_per_image else j}", fill=(40, 40, 40))
        x += p.size[0] + 4
    if legend is not None:
        out.paste(legend, (0, STRIP_HEIGHT + label_h))
    return out


__all__ = ["STRIP_HEIGHT", "layer_maps", "relevance", "resolution", "strip", "weights_markdown"]
