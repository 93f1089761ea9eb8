"""Encoding modes: the vision tower on every patch ("after"), or only on the cells ARR-COC chose
("before": a cheap gist of the whole image, then full resolution where the question looks).

Selecting before encoding is exact where it can be. transformers 5.23's Qwen2-VL, Qwen2.5-VL and
Qwen3-VL vision encoders accept precomputed `position_ids`, `cu_seqlens`, `window_index` /
`cu_window_seqlens` (Qwen2.5-VL) and `interp_indices` / `interp_weights` (Qwen3-VL's learned position
table) as keyword arguments (`transformers/vision_utils.py`). `encode_cells` computes them for the
FULL grid, gathers the rows of the chosen cells' patches and packs those patches into one attention
segment per image, so every kept patch is encoded at its true 2-D position:

- with every cell chosen it reproduces the stock encoding exactly (tested, three families);
- Qwen2.5-VL's window attention is exact for windows that are kept whole: each chosen cell stays in
  its full-grid window (windows are assigned on the full grid, never on the packed sequence);
- what changes is the full-attention context: a chosen cell attends only to the other chosen cells
  (plus a `margin` of context cells, encoded but not passed to the language model);
- `windows=True` (Qwen2.5-VL) encodes every window that holds a chosen cell whole, so the window
  layers are exact for the chosen cells too (the rest of each window is context, like the margin).

Patches are laid out by the processor in merge-block order, so merged cell c of an image owns the
`merge**2` consecutive patch rows starting at `merge**2 * c` (images have one temporal patch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..grid import upload
from ..saccade import SaccadeConfig
from ..stopwatch import Stopwatch, lap

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EncodeMode = Literal["after", "before"]
ENCODE_MODES: tuple[str, ...] = ("after", "before")


@dataclass(frozen=True)
class EncodeConfig:
    """How the vision tower is spent.

    mode       "after": encode every patch, then select (the stock encoding); "before": select, then
               encode only the chosen cells (+ context: margin, whole windows).
    gist       "before" only: share of the full grid's merged tokens the gist has (the tower on a
               downscaled copy of the image; its tokens are the selector's coarse view). 0 (the
               default): no gist, the selector reads the texture array and the question only.
               Measured on the validation split with the shipped layer (docs/RESULTS.md): a quarter-
               size gist costs 11% of the full tower, and at ~15% of the full prefill texture-only
               selection answered 7.7 points better [+3.9, +11.4] at the same cost.
    margin     "before" only: rings of context cells encoded around every chosen cell and dropped
               before the language model (a chosen cell's token depends on its neighbours).
    periphery  "before" only: the language model also reads the gist tokens of the regions not
               encoded at full resolution, each at the full-grid cell under its centre.
    windows    "before" only, Qwen2.5-VL only: every attention window of the tower that holds a
               chosen cell is encoded whole (its window layers then see exactly their stock inputs);
               the window's other cells are context, encoded and dropped like the margin (union
               with it). Windows are the full grid's, as the tower assigns them (`cell_windows`).
    saccade    "before" only: how many looks (`SaccadeConfig.passes`, 1 = one look) and how each further
               one is decided and aimed (`arr_coc.saccade`); a mapping of its fields is accepted.
    """

    mode: EncodeMode = "after"
    gist: float = 0.0
    margin: int = 0
    periphery: bool = False
    windows: bool = False
    saccade: SaccadeConfig = SaccadeConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "saccade", SaccadeConfig.of(self.saccade))
        if self.mode not in ENCODE_MODES:
            raise ValueError(f"encode mode {self.mode!r} is not one of {list(ENCODE_MODES)}")
        if not 0.0 <= self.gist < 1.0:
            raise ValueError(f"gist={self.gist} must be a share of the tokens in [0, 1) (0: no gist)")
        if self.margin < 0:
            raise ValueError(f"margin={self.margin} must be >= 0 cells")
        before_only = [s for s, on in ((f"gist={self.gist}", self.gist > 0), (f"margin={self.margin}", self.margin > 0),
                                       ("windows=True (--whole-windows)", self.windows),
                                       (f"passes={self.passes} (--passes)", self.passes > 1)) if on]
        if self.mode == "after" and before_only:
            raise ValueError(f"mode='before' (--encode before) is needed for {', '.join(before_only)}, which choose "
                             "what the tower encodes before selection; with 'after' every patch is encoded anyway")
        if self.periphery and self.gist <= 0:
            raise ValueError("periphery=True shows the language model the gist: it needs gist > 0")

    @property
    def passes(self) -> int:
        return self.saccade.passes

    def check_family(self, family: str) -> None:
        """Refuse what this VLM family cannot do (before any encoding work): whole windows need Qwen2.5-VL."""
        if self.windows and family not in WINDOWED_FAMILIES:
            raise ValueError(f"windows=True (--whole-windows) applies to Qwen2.5-VL only, whose vision tower "
                             f"attends within windows; this model ({family}) has no window attention. Use "
                             "margin=1 (--margin 1) to encode a ring of context cells around the chosen ones instead")


WINDOWED_FAMILIES: tuple[str, ...] = ("qwen2_5_vl",)   # vision towers with window attention


def dilate(cells: torch.Tensor, grid_hw: tuple[int, int], rings: int) -> torch.Tensor:
    """Raster cells within `rings` cells (Chebyshev distance) of any of `cells`, ascending. Host work (numpy)."""
    chosen = np.asarray(cells.cpu().numpy(), dtype=np.int64)
    if rings <= 0:
        return torch.from_numpy(np.sort(chosen))
    h, w = grid_hw
    mask = np.zeros((h + 2 * rings, w + 2 * rings), dtype=bool)
    ys, xs = np.divmod(chosen, w)
    for dy in range(2 * rings + 1):
        for dx in range(2 * rings + 1):
            mask[ys + dy, xs + dx] = True
    return torch.from_numpy(np.flatnonzero(mask[rings: rings + h, rings: rings + w]).astype(np.int64))


def _full_grid_kwargs(visual: torch.nn.Module, family: str, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-patch tensors the encoder would compute for the whole grid (patch rows, block order)."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    merge = int(visual.spatial_merge_size)
    out = {"position_ids": get_vision_position_ids(grid_thw, merge)}
    if family == "qwen3_vl":
        out["interp_indices"], out["interp_weights"] = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    if family == "qwen2_5_vl":
        out["window_of_cell"], out["window_rank"] = _window_assignment(visual, grid_thw)
    return out


def _window_assignment(visual: torch.nn.Module, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's full-grid windows, as the tower computes them (transformers' `get_vision_window_index`,
    padded partial windows at the bottom / right edges included), per merged cell over the batch's images:
    -> (window_of_cell [C] window id, window_rank [C] the cell's place in window order)."""
    from transformers.vision_utils import get_vision_window_index

    merge = int(visual.spatial_merge_size)
    window_index, cu_window = get_vision_window_index(
        grid_thw, spatial_merge_size=merge, window_size=visual.window_size, patch_size=visual.patch_size)
    window_index = window_index.cpu()
    return _window_of_cell(window_index, cu_window.cpu(), merge ** 2), torch.argsort(window_index)


