"""Texture array: an image described cell by cell on the VLM's merged-token grid.

One cell per visual token (28 px for Qwen2-VL / 2.5-VL, 32 px for Qwen3-VL), so
every channel value, every score and every kept index refer to the same token.
The channel groups follow the ARR-COC seeds' "texture array" (colour, position,
edges, saliency, clusters, detail):

- rgb       cell mean colour.
- position  cell centre y / x.
- sobel     mean |Sobel x|, |Sobel y| and gradient magnitude of the luminance.
- saliency  spectral-residual saliency (Hou & Zhang, CVPR 2007), centre-surround
            local contrast (Itti, Koch & Niebur, PAMI 1998) and colour
            distinctiveness from the dominant colour (Achanta et al., CVPR 2009).
- clusters  k-means over cell colours: how rare a cell's cluster is (weighted by
            how far its colour is from the dominant cluster), and cluster-edge
            strength (colour distance to neighbouring cells' cluster centroids).
- highpass  energy of luminance minus its Gaussian blur: text-like fine detail.

Two more groups describe shape inside and across cells, for a layer that reads no visual token
(encode="before": colour and position cannot tell a triangle from a square). Not in the default
array; a layer lists them in its config's texture.groups:

- silhouette  the foreground share (colour distance from the image's dominant colour) of each of
              the 4 x 4 sub-cells of a cell: a 16-value thumbnail of what the cell holds.
- orientation foreground edge strength split by direction (vertical, horizontal, rising "/",
              falling "\\"): a triangle's or a diamond's slanted sides against a square's upright ones.
- object      the shape of the whole object a cell's foreground belongs to (its connected component:
              fill ratio, aspect, size, silhouette resampled to its own box; `components.py`), the same
              on every cell of the object, so each cell of a triangle knows it is on a triangle.

Every channel lies in [0, 1]. Energies are squashed with a FIXED constant
(e -> e / (e + scale)) rather than divided by the image's own maximum, so a
near-uniform image keeps near-zero structure instead of amplified noise; the
allocator's "semantic void" fallback relies on that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .components import OBJECT_CHANNELS, PX_PER_CELL, object_channels
from .config import TextureConfig

ImageLike = Union[Image.Image, np.ndarray, torch.Tensor]

# Rec. 601 luma weights.
_LUMA = torch.tensor([0.299, 0.587, 0.114])


@dataclass
class _Group:
    channels: tuple[str, ...]
    fn: Callable[["_Context"], torch.Tensor]  # -> [B, len(channels), h, w] in [0, 1]


TEXTURE_REGISTRY: dict[str, _Group] = {}


def register_channels(group: str, channels: Sequence[str]):
    """Register a channel group under a name; the app shows channels by these names."""

    def wrap(fn: Callable[["_Context"], torch.Tensor]) -> Callable[["_Context"], torch.Tensor]:
        TEXTURE_REGISTRY[group] = _Group(tuple(channels), fn)
        return fn

    return wrap


def channel_names(config: TextureConfig | None = None) -> list[str]:
    config = config or TextureConfig()
    return [name for group in config.groups for name in TEXTURE_REGISTRY[group].channels]


def _squash(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x / (x + scale)


class _Context:
    """Shared intermediates of one batch, computed once on first use."""

    def __init__(self, image: torch.Tensor, grid_hw: tuple[int, int], config: TextureConfig):
        self.image = image  # [B, 3, H, W] in [0, 1]
        self.grid_hw = grid_hw
        self.config = config

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] pixels -> [B, C, h, w] cell means."""
        return F.adaptive_avg_pool2d(x, self.grid_hw)

    @cached_property
    def luma(self) -> torch.Tensor:  # [B, 1, H, W]
        return torch.einsum("bchw,c->bhw", self.image, _LUMA.to(self.image)).unsqueeze(1)

    @cached_property
    def cell_rgb(self) -> torch.Tensor:  # [B, 3, h, w]
        return self.pool(self.image)

    @cached_property
    def cell_luma_std(self) -> torch.Tensor:  # [B, 1, h, w]
        mean = self.pool(self.luma)
        return (self.pool(self.luma**2) - mean**2).clamp_min(0).sqrt()

    @cached_property
    def dominant_rgb(self) -> torch.Tensor:  # [B, 3, 1, 1] per-channel median cell colour
        b = self.cell_rgb.shape[0]
        return self.cell_rgb.reshape(b, 3, -1).median(dim=-1).values[..., None, None]

    @cached_property
    def foreground(self) -> torch.Tensor:  # [B, 1, H, W] in [0, 1): colour distance from the dominant colour
        distance = (self.image - self.dominant_rgb).norm(dim=1, keepdim=True) / math.sqrt(3)
        return _squash(distance, self.config.contrast_scale)

    @cached_property
    def kmeans(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _kmeans(self.cell_rgb.flatten(2).transpose(1, 2), self.config.n_clusters, self.config.kmeans_iters)


@register_channels("rgb", ("red", "green", "blue"))
def _rgb(ctx: _Context) -> torch.Tensor:
    return ctx.cell_rgb


@register_channels("position", ("pos_y", "pos_x"))
def _position(ctx: _Context) -> torch.Tensor:
    h, w = ctx.grid_hw
    b = ctx.image.shape[0]
    y = (torch.arange(h, dtype=ctx.image.dtype) + 0.5) / h
    x = (torch.arange(w, dtype=ctx.image.dtype) + 0.5) / w
    yy, xx = torch.meshgrid(y, x, indexing="ij")
    return torch.stack([yy, xx]).unsqueeze(0).expand(b, -1, -1, -1)


def _sobel_gradients(x: torch.Tensor) -> torch.Tensor:
    """[B, 1, H, W] -> [B, 2, H, W] (d/dx, d/dy), replicate padding; |response| <= 1 for x in [0, 1]."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0
    kernel = torch.stack([kx, kx.T]).unsqueeze(1).to(x)  # [2, 1, 3, 3]
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), kernel)


@register_channels("sobel", ("sobel_x", "sobel_y", "sobel_mag"))
def _sobel(ctx: _Context) -> torch.Tensor:
    g = _sobel_gradients(ctx.luma)  # [B, 2, H, W]
    mag = g.pow(2).sum(1, keepdim=True).sqrt()
    energy = ctx.pool(torch.cat([g.abs(), mag], dim=1))
    return _squash(energy, ctx.config.edge_scale)


@register_channels("saliency", ("sal_spectral", "sal_contrast", "sal_color"))
def _saliency(ctx: _Context) -> torch.Tensor:
    cfg = ctx.config
    # Centre-surround: a cell's colour against the mean of its 5x5 cell neighbourhood, plus the
    # luminance spread inside the cell (small objects sit inside one cell).
    rgb = ctx.cell_rgb
    surround = F.avg_pool2d(F.pad(rgb, (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    contrast = (rgb - surround).norm(dim=1, keepdim=True) / math.sqrt(3) + ctx.cell_luma_std
    # Colour distinctiveness from the dominant (median) cell colour.
    distinct = (rgb - ctx.dominant_rgb).norm(dim=1, keepdim=True) / math.sqrt(3)
    return torch.cat(
        [
            _spectral_residual(ctx.luma, ctx.grid_hw, cfg.saliency_size, cfg.contrast_scale),
            _squash(contrast, cfg.contrast_scale),
            _squash(distinct, cfg.contrast_scale),
        ],
        dim=1,
    )


@register_channels("clusters", ("cluster_rarity", "cluster_edge"))
def _clusters(ctx: _Context) -> torch.Tensor:
    labels, centroids = ctx.kmeans  # [B, N], [B, k, 3]
    b, n = labels.shape
    h, w = ctx.grid_hw
    k = centroids.shape[1]
    sizes = F.one_hot(labels, k).sum(1).to(centroids)  # [B, k]
    dominant = centroids[torch.arange(b), sizes.argmax(1)]  # [B, 3]
    centroid_dist = (centroids - dominant[:, None]).norm(dim=-1) / math.sqrt(3)  # [B, k]
    rarity = (1.0 - sizes / n) * _squash(centroid_dist, ctx.config.contrast_scale)
    rarity = rarity.gather(1, labels)  # [B, N]
    # Cluster-edge strength: mean colour distance from a cell's centroid to its 8 neighbours' centroids.
    cell_centroid = centroids.gather(1, labels[..., None].expand(-1, -1, 3))  # [B, N, 3]
    grid = cell_centroid.transpose(1, 2).reshape(b, 3, h, w)
    padded = F.pad(grid, (1, 1, 1, 1), mode="replicate")
    neighbours = F.unfold(padded, 3).reshape(b, 3, 9, h * w)  # [B, 3, 9, N]
    edge = (neighbours - grid.reshape(b, 3, 1, h * w)).norm(dim=1).sum(1) / (8 * math.sqrt(3))
    edge = _squash(edge, ctx.config.contrast_scale)
    return torch.stack([rarity, edge], dim=1).reshape(b, 2, h, w)


@register_channels("highpass", ("highpass",))
def _highpass(ctx: _Context) -> torch.Tensor:
    detail = ctx.luma - _gaussian_blur(ctx.luma, sigma=1.5)
    return _squash(ctx.pool(detail**2).sqrt(), ctx.config.highpass_scale)


SUBCELLS = 4  # silhouette: sub-cells per cell side


@register_channels("silhouette", tuple(f"sil_{y}{x}" for y in range(SUBCELLS) for x in range(SUBCELLS)))
def _silhouette(ctx: _Context) -> torch.Tensor:
    h, w = ctx.grid_hw
    sub = F.adaptive_avg_pool2d(ctx.foreground, (h * SUBCELLS, w * SUBCELLS))  # [B, 1, 4h, 4w]
    return F.pixel_unshuffle(sub, SUBCELLS)  # [B, 16, h, w], channel = sub-row * 4 + sub-column


@register_channels("orientation", ("edge_vert", "edge_horiz", "edge_rise", "edge_fall"))
def _orientation(ctx: _Context) -> torch.Tensor:
    g = _sobel_gradients(ctx.foreground)  # [B, 2, H, W]
    gx, gy = g[:, :1], g[:, 1:]
    # The gradient runs across an edge and y grows downwards: a vertical edge has a horizontal gradient, a
    # rising edge "/" a gradient along (1, 1). vert + horiz = rise + fall = the cell's whole edge energy, so each
    # channel is that energy (squashed) times its direction's share of it: an upright square's sides read
    # (1, 0, .5, .5) of it, a triangle's slanted sides (.5, .5, 1, 0).
    energy = ctx.pool(torch.cat([gx**2, gy**2, (gx + gy) ** 2 / 2, (gx - gy) ** 2 / 2], dim=1))  # [B, 4, h, w]
    total = energy[:, :2].sum(1, keepdim=True)
    return _squash(total.sqrt(), ctx.config.edge_scale) * energy / total.clamp_min(1e-12)


@register_channels("object", OBJECT_CHANNELS)
def _object(ctx: _Context) -> torch.Tensor:
    # Foreground: further from the dominant colour than contrast_scale (the squashed distance passes 1/2).
    h, w = ctx.grid_hw
    share = F.adaptive_avg_pool2d(ctx.foreground, (h * PX_PER_CELL, w * PX_PER_CELL))  # [B, 1, 8h, 8w]
    return object_channels(share[:, 0] > 0.5, ctx.grid_hw)


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of [B, 1, H, W] with replicate padding."""
    radius = max(1, int(math.ceil(3 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype)
    k = torch.exp(-(t**2) / (2 * sigma**2))
    k = k / k.sum()
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))


def _spectral_residual(luma: torch.Tensor, grid_hw: tuple[int, int], size: int, contrast_scale: float) -> torch.Tensor:
    """Hou & Zhang's spectral-residual saliency on a thumbnail, pooled to the grid.

    The map is normalised to its maximum and then gated by the image's global
    luminance contrast, so a flat image scores ~0 everywhere.
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
    residual = log_amp - F.avg_pool2d(
        F.pad(log_amp[:, None], (1, 1, 1, 1), mode="replicate"), 3, stride=1
    )[:, 0]
    sal = torch.fft.ifft2(torch.exp(torch.complex(residual, torch.zeros_like(residual))) * torch.exp(1j * spectrum.angle()))
    sal = _gaussian_blur(sal.abs().pow(2)[:, None].to(luma.dtype), sigma=max(1.0, size / 40))
    sal = F.adaptive_avg_pool2d(F.interpolate(sal, size=(th * 4, tw * 4), mode="bilinear", align_corners=False), grid_hw)
    sal = sal / sal.flatten(1).amax(1).clamp_min(1e-12)[:, None, None, None]
    gate = _squash(thumb.flatten(1).std(1), contrast_scale)[:, None, None, None]
    return sal * gate


def _kmeans(x: torch.Tensor, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batched k-means. x: [B, N, D] -> labels [B, N], centroids [B, k, D].

    Initialised by farthest-point sampling from the median point (no randomness),
    so the same image always yields the same clusters.
    """
    b, n, d = x.shape
    k = min(k, n)
    start = x.median(dim=1).values  # [B, D]
    first = (x - start[:, None]).norm(dim=-1).argmin(1)  # [B]
    chosen = [first]
    dist = (x - x[torch.arange(b), first][:, None]).norm(dim=-1)  # [B, N]
    for _ in range(k - 1):
        nxt = dist.argmax(1)
        chosen.append(nxt)
        dist = torch.minimum(dist, (x - x[torch.arange(b), nxt][:, None]).norm(dim=-1))
    centroids = torch.stack([x[torch.arange(b), i] for i in chosen], dim=1)  # [B, k, D]
    for _ in range(iters):
        labels = torch.cdist(x, centroids).argmin(-1)  # [B, N]
        onehot = F.one_hot(labels, k).to(x)  # [B, N, k]
        counts = onehot.sum(1)  # [B, k]
        sums = onehot.transpose(1, 2) @ x  # [B, k, D]
        # An emptied cluster keeps its old centroid.
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp_min(1)[..., None], centroids)
    labels = torch.cdist(x, centroids).argmin(-1)
    return labels, centroids


