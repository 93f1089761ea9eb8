"""Pictures of what the layer saw and decided: heatmap overlays, scorer maps, texture channels, and what the
vision tower encoded at which resolution (`resolution_picture`, from a `Trace`).

Pure functions from an `ARRCOCOutput` (one image) to PIL images or a matplotlib
figure; the app and the docs call them, nothing here loads a model.
matplotlib is imported lazily (Agg backend) so importing arr_coc stays light.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw

from .core.output import ARRCOCOutput

MAP_NAMES = ("information", "perspectival", "participatory", "relevance")


def _colormap(values: np.ndarray, name: str = "inferno") -> np.ndarray:
    """[h, w] in [0, 1] -> [h, w, 3] uint8 through a matplotlib colormap."""
    from matplotlib import colormaps

    return (colormaps[name](np.clip(values, 0.0, 1.0))[..., :3] * 255).astype(np.uint8)


def _cells_to_pixels(grid: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """[h, w, 3] uint8 cell colours -> a PIL image of `size` (W, H), one flat block per cell."""
    return Image.fromarray(grid).resize(size, Image.NEAREST)


def map_image(values: torch.Tensor, size: tuple[int, int], cmap: str = "inferno", normalise: bool = True) -> Image.Image:
    """A [h, w] map as a PIL image of `size`; `normalise` stretches min..max to the colormap."""
    v = values.detach().float().cpu().numpy()
    if normalise:
        lo, hi = float(v.min()), float(v.max())
        v = (v - lo) / (hi - lo) if hi > lo else np.zeros_like(v)
    return _cells_to_pixels(_colormap(v, cmap), size)


KEPT_OUTLINE = (0, 255, 120)


def outline_kept(image: Image.Image, kept: torch.Tensor | list[int], grid_hw: tuple[int, int],
                 colour: tuple[int, int, int] = KEPT_OUTLINE, width: int = 2) -> Image.Image:
    """A copy of the image with the cell of every kept raster index of an (h, w) grid outlined.

    Works for any selector (no relevance needed): the app uses it for anchor methods.
    """
    h, w = grid_hw
    out = image.convert("RGB")  # convert() always copies
    draw = ImageDraw.Draw(out)
    cw, ch = out.size[0] / w, out.size[1] / h
    for idx in (kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)):
        r, c = divmod(int(idx), w)
        draw.rectangle([c * cw, r * ch, (c + 1) * cw - 1, (r + 1) * ch - 1], outline=colour, width=width)
    return out


# One colour per `Trace.resolution` level (arr_coc.resolution.RESOLUTION_LEVELS, coarsest first), blended into the
# image at RESOLUTION_ALPHA: not encoded (dark), gist only (violet), periphery (blue), full resolution not read
# (orange: the margin), full resolution read (green, the kept-token colour).
RESOLUTION_COLOURS = ((25, 25, 25), (170, 100, 235), (30, 120, 255), (255, 150, 0), KEPT_OUTLINE)
RESOLUTION_ALPHA = 0.55


def resolution_picture(image: Image.Image, codes: torch.Tensor, grid_hw: tuple[int, int],
                       tokens: torch.Tensor | None = None, legend: bool = True, title: str = "") -> Image.Image:
    """The image with every merged cell tinted by what it became: `codes` [h * w] (raster) are
    `Trace.resolution` levels. Each cell is `(1 - a) * pixel + a * colour` (a = RESOLUTION_ALPHA), so
    the picture still shows the image. `tokens`: raster cells where the periphery's gist tokens stand
    (`Trace.periphery_cells`), marked with a white dot. `legend` adds a strip below naming the levels
    present, with counts, under `title` when one is given."""
    h, w = grid_hw
    base = np.asarray(image.convert("RGB"), dtype=np.float64)                        # [H, W, 3]
    palette = np.asarray(RESOLUTION_COLOURS, dtype=np.float64)
    cells = codes.detach().cpu().long().reshape(h, w).numpy()
    tint = np.asarray(_cells_to_pixels(cells.astype(np.uint8), (base.shape[1], base.shape[0])), dtype=np.int64)
    out = Image.fromarray(np.round((1 - RESOLUTION_ALPHA) * base + RESOLUTION_ALPHA * palette[tint]).astype(np.uint8))
    marks = tokens.tolist() if tokens is not None else []
    draw = ImageDraw.Draw(out)
    cw, ch = out.size[0] / w, out.size[1] / h
    r = max(1.5, min(cw, ch) / 6)
    for idx in marks:
        y, x = (int(idx) // w + 0.5) * ch, (int(idx) % w + 0.5) * cw
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(255, 255, 255), outline=(0, 0, 0))
    if not legend:
        return out
    key = level_legend(np.bincount(cells.reshape(-1), minlength=len(RESOLUTION_COLOURS)), out.size[0], title,
                       len(marks))
    both = Image.new("RGB", (out.size[0], out.size[1] + key.size[1]), (255, 255, 255))
    both.paste(out, (0, 0))
    both.paste(key, (0, out.size[1]))
    return both


def level_legend(counts: Sequence[int], width: int, title: str = "", periphery_tokens: int = 0) -> Image.Image:
    """A strip naming the resolution levels present (counts[level] > 0), each with its colour and cell count, under
    `title` when one is given; `periphery_tokens` dots are said beside the periphery level."""
    from PIL import ImageFont

    from .resolution import PERIPHERY, RESOLUTION_LEVELS

    present = [(lvl, int(counts[lvl])) for lvl in range(len(RESOLUTION_LEVELS) - 1, -1, -1) if counts[lvl] > 0]
    size = int(min(22, max(11, width // 30)))
    font, row = ImageFont.load_default(size=size), size + 6
    top = row if title else 0
    strip = Image.new("RGB", (width, top + row * len(present) + 6), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    if title:
        draw.text((4, 4), title, fill=(0, 0, 0), font=font)
    for k, (lvl, n) in enumerate(present):
        y = 3 + top + k * row
        draw.rectangle([4, y + 2, 4 + size, y + 2 + size], fill=RESOLUTION_COLOURS[lvl], outline=(0, 0, 0))
        text = f"{RESOLUTION_LEVELS[lvl]}: {n} cell{'s' if n != 1 else ''}"
        if lvl == PERIPHERY and periphery_tokens:
            text += f", {periphery_tokens} token{'s' if periphery_tokens != 1 else ''} (dots)"
        draw.text((10 + size, y + 1), text, fill=(0, 0, 0), font=font)
    return strip


def overlay_heatmap(image: Image.Image, out: ARRCOCOutput, i: int = 0, alpha: float = 0.5) -> Image.Image:
    """The image with the relevance map blended in and every kept token's cell outlined."""
    h, w = out.grid_hw[i]
    image = image.convert("RGB")
    heat = map_image(out.relevance[i, :h, :w], image.size)
    return outline_kept(Image.blend(image, heat, alpha), out.kept_indices[i], (h, w))


