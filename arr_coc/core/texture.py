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

A batch is computed at once, on whatever device its pixels are: frames of different sizes are padded
(`WorkImages`, `arr_coc.core.grid`) and each group reads only its frame's own pixels and cells, so a frame's
channels do not depend on what else is in its batch. Nothing is read back to the host.

Every channel lies in [0, 1]. Energies are squashed with a FIXED constant
(e -> e / (e + scale)) rather than divided by the image's own maximum, so a
near-uniform image keeps near-zero structure instead of amplified noise; the
allocator's "semantic void" fallback relies on that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from ..lazy import cached
from ..stopwatch import Stopwatch, lap
from typing import Callable, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .components import CAP, OBJECT_CHANNELS, PX_PER_CELL, STEPS, object_channels, settles_at_once
from .config import TextureConfig
from .grid import GridBatch, constant, eager_cpu, fill_edges, masked_median
from .kmeans import kmeans
from .pixel_maps import PixelSources, needs, pixel_cell_means, pixel_groups
from .spectral import gauss_taps, gaussian_blur, spectral_saliency, squash

ImageLike = Union[Image.Image, np.ndarray, torch.Tensor]

LUMA = (0.299, 0.587, 0.114)  # Rec. 601 luma weights


@dataclass
class _Group:
    channels: tuple[str, ...]
    fn: Callable[["_Context"], torch.Tensor]  # -> [F, len(channels), H, W] in [0, 1] (padding: anything)


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


@dataclass
class WorkImages:
    """A batch's frames at the texture's working resolution (`px` pixels per cell side), padded.

    pixels [F, 3, H * px, W * px] float32 in [0, 1], F = grid.frames; beyond frame f's own h * px x w * px,
    its last row and column repeated (`grid.fill_edges`). Built from images (`work_images`) or, in the
    wrapper, straight from the processor's patches on the VLM's device (`arr_coc.qwen.pixels`).
    """

    pixels: torch.Tensor
    grid: GridBatch
    px: int

    def __post_init__(self) -> None:
        _, hm, wm = self.grid.shape
        expected = (self.grid.frames, 3, hm * self.px, wm * self.px)
        if tuple(self.pixels.shape) != expected:
            raise ValueError(f"work pixels of shape {tuple(self.pixels.shape)}; expected {expected} for grids "
                             f"{list(self.grid.thw)} at {self.px} px per cell")


