"""encode="before": a gist of the whole picture for the selector, then full resolution where it chose.

1. gist: the VLM's own vision tower on a downscaled copy of each unit (`EncodeConfig.gist` of the tokens: side
   factor sqrt(gist)); each full-grid cell reads the gist token under its centre, so the selector sees one
   coarse token per full-resolution cell;
2. the selector chooses full-resolution cells exactly as in "after" mode (budgets, modes, fallbacks);
3. the backend encodes the chosen cells (+ context dropped before the language model: `margin` rings, and
   with `windows` the rest of each attention window they are in) at their true positions;
4. periphery (optional): every gist cell whose footprint holds no chosen cell is passed to the language
   model as its gist token, at the full-grid cell under its centre. That position keeps the language model's
   2-D layout: a coarse token stands where the middle of its region stands, and never on a cell that is also
   encoded at full resolution.

The result is the tower's tokens and which cell each is (`VisualRows`), as the after-mode encoding is, so one
rewrite builds the prompt in both modes. The cell bookkeeping is host work on the kept indices; the tower
runs once on the batch's chosen patches.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..encode import EncodeConfig
from ..stopwatch import Stopwatch, lap
from .backend import EncodesBefore, adapted as adapted_on, by_flag
from .prompt import Prompt
from .tokens import VisualRows

logger = logging.getLogger(__name__)


@dataclass
class Gist:
    """The coarse view of each unit: its own grid and its tokens mapped onto the full grid."""

    grid_hw: list[tuple[int, int]]                  # (h_g, w_g) per unit
    tokens: list[torch.Tensor]                      # per unit [h_g * w_g, D]
    on_full_grid: list[torch.Tensor]                # per unit [n_i, D]: the gist token under each cell
    side: list[list[torch.Tensor]] | None           # per unit, per side-feature layer [h_g * w_g, D]


def gist_grid(grid_hw: tuple[int, int], share: float) -> tuple[int, int]:
    """The gist's merged grid: each side scaled by sqrt(share), at least 2 cells (the processors' minimum)."""
    f = math.sqrt(share)
    return max(2, round(grid_hw[0] * f)), max(2, round(grid_hw[1] * f))


def nearest_cells(full_hw: tuple[int, int], coarse_hw: tuple[int, int]) -> torch.Tensor:
    """LongTensor[h * w]: the coarse cell under each full cell's centre."""
    (h, w), (hg, wg) = full_hw, coarse_hw
    rows = ((torch.arange(h) + 0.5) * hg / h).floor().long().clamp_max(hg - 1)
    cols = ((torch.arange(w) + 0.5) * wg / w).floor().long().clamp_max(wg - 1)
    return (rows[:, None] * wg + cols[None, :]).reshape(-1)


def coarse_centres(full_hw: tuple[int, int], coarse_hw: tuple[int, int]) -> torch.Tensor:
    """LongTensor[h_g * w_g]: the full cell under each coarse cell's centre (inside that coarse cell's footprint)."""
    (h, w), (hg, wg) = full_hw, coarse_hw
    rows = ((torch.arange(hg) + 0.5) * h / hg).floor().long().clamp_max(h - 1)
    cols = ((torch.arange(wg) + 0.5) * w / wg).floor().long().clamp_max(w - 1)
    return (rows[:, None] * w + cols[None, :]).reshape(-1)


@torch.no_grad()
def encode_gist(backend: EncodesBefore, prompt: Prompt, share: float, units: Sequence[int] | None = None) -> Gist:
    """The tower on each unit downscaled to `share` of its tokens (all units, or `units`)."""
    units = list(range(len(prompt.grid_hw))) if units is None else list(units)
    full = [prompt.grid_hw[i] for i in units]
    grids = [gist_grid(g, share) for g in full]
    tokens, side = backend.encode_gist(prompt, units, grids)
    mapped = [t[nearest_cells(f, g).to(t.device)] for t, f, g in zip(tokens, full, grids)]
    return Gist(grid_hw=grids, tokens=list(tokens), on_full_grid=mapped, side=side)


