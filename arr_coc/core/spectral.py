"""Spectral-residual saliency (Hou & Zhang, CVPR 2007) on a thumbnail, pooled to the token grid.

The thumbnail's size, and so its FFT, depends on each frame's size, so a padded batch is computed per
distinct frame size (`spectral_saliency`): one pass for a batch of equal sizes, one per size otherwise.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .grid import GridBatch, constant, on_cpu, upload


def squash(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e -> e / (e + scale): an energy in [0, inf) to [0, 1) with a FIXED constant (a flat image stays flat)."""
    return x / (x + scale)


def _gauss_kernel(sigma: float) -> torch.Tensor:
    """The normalised 1-D Gaussian of radius ceil(3 sigma), float32 on the CPU."""
    radius = max(1, int(math.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    return k / k.sum()


def gauss_taps(sigma: float) -> tuple[float, ...]:
    """`_gauss_kernel` as Python floats: compute once, outside any compiled graph (a module constant), and pass
    to `gaussian_blur(cpu_taps=...)`."""
    return tuple(float(v) for v in _gauss_kernel(sigma))


def _taps(padded: torch.Tensor, weights: tuple[float, ...], n: int, dim: int) -> torch.Tensor:
    """sum_i weights[i] * padded.narrow(dim, i, n), accumulated tap after tap with a fused multiply-add per tap,
    the order a convolution accumulates in: on this project's AVX-512 CPU bit for bit oneDNN's 1-D convolution,
    within float32 rounding on any CPU (oneDNN's kernels differ by instruction set; tests/test_fast_path.py), and 10-20x faster for one channel (oneDNN's single-channel kernels are slow).
    On an accelerator a convolution is two launches where this is 2 x 11: `gaussian_blur` keeps it there."""
    out = padded.narrow(dim, 0, n) * weights[0]
    for i in range(1, len(weights)):
        out.add_(padded.narrow(dim, i, n), alpha=weights[i])
    return out


def gaussian_blur(x: torch.Tensor, sigma: float, cpu_taps: tuple[float, ...] | None = None) -> torch.Tensor:
    """Separable Gaussian blur of [B, 1, H, W] with replicate padding: two convolutions, or, given `cpu_taps`
    (`gauss_taps(sigma)`) and a CPU tensor, shifted fused multiply-adds (`_taps`: the same sums; the texture's
    full-resolution luminance, whose width is a multiple of 16 px, is bit for bit the convolution's and several
    times faster; a thumbnail of any width keeps the convolution, which `_taps` matches only within 1 ulp there)."""
    radius = max(1, int(math.ceil(3 * sigma)))
    h, w = x.shape[-2:]
    # built on both paths, as the Sobel's weight: a pass counted or traced as a GPU runs it after the CPU's passes
    # finds it built (one built there is an upload counted, or a recompile)
    k = constant(f"gauss{sigma}", lambda: _gauss_kernel(sigma), x)
    if cpu_taps is not None and on_cpu(x.device):
        if len(cpu_taps) != 2 * radius + 1:
            raise ValueError(f"cpu_taps: {len(cpu_taps)} weights for sigma {sigma} (radius {radius}); "
                             "pass gauss_taps(sigma)")
        x = _taps(F.pad(x, (radius, radius, 0, 0), mode="replicate"), cpu_taps, w, -1)
        return _taps(F.pad(x, (0, 0, radius, radius), mode="replicate"), cpu_taps, h, -2)
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))


def spectral_residual(luma: torch.Tensor, grid_hw: tuple[int, int], size: int, contrast_scale: float) -> torch.Tensor:
    """[B, 1, hh, ww] luminance of equal-sized frames -> [B, 1, h, w] saliency in [0, 1].

    The map is normalised to its maximum and then gated by the frame's global luminance contrast,
    so a flat image scores ~0 everywhere.
    """
    b, _, hh, ww = luma.shape
    scale = size / max(hh, ww)
    th, tw = max(8, round(hh * scale)), max(8, round(ww * scale))
    thumb = F.interpolate(luma, size=(th, tw), mode="area")[:, 0]  # [B, th, tw]
    spectrum = torch.fft.fft2(thumb)
    amp = spectrum.abs()
    # Synthetic scenes have exact spectral zeros (sinc nulls of flat shapes); a floor relative
    # to the typical amplitude keeps log() from turning them into spikes of residual.
    floor = 1e-2 * amp.flatten(1).median(1).values.clamp_min(1e-8)[:, None, None]
    log_amp = torch.log(amp + floor)
    residual = log_amp - F.avg_pool2d(F.pad(log_amp[:, None], (1, 1, 1, 1), mode="replicate"), 3, stride=1)[:, 0]
    # exp(residual + i * phase), as a magnitude and an angle: one real exp where exp(residual + 0i) * exp(i * phase)
    # took two complex ones (8x slower on the CPU; the same numbers within 2 ulp).
    sal = torch.fft.ifft2(torch.polar(torch.exp(residual), spectrum.angle()))
    sal = gaussian_blur(sal.abs().pow(2)[:, None].to(luma.dtype), sigma=max(1.0, size / 40))
    sal = F.adaptive_avg_pool2d(F.interpolate(sal, size=(th * 4, tw * 4), mode="bilinear", align_corners=False), grid_hw)
    sal = sal / sal.flatten(1).amax(1).clamp_min(1e-12)[:, None, None, None]
    gate = squash(thumb.flatten(1).std(1), contrast_scale)[:, None, None, None]
    return sal * gate


def spectral_saliency(luma: torch.Tensor, grid: GridBatch, px: int, size: int, contrast_scale: float) -> torch.Tensor:
    """[F, 1, H * px, W * px] padded frames -> [F, 1, H, W]: `spectral_residual` of each frame on its own
    h x w cells (zero on padding), computed once per distinct frame size."""
    _, hm, wm = grid.shape
    groups = grid.size_groups()
    if len(groups) == 1:
        (h, w), = groups
        out = spectral_residual(luma[..., : h * px, : w * px], (h, w), size, contrast_scale)
        return out if (h, w) == (hm, wm) else F.pad(out, (0, wm - w, 0, hm - h))
    out = luma.new_zeros(luma.shape[0], 1, hm, wm)
    for (h, w), frames in groups.items():
        index = upload(np.array(frames, dtype=np.int64), luma.device)
        part = spectral_residual(luma.index_select(0, index)[..., : h * px, : w * px], (h, w), size, contrast_scale)
        out.index_copy_(0, index, F.pad(part, (0, wm - w, 0, hm - h)))
    return out


__all__ = ["gauss_taps", "gaussian_blur", "spectral_residual", "spectral_saliency", "squash"]
