"""Fixed shapes: a request's cells and prompt rounded up to a few sizes (buckets), so a compiled execution replays
one captured graph per bucket instead of compiling (or launching) anew for every request.

- **Cells** (per unit): a unit keeping K cells keeps the smallest bucket >= K instead (at most its n cells), filled
  with the next most relevant cells it did not choose: the selector's relevance map where it has one (ARR-COC),
  else cells spread evenly over the grid (`attending.grid_indices`). Never a dummy token: every cell read is a
  real cell at its own position, so filling can only add what the method would have kept at a larger budget. With
  encode="before" the tower encodes exactly the bucket's cells (plus any context the encoding asks for).
- **Prompt** (per batch): rows are left-padded to the smallest bucket >= the longest row, with padding the
  attention mask hides, as a batch's shorter rows already are.

The buckets are part of each trace (`Trace.bucket`). Sizes: steps of sqrt(2) from 4 cells and from 32 prompt
tokens, chosen on the shipped layer's decisions over the 2,000 test and 600 hold-out items (scripts/kept_cells.py's
dumps, before the tower at 3/5/8%, after at 5/10%): filling to sqrt(2) steps adds 14-18% tokens over what was chosen
with 5-13 shapes per setting, where powers of two from 16 (the first choice) added 26-126% (a 3% budget on a
256-cell image keeps 8 cells: 16 doubled it) and powers of two from 4 added 26-46% (docs/GPU.md, "Fast path").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .core.attending import grid_indices

def ladder(first: int, last: int) -> tuple[int, ...]:
    """Sizes from `first` to at least `last` in steps of sqrt(2), rounded: 4, 6, 8, 11, 16, 23, 32, 45, 64, ..."""
    sizes, i = [], 0
    while not sizes or sizes[-1] < last:
        size = int(round(first * 2 ** (i / 2)))
        if not sizes or size > sizes[-1]:
            sizes.append(size)
        i += 1
    return tuple(sizes)


CELL_BUCKETS = ladder(4, 16_384)                             # cells per unit: 4, 6, 8, 11, 16, 23, 32, ...
PROMPT_BUCKETS = ladder(32, 32_768)                          # tokens per row: 32, 45, 64, 91, 128, 181, ...
QUESTION_BUCKETS = tuple(16 * 2 ** i for i in range(8))      # 16 ... 2,048 question tokens (the layer's input)


@dataclass(frozen=True)
class Buckets:
    """The sizes a compiled execution rounds a request up to (module docstring)."""

    cells: tuple[int, ...] = CELL_BUCKETS
    prompt: tuple[int, ...] = PROMPT_BUCKETS
    question: tuple[int, ...] = QUESTION_BUCKETS

    def __post_init__(self) -> None:
        for name, sizes in (("cells", self.cells), ("prompt", self.prompt), ("question", self.question)):
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ValueError(f"Buckets.{name} must be increasing sizes of at least 1, got {sizes!r}")

    def cells_for(self, k: int, n: int) -> int:
        """The cells a unit keeping k of its n keeps: the smallest bucket >= k, at most n."""
        return min(n, next((b for b in self.cells if b >= k), n))

    def prompt_for(self, length: int) -> int:
        """The length rows of `length` tokens are padded to: the smallest bucket >= it (itself above the last)."""
        return next((b for b in self.prompt if b >= length), length)

    def question_for(self, length: int) -> int:
        """The length the layer's question tokens are padded to (masked): the smallest bucket >= it."""
        return next((b for b in self.question if b >= length), length)


def fill(kept: Sequence[torch.Tensor], grid_hw: Sequence[tuple[int, int]], buckets: Buckets,
         relevance: Sequence[np.ndarray | None]) -> list[torch.Tensor]:
    """Every unit's cells filled up to its bucket with the next most relevant cells (relevance[i]: float[h * w] in
    raster order, higher first, ties to the lower index; None: cells spread evenly). Ascending LongTensors."""
    out = []
    for chosen, (h, w), rel in zip(kept, grid_hw, relevance):
        chosen = chosen.cpu().numpy().astype(np.int64)
        target = buckets.cells_for(len(chosen), h * w)
        if target <= len(chosen):
            out.append(torch.from_numpy(np.sort(chosen)))
            continue
        taken = np.zeros(h * w, dtype=bool)
        taken[chosen] = True
        if rel is not None:
            order = np.lexsort((np.arange(h * w), -np.asarray(rel, dtype=np.float64)))   # relevance, then raster
        else:
            order = np.concatenate([grid_indices(h, w, target).numpy(), np.arange(h * w)])
        extra: list[int] = []
        for c in order:
            if len(extra) == target - len(chosen):
                break
            if not taken[c]:
                taken[c] = True
                extra.append(int(c))
        out.append(torch.from_numpy(np.sort(np.concatenate([chosen, np.asarray(extra, dtype=np.int64)]))))
    return out


def relevance_of(arr_out: Any, grid_hw: Sequence[tuple[int, int]]) -> list[np.ndarray | None]:
    """Per unit its relevance map (float[h * w], raster) from a selector's ARR-COC output, read once; Nones without."""
    rel = getattr(arr_out, "relevance", None)
    if rel is None:
        return [None] * len(grid_hw)
    maps = rel.detach().float().cpu().numpy()
    return [maps[i, :h, :w].reshape(-1) for i, (h, w) in enumerate(grid_hw)]


__all__ = ["Buckets", "CELL_BUCKETS", "PROMPT_BUCKETS", "QUESTION_BUCKETS", "fill", "ladder", "relevance_of"]
