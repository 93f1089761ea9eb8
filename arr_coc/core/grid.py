"""The batch's geometry on the merged-token grid, and the padded-batch operations every stage shares.

A batch holds B items. Item b is t_b frames of h_b x w_b merged cells: an image is t = 1 (Qwen's own
`grid_thw`, merged), a video clip t > 1. Every per-cell tensor of the core is padded to the batch's
largest (T, H, W): frames at the end, cells at the bottom and right. A spatial stage (texture, scorers)
runs on the batch's frames, [B * T, ..., H, W], each frame valid in its top-left h_b x w_b; a decision
(balancing, budgets, top-k) runs on each item's cells, [B, T * H * W], raster order over (t, h, w).

The geometry is known on the host (the processor gave it), so a stage never reads it back from the
device: what the device needs of it (`sizes`, `valid`) is uploaded once per batch, and a batch whose
items all have one size skips the padding work altogether (`uniform`).

Padded batches stay exact where the maths is local: `fill_edges` repeats each frame's last row and
column into its padding, so a replicate-padded filter (Sobel, a blur, a pooled neighbourhood) reads at
a frame's border exactly what it would read on the frame alone; `masked_median` is torch.median
(the lower median) over each frame's own values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from ..lazy import cached
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

UPLOAD_WATCHERS: list = []  # OpCounters that count uploads (arr_coc.evaluation.opcount)


def upload(values: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host data (computed on the host, e.g. with numpy) on `device` without a stall: on a GPU, copied from
    pinned memory asynchronously. Every upload of the core goes through here, so it can be counted."""
    for watcher in UPLOAD_WATCHERS:
        watcher.uploads += 1
        watcher._in_upload = True
    try:
        t = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
    finally:
        for watcher in UPLOAD_WATCHERS:
            watcher._in_upload = False
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class GridBatch:
    """Merged-cell grids of B items, (t, h, w) each, and where their padded batch lives."""

    thw: tuple[tuple[int, int, int], ...]
    device: torch.device = field(default=torch.device("cpu"), compare=False)

    def __post_init__(self) -> None:
        thw = tuple((int(t), int(h), int(w)) for t, h, w in self.thw)
        if not thw:
            raise ValueError("a grid batch needs at least one item")
        if any(min(g) < 1 for g in thw):
            raise ValueError(f"every grid needs t, h, w >= 1, got {list(thw)}")
        object.__setattr__(self, "thw", thw)
        object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def of_images(cls, grid_hw: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> GridBatch:
        """Images: one frame each."""
        return cls(tuple((1, int(h), int(w)) for h, w in grid_hw), torch.device(device))

    # -- host facts -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.thw)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The padded (T, H, W)."""
        return tuple(max(g[i] for g in self.thw) for i in range(3))  # type: ignore[return-value]

    @property
    def frames(self) -> int:
        """Frames in the padded batch: B * T."""
        return len(self.thw) * self.shape[0]

    @property
    def grid_hw(self) -> list[tuple[int, int]]:
        return [(h, w) for _, h, w in self.thw]

    @property
    def cells(self) -> list[int]:
        """Cells per item: t * h * w."""
        return [t * h * w for t, h, w in self.thw]

    @property
    def uniform(self) -> bool:
        """Every item fills the padded shape: padding, masks and edge fills can be skipped."""
        return all(g == self.shape for g in self.thw)

    def frame_hw(self) -> list[tuple[int, int]]:
        """(h, w) of every padded frame, item-major (padding frames of a shorter clip repeat its size)."""
        return [(h, w) for _, h, w in self.thw for _ in range(self.shape[0])]

    def size_groups(self) -> dict[tuple[int, int], list[int]]:
        """Frames by their (h, w), for the few steps whose arithmetic depends on a frame's size."""
        groups: dict[tuple[int, int], list[int]] = {}
        for f, hw in enumerate(self.frame_hw()):
            groups.setdefault(hw, []).append(f)
        return groups

    # -- on the device ----------------------------------------------------------------------------
    @cached
    def frame_sizes(self) -> torch.Tensor:
        """LongTensor[B * T, 2] (h, w) of every padded frame."""
        return upload(np.array(self.frame_hw(), dtype=np.int64), self.device)

    @cached
    def valid(self) -> torch.Tensor:
        """BoolTensor[B, T, H, W]: the cells each item really has (made on the host, one upload)."""
        T, H, W = self.shape
        mask = np.zeros((len(self), T, H, W), dtype=bool)
        for b, (t, h, w) in enumerate(self.thw):
            mask[b, :t, :h, :w] = True
        return upload(mask, self.device)

    def edge_index(self, per_cell: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [F, H * per_cell], cols [F, W * per_cell]) long: each padded pixel's source row / column in
        its frame, the last one repeated over the padding (`fill_edges`); cached per per_cell."""
        cache = self.__dict__.setdefault("_edge_index", {})
        if per_cell not in cache:
            _, hm, wm = self.shape
            sizes = np.array(self.frame_hw(), dtype=np.int64) * per_cell
            rows = np.minimum(np.arange(hm * per_cell)[None], sizes[:, :1] - 1)
            cols = np.minimum(np.arange(wm * per_cell)[None], sizes[:, 1:] - 1)
            cache[per_cell] = (upload(rows, self.device), upload(cols, self.device))
        return cache[per_cell]

    @property
    def frame_valid(self) -> torch.Tensor:
        """BoolTensor[B * T, H, W]."""
        return self.valid.flatten(0, 1)

    @cached
    def cell_rows(self) -> torch.Tensor | None:
        """LongTensor[B * T * H * W]: for each padded cell, its row among the items' cells concatenated (each
        item raster over its own (t, h, w)); padding points at row 0. None when the batch is uniform (the
        concatenation already is the padded layout)."""
        if self.uniform:
            return None
        T, H, W = self.shape
        rows, start = [], 0
        for t, h, w in self.thw:
            tt, yy, xx = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
            inside = (tt < t) & (yy < h) & (xx < w)
            rows.append(np.where(inside, start + (tt * h + yy) * w + xx, 0).reshape(-1))
            start += t * h * w
        return upload(np.concatenate(rows).astype(np.int64), self.device)

    def pad_cells(self, rows: torch.Tensor) -> torch.Tensor:
        """[sum of t*h*w, D] the items' cells concatenated -> [B, T * H * W, D] padded (zeros on padding)."""
        b, n = len(self), self.frames // len(self) * self.shape[1] * self.shape[2]
        if self.cell_rows is None:
            return rows.reshape(b, n, -1)
        return rows.index_select(0, self.cell_rows).reshape(b, n, -1) * self.item_valid[..., None]

    @property
    def item_valid(self) -> torch.Tensor:
        """BoolTensor[B, T * H * W]: valid cells in each item's raster order over (t, h, w)."""
        return self.valid.flatten(1)