def balancer_weights(out: ARRCOCOutput, i: int = 0) -> dict[str, float]:
    """{scorer name: weight} of image i (empty when the layer fell back before balancing)."""
    if out.weights is None:
        return {}
    return {name: float(v) for name, v in zip(MAP_NAMES[:3], out.weights[i].tolist())}


def scorer_maps(out: ARRCOCOutput, i: int = 0, size: tuple[int, int] = (224, 224)) -> list[tuple[Image.Image, str]]:
    """(picture, caption) for the three scorer maps and the balanced relevance, with the balancer weights."""
    h, w = out.grid_hw[i]
    weights = out.weights[i].tolist() if out.weights is not None else [float("nan")] * 3
    items = []
    for k, name in enumerate(MAP_NAMES):
        m = getattr(out, name)
        if m is None:
            continue
        caption = f"{name} (w={weights[k]:.2f})" if k < 3 else name
        items.append((map_image(m[i, :h, :w], size), caption))
    return items


def texture_gallery(out: ARRCOCOutput, i: int = 0, size: tuple[int, int] = (160, 160)) -> list[tuple[Image.Image, str]]:
    """(picture, channel name) for every texture channel; values are shown on their own [0, 1] scale."""
    if out.texture is None:
        return []
    h, w = out.grid_hw[i]
    return [
        (map_image(out.texture[i, c, :h, :w], size, cmap="viridis", normalise=False), name)
        for c, name in enumerate(out.channel_names or [])
    ]


def summary_figure(image: Image.Image, out: ARRCOCOutput, i: int = 0, title: str | None = None):
    """One matplotlib figure: image + kept overlay, the four maps, and every texture channel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, w = out.grid_hw[i]
    names = out.channel_names or []
    ncols = 6
    nrows = 1 + int(np.ceil(len(names) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols, 2.7 * nrows))
    for ax in axes.flat:
        ax.axis("off")
    axes[0, 0].imshow(image.convert("RGB"))
    axes[0, 0].set_title("image", fontsize=9)
    axes[0, 1].imshow(overlay_heatmap(image, out, i))
    axes[0, 1].set_title(f"kept {len(out.kept_indices[i])}/{h * w} ({out.fallback[i] or 'top-k'})", fontsize=9)
    weights = out.weights[i].tolist() if out.weights is not None else None
    for k, name in enumerate(MAP_NAMES):
        m = getattr(out, name)
        if m is None:
            continue
        ax = axes[0, 2 + k]
        ax.imshow(m[i, :h, :w].detach().numpy(), cmap="inferno")
        ax.set_title(name + (f" w={weights[k]:.2f}" if weights and k < 3 else ""), fontsize=9)
    for c, name in enumerate(names):
        ax = axes[1 + c // ncols, c % ncols]
        ax.imshow(out.texture[i, c, :h, :w].numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(name, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