def pool_to(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Area means of [..., H, W] down to `size`: avg_pool2d when the sizes divide (the same sums as
    adaptive_avg_pool2d, bit for bit, and faster), adaptive_avg_pool2d otherwise."""
    hh, ww = x.shape[-2:]
    if hh % size[0] == 0 and ww % size[1] == 0:
        kh, kw = hh // size[0], ww // size[1]
        if (kh, kw) == (1, 1):
            return x
        if (kh, kw) == (2, 2) and eager_cpu(x.device):
            return _pool_pairs(x)
        return F.avg_pool2d(x, (kh, kw))
    return F.adaptive_avg_pool2d(x, size)


def _pool_pairs(x: torch.Tensor) -> torch.Tensor:
    """avg_pool2d(x, 2) bit for bit, as three strided adds in its order (row by row from zero, then / 4): on the CPU
    2.7x faster (a 512 x 512 map: 0.43 -> 0.16 ms, one thread), where avg_pool2d loops over each 2 x 2 window."""
    return (x[..., 0::2, 0::2] + x[..., 0::2, 1::2]).add_(x[..., 1::2, 0::2]).add_(x[..., 1::2, 1::2]).div_(4)


class _Context:
    """Shared intermediates of one padded batch, computed once on first use."""

    def __init__(self, work: WorkImages, config: TextureConfig, converge: bool):
        self.image = work.pixels  # [F, 3, H * px, W * px] in [0, 1], edges repeated over the padding
        self.grid = work.grid
        self.grid_hw = work.grid.shape[1:]  # the padded (H, W)
        self.px = work.px
        self.config = config
        self.converge = converge  # iterative parts run until done (reading flags back) instead of fixed steps
        self.converged: torch.Tensor | None = None  # [F] bool, set by a group with fixed steps (`object`)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """[F, C, H * px, W * px] pixels -> [F, C, H, W] cell means."""
        return pool_to(x, self.grid_hw)

    @cached
    def valid(self) -> torch.Tensor | None:  # [F, H * W] the frames' own cells; None when the batch is uniform
        return None if self.grid.uniform else self.grid.frame_valid.flatten(1)

    @cached
    def luma(self) -> torch.Tensor:  # [F, 1, H, W]
        weights = constant("luma", lambda: torch.tensor(LUMA), self.image)
        return torch.einsum("bchw,c->bhw", self.image, weights).unsqueeze(1)

    @cached
    def cell_rgb(self) -> torch.Tensor:  # [F, 3, h, w]
        return self.pool(self.image)

    @cached
    def cell_means(self) -> dict[str, torch.Tensor]:  # {group: [F, k, h, w]} of its full-resolution maps, one pooling
        gradients, blur = needs(self.config.groups)
        sources = PixelSources(self.luma, self.gradients if gradients else None,
                               gaussian_blur(self.luma, sigma=BLUR_SIGMA, cpu_taps=BLUR_TAPS) if blur else None)
        return pixel_cell_means(self.config.groups, sources, self.pool)

    @cached
    def cell_luma_std(self) -> torch.Tensor:  # [F, 1, h, w]
        means = self.cell_means["saliency"]   # the luminance's and its square's cell means
        mean = means[:, 0:1]
        return (means[:, 1:2] - mean**2).clamp_min(0).sqrt()

    @cached
    def dominant_rgb(self) -> torch.Tensor:  # [F, 3, 1, 1] per-channel median colour of the frame's cells
        valid = None if self.valid is None else self.valid[:, None]
        return masked_median(self.cell_rgb.flatten(2), valid)[..., None, None]

    @cached
    def foreground(self) -> torch.Tensor:  # [F, 1, H, W] in [0, 1): colour distance from the dominant colour
        d = self.image - self.dominant_rgb                                                  # [F, 3, H, W]
        distance = d.mul_(d).sum(1, keepdim=True).sqrt_().div_(math.sqrt(3))               # in place: same floats
        return distance.div_(distance + self.config.contrast_scale)                         # squash

    @cached
    def kmeans(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_valid = None
        if self.valid is not None:
            n_valid = self.grid.frame_sizes.prod(1)
        return kmeans(self.cell_rgb.flatten(2).transpose(1, 2), self.config.n_clusters, self.config.kmeans_iters,
                      self.valid, n_valid)

    @cached
    def gradients(self) -> torch.Tensor:  # [F, 2 or 4, H, W]: `sobel_bank` of the luminance (and the foreground)
        maps = [self.luma] + ([self.foreground] if "orientation" in self.config.groups else [])
        return sobel_bank(torch.cat(maps, dim=1))

    def fill_cells(self, x: torch.Tensor) -> torch.Tensor:
        """[F, C, H, W] cell maps with each frame's last cell row and column repeated over its padding."""
        return fill_edges(x, self.grid)


@register_channels("rgb", ("red", "green", "blue"))
def _rgb(ctx: _Context) -> torch.Tensor:
    return ctx.cell_rgb


@register_channels("position", ("pos_y", "pos_x"))
def _position(ctx: _Context) -> torch.Tensor:
    h, w = ctx.grid_hw
    f = ctx.image.shape[0]
    if ctx.grid.uniform:
        y = (torch.arange(h, dtype=ctx.image.dtype, device=ctx.image.device) + 0.5) / h
        x = (torch.arange(w, dtype=ctx.image.dtype, device=ctx.image.device) + 0.5) / w
        yy, xx = torch.meshgrid(y, x, indexing="ij")
        return torch.stack([yy, xx]).unsqueeze(0).expand(f, -1, -1, -1)
    sizes = ctx.grid.frame_sizes.to(ctx.image.dtype)                         # [F, 2] the frames' own h, w
    y = (torch.arange(h, dtype=ctx.image.dtype, device=ctx.image.device) + 0.5) / sizes[:, :1]   # [F, H]
    x = (torch.arange(w, dtype=ctx.image.dtype, device=ctx.image.device) + 0.5) / sizes[:, 1:]   # [F, W]
    return torch.stack([y[:, :, None].expand(f, h, w), x[:, None, :].expand(f, h, w)], dim=1)


def _channel_norm(x: torch.Tensor) -> torch.Tensor:
    """The Euclidean norm over dim 1 of [B, C, ...], keeping the dim: the channels moved last first (a norm over
    a strided dim runs ten times slower on the CPU than over a contiguous one)."""
    return x.movedim(1, -1).contiguous().norm(dim=-1).unsqueeze(1)


BLUR_SIGMA = 1.5                                       # the highpass group's Gaussian
BLUR_TAPS = gauss_taps(BLUR_SIGMA)                     # its weights as constants (the CPU's shifted multiply-adds)


def _sobel_kernels() -> torch.Tensor:
    """[2, 1, 3, 3]: d/dx and d/dy; |response| <= 1 for x in [0, 1]."""
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0
    return torch.stack([kx, kx.T]).unsqueeze(1)


# The kernels' non-zero taps (row, column, weight) in row-major order, the order a convolution accumulates in.
SOBEL_TAPS = (((0, 0, -0.125), (0, 2, 0.125), (1, 0, -0.25), (1, 2, 0.25), (2, 0, -0.125), (2, 2, 0.125)),   # d/dx
              ((0, 0, -0.125), (0, 1, -0.25), (0, 2, -0.125), (2, 0, 0.125), (2, 1, 0.25), (2, 2, 0.125)))   # d/dy


def shifted_sobel(device: torch.device) -> bool:
    """Whether `sobel_bank` runs as shifted adds: on the CPU, eager (a GPU and the compiler keep the convolution)."""
    return eager_cpu(device)


def _sobel_taps(padded: torch.Tensor) -> torch.Tensor:
    """[F, n, H + 2, W + 2] -> [F, n, 2, H, W]: the convolution's sums tap after tap, each a multiply-add by a
    power of two (an exact product, so one rounding per tap as in the convolution): bit for bit oneDNN's grouped
    convolution on the CPUs tested (AVX-512, and AVX2 for one picture), else within float32 rounding, and 6-13x
    faster (oneDNN's kernels for one input channel per group are slow: 7.8 -> 0.6 ms for two 512 x 512 maps)."""
    f, n, hp, wp = padded.shape
    h, w = hp - 2, wp - 2
    out = padded.new_empty(f, n, 2, h, w)
    st = padded.stride()           # the 8 shifted windows, one view op each (slicing makes two)
    shifted = {(i, j): padded.as_strided((f, n, h, w), st, padded.storage_offset() + i * st[2] + j * st[3])
               for i, j, _ in SOBEL_TAPS[0] + SOBEL_TAPS[1]}
    for d, ((i, j, first), *rest) in enumerate(SOBEL_TAPS):
        plane = out[:, :, d]
        torch.mul(shifted[i, j], first, out=plane)
        for i, j, weight in rest:
            plane.add_(shifted[i, j], alpha=weight)
    return out


def sobel_bank(x: torch.Tensor) -> torch.Tensor:
    """[F, n, H, W] maps -> [F, 2n, H, W]: each map's Sobel d/dx, d/dy (replicate padding). On the CPU, eager,
    shifted adds (`_sobel_taps`); elsewhere every map in ONE grouped convolution (one kernel launch, not two)."""
    f, n, h, w = x.shape
    # built on both paths: the compiled pass traces after an eager warm-up and must find it (one built in a trace
    # is a recompile)
    weight = constant(f"sobel{n}", lambda: _sobel_kernels().repeat(n, 1, 1, 1), x)      # [2n, 1, 3, 3]
    padded = F.pad(x, (1, 1, 1, 1), mode="replicate")
    if shifted_sobel(x.device):
        return _sobel_taps(padded).view(f, 2 * n, h, w)
    return F.conv2d(padded, weight, groups=n)


@register_channels("sobel", ("sobel_x", "sobel_y", "sobel_mag"))
def _sobel(ctx: _Context) -> torch.Tensor:
    # cell means of |d/dx|, |d/dy| and the gradient magnitude of the luminance (`pixel_maps`)
    return squash(ctx.cell_means["sobel"], ctx.config.edge_scale)


@register_channels("saliency", ("sal_spectral", "sal_contrast", "sal_color"))
def _saliency(ctx: _Context) -> torch.Tensor:
    cfg = ctx.config
    # Centre-surround: a cell's colour against the mean of its 5x5 cell neighbourhood, plus the
    # luminance spread inside the cell (small objects sit inside one cell).
    rgb = ctx.cell_rgb
    surround = F.avg_pool2d(F.pad(ctx.fill_cells(rgb), (2, 2, 2, 2), mode="replicate"), 5, stride=1)
    contrast = _channel_norm(rgb - surround) / math.sqrt(3) + ctx.cell_luma_std
    # Colour distinctiveness from the dominant (median) cell colour.
    distinct = _channel_norm(rgb - ctx.dominant_rgb) / math.sqrt(3)
    return torch.cat(
        [
            spectral_saliency(ctx.luma, ctx.grid, ctx.px, cfg.saliency_size, cfg.contrast_scale),
            squash(contrast, cfg.contrast_scale),
            squash(distinct, cfg.contrast_scale),
        ],
        dim=1,
    )


@register_channels("clusters", ("cluster_rarity", "cluster_edge"))
def _clusters(ctx: _Context) -> torch.Tensor:
    labels, centroids = ctx.kmeans  # [F, N], [F, k, 3]
    f, n = labels.shape
    h, w = ctx.grid_hw
    k = centroids.shape[1]
    member = labels[..., None] == torch.arange(k, device=labels.device)  # [F, N, k]
    if ctx.valid is not None:
        member = member & ctx.valid[..., None]
    sizes = member.sum(1).to(centroids)  # [F, k]
    dominant = centroids[torch.arange(f, device=labels.device), sizes.argmax(1)]  # [F, 3]
    centroid_dist = (centroids - dominant[:, None]).norm(dim=-1) / math.sqrt(3)  # [F, k]
    cells = n if ctx.valid is None else ctx.valid.sum(1, keepdim=True).to(centroids)
    rarity = (1.0 - sizes / cells) * squash(centroid_dist, ctx.config.contrast_scale)
    rarity = rarity.gather(1, labels)  # [F, N]
    # Cluster-edge strength: mean colour distance from a cell's centroid to its 8 neighbours' centroids.
    cell_centroid = centroids.gather(1, labels[..., None].expand(-1, -1, 3))  # [F, N, 3]
    grid = cell_centroid.transpose(1, 2).reshape(f, 3, h, w)
    padded = F.pad(ctx.fill_cells(grid), (1, 1, 1, 1), mode="replicate")
    neighbours = F.unfold(padded, 3).reshape(f, 3, 9, h * w)  # [F, 3, 9, N]
    edge = _channel_norm(neighbours - grid.reshape(f, 3, 1, h * w))[:, 0].sum(1) / (8 * math.sqrt(3))
    edge = squash(edge, ctx.config.contrast_scale)
    return torch.stack([rarity, edge], dim=1).reshape(f, 2, h, w)


@register_channels("highpass", ("highpass",))
def _highpass(ctx: _Context) -> torch.Tensor:
    # cell means of (luminance - its Gaussian blur)^2 (`pixel_maps`)
    return squash(ctx.cell_means["highpass"].sqrt(), ctx.config.highpass_scale)


SUBCELLS = 4  # silhouette: sub-cells per cell side


@register_channels("silhouette", tuple(f"sil_{y}{x}" for y in range(SUBCELLS) for x in range(SUBCELLS)))
def _silhouette(ctx: _Context) -> torch.Tensor:
    h, w = ctx.grid_hw
    sub = pool_to(ctx.foreground, (h * SUBCELLS, w * SUBCELLS))  # [F, 1, 4h, 4w]
    return F.pixel_unshuffle(sub, SUBCELLS)  # [F, 16, h, w], channel = sub-row * 4 + sub-column


@register_channels("orientation", ("edge_vert", "edge_horiz", "edge_rise", "edge_fall"))
def _orientation(ctx: _Context) -> torch.Tensor:
    # The foreground's gradient (gx, gy) runs across an edge and y grows downwards: a vertical edge has a
    # horizontal gradient, a rising edge "/" a gradient along (1, 1). vert + horiz = rise + fall = the cell's whole
    # edge energy, so each channel is that energy (squashed) times its direction's share of it: an upright square's
    # sides read (1, 0, .5, .5) of it, a triangle's slanted sides (.5, .5, 1, 0).
    energy = ctx.cell_means["orientation"]  # [F, 4, h, w] cell means of gx^2, gy^2, (gx + gy)^2 / 2, (gx - gy)^2 / 2
    total = energy[:, :2].sum(1, keepdim=True)
    return squash(total.sqrt(), ctx.config.edge_scale) * energy / total.clamp_min(1e-12)


@register_channels("object", OBJECT_CHANNELS)
def _object(ctx: _Context) -> torch.Tensor:
    # Foreground: further from the dominant colour than contrast_scale (the squashed distance passes 1/2).
    h, w = ctx.grid_hw
    share = pool_to(ctx.foreground, (h * PX_PER_CELL, w * PX_PER_CELL))  # [F, 1, 8h, 8w]
    mask = share[:, 0] > 0.5
    if ctx.valid is not None:  # a frame's padding is background, whatever its repeated edge holds
        mask = mask & ctx.grid.frame_valid.repeat_interleave(PX_PER_CELL, 1).repeat_interleave(PX_PER_CELL, 2)
    if ctx.converge:
        out, ctx.converged = object_channels(mask, ctx.grid_hw, None, None)
    else:   # fixed steps with a flag the layer reads (and redoes the pass on), or on the CPU settled at once
        out, ctx.converged = object_channels(mask, ctx.grid_hw, STEPS, CAP, settle=settles_at_once(mask.device))
    return out


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


def to_work_resolution(batch: torch.Tensor, grid_hw: tuple[int, int], px: int) -> torch.Tensor:
    """[B, 3, H, W] images of one size -> [B, 3, h * px, w * px] in [0, 1]: NaN/Inf replaced, area means when
    shrinking (bilinear when growing), so a cell means the same whatever the processor's cell size."""
    batch = torch.nan_to_num(batch, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
    work = (grid_hw[0] * px, grid_hw[1] * px)
    if tuple(batch.shape[-2:]) != work:
        shrink = batch.shape[-2] >= work[0] and batch.shape[-1] >= work[1]
        batch = F.interpolate(batch, size=work, mode="area" if shrink else "bilinear", align_corners=None if shrink else False)
        batch = batch.clamp(0.0, 1.0)
    return batch


def work_images(images: Sequence[ImageLike], grid: GridBatch, px: int) -> WorkImages:
    """One image per item of `grid` (t = 1), any size and type (`to_tensor`), resized to its own grid at `px`
    pixels per cell, padded to the batch, on `grid.device`. One resize per image: the wrapper builds its
    batch from the processor's patches instead (`arr_coc.qwen.pixels`)."""
    if len(images) != len(grid):
        raise ValueError(f"got {len(images)} images for {len(grid)} grids; pass one (h, w) per image")
    if any(t != 1 for t, _, _ in grid.thw):
        raise ValueError("work_images takes images (t = 1); build video frames' WorkImages from their patches")
    _, hm, wm = grid.shape
    frames = []
    for image, (_, h, w) in zip(images, grid.thw):
        x = to_work_resolution(to_tensor(image).to(grid.device)[:1], (h, w), px)
        frames.append(x if (h, w) == (hm, wm) else F.pad(x, (0, (wm - w) * px, 0, (hm - h) * px)))
    return WorkImages(fill_edges(torch.cat(frames), grid, px), grid, px)


def texture_array(work: WorkImages, config: TextureConfig | None = None, converge: bool = False,
                  clock: Stopwatch | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The texture array of a padded batch: float32 [F, C, H, W] in [0, 1] (zero on padding), channel order
    `channel_names(config)`, and whether its fixed-step parts converged ([F] bool on the device, read with the
    layer's result; None when the config has none: only the `object` group's components do).

    converge: run the components until nothing changes instead (reads a flag back after every step: the exact
    redo for the rare frame whose flag came back False, and `generate_texture_array`).
    clock: laps "texture.pixels" after the full-resolution maps (the luminance, the foreground, their gradients, the
    blur: `pixel_maps`), "texture.<group>" after each group (an intermediate a group is the first to need counts as
    its own: `bench --layer`), then "texture" for the assembly.
    """
    config = config or TextureConfig()
    if work.px != config.work_px:
        raise ValueError(f"work images at {work.px} px per cell, but texture.work_px is {config.work_px}")
    ctx = _Context(work, config, converge)
    if pixel_groups(config.groups):
        ctx.cell_means                          # the full-resolution maps, one buffer, one pooling (`pixel_maps`)
        lap(clock, "texture.pixels")
    groups = []
    for g in config.groups:
        groups.append(TEXTURE_REGISTRY[g].fn(ctx))
        lap(clock, f"texture.{g}")
    out = torch.cat(groups, dim=1).clamp(0.0, 1.0)
    if not work.grid.uniform:
        out = out * work.grid.frame_valid[:, None]
    out = out.contiguous()
    lap(clock, "texture")
    return out, ctx.converged


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
    grid = GridBatch.of_images([(h, w)] * batch.shape[0], batch.device)
    work = WorkImages(to_work_resolution(batch, (h, w), config.work_px), grid, config.work_px)
    return texture_array(work, config, converge=True)[0]