def _window_of_cell(window_index: torch.Tensor, cu_window: torch.Tensor, unit: int) -> torch.Tensor:
    """For every merged cell (global index over the batch's images), the window it belongs to."""
    bounds = (cu_window.long() // unit).tolist()
    window_of = torch.empty(window_index.numel(), dtype=torch.long)
    for w, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        window_of[window_index[a:b]] = w
    return window_of


def cell_windows(visual: torch.nn.Module, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Per image, LongTensor[h_i * w_i]: the full-grid attention window of each merged cell (raster order;
    ids unique over the batch). Qwen2.5-VL towers only."""
    window_of, _ = _window_assignment(visual, grid_thw)
    merge = int(visual.spatial_merge_size)
    sizes = [int(t) * int(h) * int(w) // merge ** 2 for t, h, w in grid_thw.tolist()]
    return list(torch.split(window_of, sizes))


def whole_windows(cells: torch.Tensor, window_of: torch.Tensor) -> torch.Tensor:
    """Raster cells that share a window with any of `cells`, ascending. window_of [h * w]: `cell_windows`."""
    return torch.isin(window_of, window_of[cells.long().cpu()]).nonzero().squeeze(1)


def cells_to_encode(model: PreTrainedModel, grid_thw: torch.Tensor, grid_hw: Sequence[tuple[int, int]],
                    chosen: Sequence[torch.Tensor], config: EncodeConfig) -> list[torch.Tensor]:
    """Per image, the ascending raster cells `encode_cells` encodes: the chosen ones, `config.margin` rings
    around them and, with `config.windows`, the rest of every full-grid window that holds one (union)."""
    config.check_family(model.config.model_type)
    encoded = [dilate(c, g, config.margin) for c, g in zip(chosen, grid_hw)]
    if config.windows:
        windows = cell_windows(model.model.visual, grid_thw)
        encoded = [torch.cat([e.cpu(), whole_windows(c, w)]).unique() for e, c, w in zip(encoded, chosen, windows)]
    return encoded


@torch.no_grad()
def encode_cells(
    model: PreTrainedModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor, cells: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
    """The vision tower + merger on the chosen cells only, at their true positions.

    pixel_values [P, C] every patch of every image (processor order); grid_thw [N, 3];
    cells: per image, ascending raster indices of the merged cells to encode.
    -> (per image Tensor[K_i, D] in the order of `cells[i]`,
        Qwen3-VL deepstack: per image, one Tensor[K_i, D] per deepstack layer; else None).
    """
    tokens, deep = encode_packed(model, pixel_values, grid_thw.cpu(), [c.cpu().numpy() for c in cells])
    counts = [int(c.numel()) for c in cells]
    feats = list(torch.split(tokens, counts))
    deep_per_image = None
    if deep is not None:
        split = [torch.split(layer, counts) for layer in deep]
        deep_per_image = [[layer[i] for layer in split] for i in range(len(counts))]
    return feats, deep_per_image


@torch.no_grad()
def encode_packed(model: PreTrainedModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                  cells: Sequence[np.ndarray], clock: Stopwatch | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """`encode_cells` with the index work on the host: grid_thw [N, 3] on the host, cells per image (numpy,
    ascending); everything the tower needs is worked out there and uploaded once per tensor.
    -> (tokens [sum K_i, D], image after image; Qwen3-VL deepstack: one [sum K_i, D] per layer, else None)."""
    visual = model.model.visual
    family = model.config.model_type
    unit = int(visual.spatial_merge_size) ** 2
    full = _full_grid_kwargs(visual, family, grid_thw)
    rows, cell_global, offset, cell_offset = [], [], 0, 0
    for (t, h, w), chosen in zip(grid_thw.tolist(), cells):
        if int(t) != 1:
            raise ValueError("encode='before' handles images (one temporal patch); pass videos with encode='after'")
        chosen = np.asarray(chosen, dtype=np.int64)
        rows.append(offset + (unit * chosen[:, None] + np.arange(unit)[None, :]).reshape(-1))
        cell_global.append(cell_offset + chosen)
        offset += int(h) * int(w)
        cell_offset += int(h) * int(w) // unit
    rows_np = np.concatenate(rows)
    dev = pixel_values.device
    counts = [len(c) for c in cells]
    cu = np.concatenate([[0], np.cumsum([unit * k for k in counts])]).astype(np.int32)
    kwargs: dict[str, torch.Tensor] = {"position_ids": upload(full["position_ids"].numpy()[rows_np], dev),
                                       "cu_seqlens": upload(cu, dev)}
    if family == "qwen3_vl":
        kwargs["interp_indices"] = upload(full["interp_indices"].numpy()[rows_np], dev)
        kwargs["interp_weights"] = upload(full["interp_weights"].numpy()[rows_np], dev)
    if family == "qwen2_5_vl":
        kwargs["window_index"], kwargs["cu_window_seqlens"] = _packed_windows(
            torch.from_numpy(np.concatenate(cell_global)), full["window_of_cell"], full["window_rank"], unit, dev)
    patches = pixel_values.index_select(0, upload(rows_np, dev)).type(visual.dtype)
    lap(clock, "packing")
    out = visual(patches, grid_thw=upload(grid_thw.numpy(), dev), **kwargs)
    lap(clock, "vision")
    deep = getattr(out, "deepstack_features", None)
    return out.pooler_output, None if deep is None else list(deep)


def _packed_windows(cells: torch.Tensor, window_of: torch.Tensor, rank: torch.Tensor, unit: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's window attention on the packed cells: each keeps its FULL-grid window, and inside a
    window the full encoding's order. -> (window_index over packed cells, cu_window_seqlens in patches)."""
    order = torch.argsort(rank[cells])                  # packed cells in the full encoding's window order
    windows = window_of[cells][order]
    _, per_window = torch.unique_consecutive(windows, return_counts=True)
    cu = F.pad((per_window * unit).cumsum(0, dtype=torch.int32), (1, 0))
    return upload(order, device), upload(cu, device)


def as_encode_config(encode: EncodeConfig | str | None) -> EncodeConfig:
    """None / "after" / "before" / an EncodeConfig -> an EncodeConfig."""
    if encode is None:
        return EncodeConfig()
    if isinstance(encode, EncodeConfig):
        return encode
    if isinstance(encode, str):
        return EncodeConfig(mode=encode)  # type: ignore[arg-type]
    raise TypeError(f"encode must be 'after', 'before' or an EncodeConfig, got {type(encode).__name__}")


def encoder_output_class(model: PreTrainedModel) -> type:
    """The vision-encoder output type `forward(mm_encoder_outputs=...)` expects from this family."""
    import importlib

    from transformers.modeling_outputs import BaseModelOutputWithPooling

    module = importlib.import_module(type(model.model).__module__)
    return getattr(module, "BaseModelOutputWithDeepstackFeatures", BaseModelOutputWithPooling)