def gist_or_zeros(backend: EncodesBefore, prompt: Prompt, share: float, strict: bool) -> tuple[Gist, dict[int, str]]:
    """The gist of every unit; if it fails on the batch, unit by unit, and a unit whose gist still fails gets
    zeros (it will keep every token): -> (gist, {unit: why})."""
    try:
        return encode_gist(backend, prompt, share), {}
    except Exception as exc:  # noqa: BLE001 - isolate the failure to the units that cause it
        if strict:
            raise
        logger.warning("the gist failed on the batch (%s); retrying unit by unit", exc)
    parts: list[Gist | None] = []
    failed: dict[int, str] = {}
    for i in range(len(prompt.grid_hw)):
        try:
            parts.append(encode_gist(backend, prompt, share, [i]))
        except Exception as exc:  # noqa: BLE001
            parts.append(None)
            failed[i] = f"{type(exc).__name__}: {exc}"
    return merge_gists(parts, prompt.grid_hw, backend.text_hidden_size), failed


def merge_gists(parts: Sequence[Gist | None], grid_hw: Sequence[tuple[int, int]], width: int) -> Gist:
    """One Gist from per-unit ones; a missing unit (its gist failed) gets a 2 x 2 gist of zeros."""
    grids, tokens, mapped, side = [], [], [], []
    template = next((p for p in parts if p is not None), None)
    n_layers = len(template.side[0]) if template is not None and template.side else 0
    like = template.tokens[0] if template is not None else torch.zeros(0)   # the VLM's dtype and device
    for p, g in zip(parts, grid_hw):
        if p is None:
            zeros = like.new_zeros(4, width)
            grids.append((2, 2))
            tokens.append(zeros)
            mapped.append(zeros[nearest_cells(g, (2, 2))])
            side.append([zeros] * n_layers)
        else:
            grids.append(p.grid_hw[0])
            tokens.append(p.tokens[0])
            mapped.append(p.on_full_grid[0])
            side.append(p.side[0] if p.side else [])
    return Gist(grid_hw=grids, tokens=tokens, on_full_grid=mapped, side=side if n_layers else None)


@dataclass
class Foveated:
    """The full-resolution encoding of the chosen cells (+ the periphery's gist tokens), as `VisualRows`."""

    visual: VisualRows
    lm_cells: list[torch.Tensor]                    # per unit, what the language model reads (ascending)
    encoded: list[torch.Tensor]                     # per unit, cells encoded at full resolution (chosen + context)
    periphery: list[torch.Tensor]                   # per unit, cells carrying a gist token


