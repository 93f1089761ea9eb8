"""The texture's full-resolution maps, written into one buffer and summarised per cell in ONE pooling.

Most texture channels end as one number per cell, the mean over its px x px working pixels of a map of the whole
picture: the luminance and its square (saliency's luminance spread), the luminance's Sobel magnitudes (sobel), the
highpass detail's energy (highpass), the foreground gradients' energy per direction (orientation). Each map is
written straight into its plane of one buffer [K, F, 1, H * px, W * px], in place (no tensor per map, no
concatenation), and the buffer is pooled once.

Exact: avg_pool2d pools every plane by itself, so a plane's cell means are bit for bit those of pooling its map
alone, and every map is the float32 arithmetic it was (x ** 2 and square_ are x * x; a sum over two planes is one
addition; tests/test_exact_speed.py).
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
    """What the maps are made of (the texture's context computes those its groups need: `needs`)."""

    luma: torch.Tensor                      # [F, 1, H, W] the luminance
    gradients: torch.Tensor | None          # [F, 2 or 4, H, W] d/dx, d/dy of the luminance (and the foreground)
    blurred: torch.Tensor | None            # [F, 1, H, W] the luminance's Gaussian blur (highpass)


def needs(groups: Sequence[str]) -> tuple[bool, bool]:
    """Whether `groups` read the gradients, the blur."""
    return any(g in groups for g in ("sobel", "orientation")), "highpass" in groups


def _saliency(out: list[torch.Tensor], src: PixelSources) -> None:
    out[0].copy_(src.luma)
    torch.mul(src.luma, src.luma, out=out[1])


def _sobel(out: list[torch.Tensor], src: PixelSources) -> None:
    gx, gy = src.gradients[:, 0:1], src.gradients[:, 1:2]        # the luminance's d/dx, d/dy
    torch.abs(gx, out=out[0])
    torch.abs(gy, out=out[1])
    torch.mul(gx, gx, out=out[2]).add_(gy * gy).sqrt_()          # sqrt(gx^2 + gy^2)


def _highpass(out: list[torch.Tensor], src: PixelSources) -> None:
    torch.sub(src.luma, src.blurred, out=out[0]).square_()       # (luma - blur)^2


def _orientation(out: list[torch.Tensor], src: PixelSources) -> None:
    gx, gy = src.gradients[:, 2:3], src.gradients[:, 3:4]        # the foreground's d/dx, d/dy
    torch.mul(gx, gx, out=out[0])
    torch.mul(gy, gy, out=out[1])
    torch.add(gx, gy, out=out[2]).square_().div_(2)              # (gx + gy)^2 / 2
    torch.sub(gx, gy, out=out[3]).square_().div_(2)              # (gx - gy)^2 / 2


WRITERS: dict[str, Callable[[list[torch.Tensor], PixelSources], None]] = {
    "saliency": _saliency, "sobel": _sobel, "highpass": _highpass, "orientation": _orientation}


def pixel_groups(groups: Sequence[str]) -> list[str]:
    """The groups among `groups` that read full-resolution maps, in config order."""
    return [g for g in groups if g in PLANES]


def pixel_cell_means(groups: Sequence[str], src: PixelSources,
                     pool: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """{group: [F, len(PLANES[group]), h, w] cell means of its maps} for the groups that read any, from one buffer
    and one `pool` ([N, 1, H, W] -> [N, 1, h, w]).

    The buffer is plane-major, [K, F, 1, H, W]: every plane a contiguous [F, 1, H, W] that an op writes whole
    (`out=`; a compiled graph takes no strided `out=`), pooled as K * F single-channel pictures."""
    names = pixel_groups(groups)
    if not names:
        return {}
    f, _, hh, ww = src.luma.shape
    k = sum(len(PLANES[g]) for g in names)
    buffer = src.luma.new_empty(k, f, 1, hh, ww)                                 # [K, F, 1, H, W]
    spans, start = {}, 0
    for g in names:
        spans[g] = (start, len(PLANES[g]))
        WRITERS[g](list(buffer[start: start + len(PLANES[g])]), src)
        start += len(PLANES[g])
    means = pool(buffer.view(k * f, 1, hh, ww))                                  # [K * F, 1, h, w]
    means = means.view(k, f, *means.shape[-2:]).transpose(0, 1)                 # [F, K, h, w]
    return {g: means.narrow(1, s, n) for g, (s, n) in spans.items()}


__all__ = ["PLANES", "PixelSources", "needs", "pixel_cell_means", "pixel_groups"]
