"""The texture's full-resolution maps, written into one buffer and summarised per cell in ONE pooling.

Most texture channels end as one number per cell, the mean over its px x px working pixels of a map of the whole
picture: the luminance and its square (saliency's luminance spread), the luminance's Sobel magnitudes (sobel), the
highpass detail's energy (highpass), the foreground gradients' energy per direction (orientation). Each map is
written straight into its plane of one buffer [F, K, H * px, W * px], in place (no tensor per map, no
concatenation), and the buffer is pooled once.

Exact: avg_pool2d pools every plane by itself, so a plane's cell means are bit for bit those of pooling its map
alone, and every map is the float32 arithmetic it was (x ** 2 is x * x; a sum over two planes is one addition;
tests/test_exact_speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# group -> the planes it reads, in buffer order
PLANES: dict[str, tuple[str, ...]] = {
    "saliency": ("luma", "luma_sq"),
    "sobel": ("abs_x", "abs_y", "magnitude"),
    "highpass": ("detail_sq",),
    "orientation": ("vert", "horiz", "rise", "fall"),
}


@dataclass
class PixelSources:
    """What the maps are made of, computed on first use by the texture's context (`texture._Context`)."""

    luma: Callable[[], torch.Tensor]        # [F, 1, H, W] the luminance
    gradients: Callable[[], torch.Tensor]   # [F, 2 or 4, H, W] d/dx, d/dy of the luminance (and the foreground)
    blurred: Callable[[], torch.Tensor]     # [F, 1, H, W] the luminance's Gaussian blur (highpass)


def _saliency(out: torch.Tensor, src: PixelSources) -> None:
    luma = src.luma()
    out[:, 0:1].copy_(luma)
    torch.mul(luma, luma, out=out[:, 1:2])


def _sobel(out: torch.Tensor, src: PixelSources) -> None:
    g = src.gradients()[:, 0:2]                                  # the luminance's d/dx, d/dy
    torch.abs(g, out=out[:, 0:2])
    magnitude = torch.mul(g[:, :1], g[:, :1], out=out[:, 2:3])
    magnitude.add_(g[:, 1:2] * g[:, 1:2]).sqrt_()                # sqrt(gx^2 + gy^2)


def _highpass(out: torch.Tensor, src: PixelSources) -> None:
    detail = torch.sub(src.luma(), src.blurred(), out=out[:, 0:1])
    detail.mul_(detail)


def _orientation(out: torch.Tensor, src: PixelSources) -> None:
    g = src.gradients()[:, 2:4]                                  # the foreground's d/dx, d/dy
    gx, gy = g[:, :1], g[:, 1:]
    torch.mul(gx, gx, out=out[:, 0:1])
    torch.mul(gy, gy, out=out[:, 1:2])
    rise = torch.add(gx, gy, out=out[:, 2:3])
    rise.mul_(rise).div_(2)                                      # (gx + gy)^2 / 2
    fall = torch.sub(gx, gy, out=out[:, 3:4])
    fall.mul_(fall).div_(2)                                      # (gx - gy)^2 / 2


WRITERS: dict[str, Callable[[torch.Tensor, PixelSources], None]] = {
    "saliency": _saliency, "sobel": _sobel, "highpass": _highpass, "orientation": _orientation}


def pixel_groups(groups: Sequence[str]) -> list[str]:
    """The groups among `groups` that read full-resolution maps, in config order."""
    return [g for g in groups if g in PLANES]


def pixel_cell_means(groups: Sequence[str], src: PixelSources, like: torch.Tensor,
                     pool: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """{group: [F, len(PLANES[group]), h, w] cell means of its maps} for the groups that read any, from one buffer
    shaped like `like` ([F, *, H, W]) and one `pool` ([F, K, H, W] -> [F, K, h, w])."""
    names = pixel_groups(groups)
    if not names:
        return {}
    f, _, hh, ww = like.shape
    buffer = like.new_empty(f, sum(len(PLANES[g]) for g in names), hh, ww)     # [F, K, H, W]
    spans, start = {}, 0
    for g in names:
        spans[g] = (start, len(PLANES[g]))
        WRITERS[g](buffer.narrow(1, start, len(PLANES[g])), src)
        start += len(PLANES[g])
    means = pool(buffer)                                                        # [F, K, h, w]
    return {g: means.narrow(1, s, n) for g, (s, n) in spans.items()}


__all__ = ["PLANES", "PixelSources", "pixel_cell_means", "pixel_groups"]