def to_tensor(image: ImageLike) -> torch.Tensor:
    """PIL / numpy HWC / tensor CHW or BCHW (uint8 or float in [0, 1]) -> float32 [B, 3, H, W] in [0, 1]."""
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, axis=-1)
        if image.ndim != 3:
            raise ValueError(f"expected an HxWxC array, got shape {image.shape}")
        t = torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1)
    elif isinstance(image, torch.Tensor):
        t = image
    else:
        raise TypeError(f"unsupported image type {type(image).__name__}; pass a PIL image, numpy array or tensor")
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4:
        raise ValueError(f"expected an image tensor [3, H, W] or [B, 3, H, W], got shape {tuple(t.shape)}")
    if t.shape[1] == 1:
        t = t.expand(-1, 3, -1, -1)
    if t.shape[1] == 4:
        t = t[:, :3]
    if t.shape[1] != 3:
        raise ValueError(f"expected 1, 3 or 4 channels, got {t.shape[1]}")
    if not t.is_floating_point():
        t = t.float() / 255.0
    return t.float()


@torch.no_grad()
def generate_texture_array(
    image: ImageLike | Sequence[ImageLike],
    grid_hw: tuple[int, int],
    config: TextureConfig | None = None,
) -> torch.Tensor:
    """Texture array of a batch of same-sized images on an (h, w) token grid.

    image: a PIL image, an HxWx3 array, a [3, H, W] / [B, 3, H, W] tensor, or a list of
        those with equal sizes. Pass the image at the size the VLM's processor resized it
        to (H = h * 28 for Qwen2-VL); any size works, cells are area means.
    Returns float32 [B, C, h, w] in [0, 1]; channel order is `channel_names(config)`.
    NaN/Inf pixels are replaced by 0 so the output is always finite.
    """
    config = config or TextureConfig()
    if isinstance(image, (list, tuple)):
        batch = torch.cat([to_tensor(im) for im in image], dim=0)
    else:
        batch = to_tensor(image)
    h, w = int(grid_hw[0]), int(grid_hw[1])
    if h < 1 or w < 1:
        raise ValueError(f"grid_hw must be positive, got {grid_hw}")
    batch = torch.nan_to_num(batch, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
    # Channels are computed at a fixed work_px pixels per cell, so a cell means the same
    # whatever the processor's cell size (28 or 32 px) and a large image costs no more per cell.
    work = (h * config.work_px, w * config.work_px)
    if tuple(batch.shape[-2:]) != work:
        shrink = batch.shape[-2] >= work[0] and batch.shape[-1] >= work[1]
        batch = F.interpolate(batch, size=work, mode="area" if shrink else "bilinear", align_corners=None if shrink else False)
        batch = batch.clamp(0.0, 1.0)
    ctx = _Context(batch, (h, w), config)
    out = torch.cat([TEXTURE_REGISTRY[g].fn(ctx) for g in config.groups], dim=1)
    return out.clamp(0.0, 1.0).contiguous()
