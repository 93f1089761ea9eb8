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

from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..encode import EncodeConfig
from ..core.grid import upload
from ..geometry import dilate
from ..stopwatch import Stopwatch, lap
from .families import Family, family_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

def _full_grid_kwargs(visual: torch.nn.Module, family: Family, grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-patch tensors the encoder would compute for the whole grid (patch rows, block order)."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    merge = int(visual.spatial_merge_size)
    out = {"position_ids": get_vision_position_ids(grid_thw, merge)}
    if family.position_table:
        out["interp_indices"], out["interp_weights"] = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    if family.windows:
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
    family_of(model).check_encode(config)
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


def encode_packed(model: PreTrainedModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                  cells: Sequence[np.ndarray], clock: Stopwatch | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """`encode_cells` with the index work on the host: grid_thw [N, 3] on the host, cells per image (numpy,
    ascending); everything the tower needs is worked out there and uploaded once per tensor.
    -> (tokens [sum K_i, D], image after image; Qwen3-VL deepstack: one [sum K_i, D] per layer, else None).
    Grad mode is the caller's (the pipeline's no_grad; train-adapter trains the tower's adapter through it)."""
    visual = model.model.visual
    family = family_of(model)
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
    kwargs: dict[str, Any] = {"position_ids": upload(full["position_ids"].numpy()[rows_np], dev),
                              "cu_seqlens": upload(cu, dev), "max_seqlen": int(np.diff(cu).max())}
    if family.position_table:
        kwargs["interp_indices"] = upload(full["interp_indices"].numpy()[rows_np], dev)
        kwargs["interp_weights"] = upload(full["interp_weights"].numpy()[rows_np], dev)
    if family.windows:
        kwargs["window_index"], kwargs["cu_window_seqlens"], kwargs["max_window_seqlen"] = _packed_windows(
            torch.from_numpy(np.concatenate(cell_global)), full["window_of_cell"], full["window_rank"], unit, dev)
    patches = pixel_values.index_select(0, upload(rows_np, dev)).type(visual.dtype)
    lap(clock, "packing")
    out = visual(patches, grid_thw=upload(grid_thw.numpy(), dev), **kwargs)
    lap(clock, "vision")
    deep = getattr(out, "deepstack_features", None)
    return out.pooler_output, None if deep is None else list(deep)


@torch.no_grad()
def encode_every_cell(model: PreTrainedModel, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                      ) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]] | None]:
    """The full encoding through `encode_packed` (every cell chosen: the stock encoding, tested), the shape of
    `get_image_features`' output: (per image [n_i, D], per deepstack layer a tuple of per-image tensors or None).
    What the compiled execution runs instead of the stock call, which reads the images' lengths on the host."""
    grid_host = grid_thw.cpu()
    counts = [int(t * h * w) // int(model.model.visual.spatial_merge_size) ** 2 for t, h, w in grid_host.tolist()]
    tokens, deep = encode_packed(model, pixel_values, grid_host, [np.arange(n) for n in counts])
    feats = tuple(torch.split(tokens, counts))
    return feats, None if deep is None else [tuple(torch.split(layer, counts)) for layer in deep]


def _packed_windows(cells: torch.Tensor, window_of: torch.Tensor, rank: torch.Tensor, unit: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Qwen2.5-VL's window attention on the packed cells: each keeps its FULL-grid window, and inside a
    window the full encoding's order. -> (window_index over packed cells, cu_window_seqlens in patches, the
    longest window in patches)."""
    order = torch.argsort(rank[cells])                  # packed cells in the full encoding's window order
    windows = window_of[cells][order]
    _, per_window = torch.unique_consecutive(windows, return_counts=True)
    cu = F.pad((per_window * unit).cumsum(0, dtype=torch.int32), (1, 0))
    return upload(order, device), upload(cu, device), int(per_window.max()) * unit


def packed_windows(visual: Any, grid_thw: torch.Tensor, cells: Sequence[torch.Tensor], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Qwen2.5-VL's windows for the chosen cells packed image after image, as `encode_packed` gives them to the
    tower: each cell keeps its FULL-grid window and, inside it, the full encoding's order. For another engine's
    tower (the vLLM plugin) with the same `spatial_merge_size`, `window_size` and `patch_size`.
    grid_thw [N, 3] (host); cells: per image ascending raster cells.
    -> (order [K]: packed cells in window order, cu_window_seqlens [W + 1] int32 in patches, the longest window in
        patches, window_rank [C]: each cell of the full grids (global over the images) at its place in window order)."""
    unit = int(visual.spatial_merge_size) ** 2
    window_of, rank = _window_assignment(visual, grid_thw)
    sizes = [int(h) * int(w) // unit for _, h, w in grid_thw.tolist()]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    packed = torch.cat([o + c.long().cpu() for o, c in zip(offsets, cells)])
    order, cu, longest = _packed_windows(packed, window_of, rank, unit, device)
    return order, cu, longest, rank


def encoder_output_class(model: PreTrainedModel) -> type:
    """The vision-encoder output type `forward(mm_encoder_outputs=...)` expects from this family."""
    import importlib

    from transformers.modeling_outputs import BaseModelOutputWithPooling

    module = importlib.import_module(type(model.model).__module__)
    return getattr(module, "BaseModelOutputWithDeepstackFeatures", BaseModelOutputWithPooling)


@torch.no_grad()
def gist_tokens(model: PreTrainedModel, processor: Any, images: Sequence[torch.Tensor],
                grids: Sequence[tuple[int, int]], encode: Callable | None = None
                ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
    """The vision tower on each image resized to grids[i] merged cells. images: [3, H, W] in [0, 1] (host).
    encode: the full encoding to use (`encode_every_cell` through the compiled tower), None: the stock call.
    -> (per image [h_g * w_g, D], per image one [h_g * w_g, D] per deepstack layer or None)."""
    from PIL import Image

    from .processing import image_processor_of

    ip = image_processor_of(processor)
    unit = int(ip.patch_size) * int(ip.merge_size)
    small = []
    for im, (hg, wg) in zip(images, grids):
        pixels = (im.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        small.append(Image.fromarray(pixels).resize((wg * unit, hg * unit), Image.BICUBIC))
    out = ip(images=small, return_tensors="pt")
    grid_thw = out["image_grid_thw"]
    merge = int(ip.merge_size)
    got = [(int(h) // merge, int(w) // merge) for _, h, w in grid_thw.tolist()]
    if got != [tuple(g) for g in grids]:
        raise RuntimeError(f"the image processor resized the gist to {got}, not {list(grids)}; check its min/max "
                           "pixels")
    if encode is not None:
        feats, deep = encode(out["pixel_values"].to(model.device), grid_thw)
    else:
        enc = model.model.get_image_features(out["pixel_values"].to(model.device), grid_thw.to(model.device),
                                             return_dict=True)
        feats, deep = enc.pooler_output, getattr(enc, "deepstack_features", None)
    tokens = list(feats)
    return tokens, ([[layer[i] for layer in deep] for i in range(len(tokens))] if deep is not None else None)