def fill_edges(x: torch.Tensor, grid: GridBatch, per_cell: int = 1) -> torch.Tensor:
    """[F, C, H * per_cell, W * per_cell] frames -> the same with each frame's last row and column repeated
    over its padding (F = grid.frames), so replicate padding reads at a frame's border what it reads alone."""
    if grid.uniform:
        return x
    f, c, hp, wp = x.shape
    rows, cols = grid.edge_index(per_cell)
    x = x.gather(2, rows[:, None, :, None].expand(f, c, hp, wp))
    return x.gather(3, cols[:, None, None, :].expand(f, c, hp, wp))


def masked_median(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """torch.median (the lower median) over the last dim of x [..., N], counting only `valid` [..., N]
    (broadcastable) entries; valid None: every entry. Each row needs at least one valid entry."""
    if valid is None:
        return x.median(dim=-1).values
    valid = valid.expand_as(x)
    ordered = x.masked_fill(~valid, float("inf")).sort(dim=-1).values
    middle = (valid.sum(-1, keepdim=True) - 1).clamp_min(0) // 2
    return ordered.gather(-1, middle).squeeze(-1)


_AS_ON_A_GPU: list[bool] = [False]   # set by `as_on_a_gpu`


def on_cpu(device: torch.device) -> bool:
    """Whether work on `device` runs on the CPU, eager or compiled, where the CPU's own kernels pay (the blur's
    shifted adds: `spectral.gaussian_blur`; the patches pooled channels last: `qwen.pixels.pool_planes_last`).
    False inside `as_on_a_gpu`."""
    return device.type == "cpu" and not _AS_ON_A_GPU[0]


def eager_cpu(device: torch.device) -> bool:
    """Whether work on `device` runs on the CPU outside the compiler: where a kernel launch costs nothing and reading
    a count back no sync, so a CPU-only kernel path pays (`components.over_mask_pixels`, `texture.shifted_sobel`,
    `kmeans.stops_at_a_fixed_point`, `texture.pool_to`'s 2 x 2 windows). False inside `as_on_a_gpu`."""
    return on_cpu(device) and not torch.compiler.is_compiling()


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Inside: the CPU runs every CPU-only path as a GPU runs it (the ops a GPU launches, nothing read back), for
    counting a GPU's ops on the CPU and for holding the two paths against each other in tests. Process-wide (not
    per thread): for a bench or a test, not around a server's requests."""
    before, _AS_ON_A_GPU[0] = _AS_ON_A_GPU[0], True
    try:
        yield
    finally:
        _AS_ON_A_GPU[0] = before


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(key: str, builder: Callable[[], torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A constant tensor (a filter kernel, luma weights) built on the host once and kept on `like`'s device
    in its dtype: later batches launch nothing and upload nothing for it."""
    slot = (key, like.device, like.dtype)
    if slot not in _CONSTANTS:
        _CONSTANTS[slot] = upload(builder().to(like.dtype), like.device)
    return _CONSTANTS[slot]


__all__ = ["GridBatch", "as_on_a_gpu", "constant", "eager_cpu", "fill_edges", "masked_median", "on_cpu", "upload"]