def encode_split(backend: EncodesBefore, prompt: Prompt, units: Sequence[int], cells: Sequence[np.ndarray],
                 adapted: Sequence[bool] | None, clock: Stopwatch | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """`backend.encode_cells`, the adapter on for the units `adapted` marks (indexed by unit; None: off): one tower
    pass when they agree (always, without an adapter), else one per setting (`by_flag`), the tokens put back in
    unit order."""
    groups = by_flag([bool(adapted[i]) if adapted is not None else False for i in units])
    if len(groups) == 1:
        with adapted_on(backend, groups[0][1]):
            return backend.encode_cells(prompt, units, cells, clock)
    pieces: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for mine, on in groups:
        with adapted_on(backend, on):
            tokens, side = backend.encode_cells(prompt, [units[j] for j in mine], [cells[j] for j in mine], clock)
        sizes = [len(cells[j]) for j in mine]
        per_layer = [d.split(sizes) for d in side] if side is not None else []
        for n, (j, t) in enumerate(zip(mine, tokens.split(sizes))):
            pieces[j] = (t, [layer[n] for layer in per_layer])
    tokens = torch.cat([pieces[j][0] for j in range(len(units))])
    n_side = len(pieces[0][1])
    side = [torch.cat([pieces[j][1][k] for j in range(len(units))]) for k in range(n_side)] if n_side else None
    return tokens, side


def foveate(backend: EncodesBefore, prompt: Prompt, chosen: Sequence[torch.Tensor], config: EncodeConfig,
            gist: Gist | None, clock: Stopwatch | None = None, adapted: Sequence[bool] | None = None) -> Foveated:
    """Encode the chosen cells (+ margin, + whole windows) in one tower pass and, with `config.periphery`,
    add the gist's uncovered regions. chosen on the host. adapted: per unit, whether the adapter runs on its cells
    (`encode_split`; None: never). Grad mode is the caller's: the pipeline runs under no_grad, train-adapter
    with grad."""
    units = list(range(len(prompt.grid_hw)))
    encoded = backend.context_cells(prompt, units, chosen, config)
    lap(clock, "packing")
    tokens, side = encode_split(backend, prompt, units, [e.numpy() for e in encoded], adapted, clock)
    sources, side_sources = [tokens], None if side is None else [[layer] for layer in side]
    n_rows = tokens.shape[0]
    cells, rows, lm_cells, periphery = [], [], [], []
    start = 0
    for i, (c, g) in enumerate(zip(chosen, prompt.grid_hw)):
        mine = {int(cell): start + j for j, cell in enumerate(encoded[i].tolist())}
        start += len(encoded[i])
        extra = torch.from_numpy(np.empty(0, dtype=np.int64))
        if config.periphery and gist is not None:
            extra, regions = periphery_cells(c, g, gist.grid_hw[i])
            sources.append(gist.tokens[i])                         # a periphery cell reads its gist token
            if side_sources is not None:
                for layer, per_layer in zip(side_sources, gist.side[i]):
                    layer.append(per_layer)
            mine.update({int(cell): n_rows + int(r) for cell, r in zip(extra.tolist(), regions.tolist())})
            n_rows += gist.tokens[i].shape[0]
        order = sorted(mine)
        cells.append(np.array(order, dtype=np.int64))
        rows.append(np.array([mine[k] for k in order], dtype=np.int64))
        periphery.append(torch.from_numpy(np.sort(extra.numpy())))
        lm_cells.append(torch.from_numpy(np.union1d(c.cpu().numpy(), extra.numpy()).astype(np.int64)))
    source = sources[0] if len(sources) == 1 else torch.cat([s.to(tokens.dtype) for s in sources])
    deep_source = None if side_sources is None else \
        [layer[0] if len(layer) == 1 else torch.cat([s.to(layer[0].dtype) for s in layer]) for layer in side_sources]
    visual = VisualRows(source, deep_source, cells, rows, [h * w for h, w in prompt.grid_hw])
    return Foveated(visual=visual, lm_cells=lm_cells, encoded=encoded, periphery=periphery)


def periphery_cells(chosen: torch.Tensor, grid_hw: tuple[int, int], gist_hw: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gist regions holding no chosen cell: (the full cell each one's token stands at, the regions)."""
    covered = torch.zeros(gist_hw[0] * gist_hw[1], dtype=torch.bool)
    covered[nearest_cells(grid_hw, gist_hw)[chosen]] = True
    regions = (~covered).nonzero().squeeze(1)
    return coarse_centres(grid_hw, gist_hw)[regions], regions


def reads(kept: np.ndarray, periphery: np.ndarray, grid_hw: tuple[int, int],
          gist_hw: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """What the LM reads of a unit after a later look: the kept cells + the periphery tokens whose gist region
    holds no kept cell. -> (read cells ascending, the periphery cells still read)."""
    if gist_hw is None or len(periphery) == 0:
        return kept, periphery
    under = nearest_cells(grid_hw, gist_hw).numpy()
    still = periphery[~np.isin(under[periphery], under[kept])]
    return np.union1d(kept, still).astype(np.int64), still


__all__ = ["Foveated", "Gist", "coarse_centres", "encode_gist", "encode_split", "foveate", "gist_grid", "gist_or_zeros",
           "merge_gists", "nearest_cells", "periphery_cells", "reads"]
