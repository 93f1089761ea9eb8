"""The tower's tokens for a batch and which cell of which unit each one is (`VisualRows`).

After mode it holds every cell's token; before mode the encoded cells' (+ the gist's periphery tokens), and a
later look appends its own. The rewrite gathers what the language model reads from it in one index op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..core.grid import upload


@dataclass
class VisualRows:
    """The visual tokens the tower made for a batch, concatenated, and which cell each one is.

    source  [R, D] rows: the merger's output of every image (after), or of the encoded cells (+ the gist's
            periphery tokens) (before)
    side    the backend's side features, one [R, D] per layer with the same rows (Qwen3-VL's deepstack), kept
            and dropped with their tokens and never read here; None: it has none
    cells   per image, int64[E_i] ascending: the cells that have a token in `source`
    rows    per image, int64[E_i]: those tokens' rows in `source`
    """

    source: torch.Tensor
    side: list[torch.Tensor] | None
    cells: list[np.ndarray]
    rows: list[np.ndarray]
    n_tokens: list[int]

    @classmethod
    def every_cell(cls, feats: Sequence[torch.Tensor], side: Sequence[Sequence[torch.Tensor]] | None) -> VisualRows:
        """The after-mode encoding: per image [n_i, D] (every cell), per layer per image for the side features."""
        n = [int(f.shape[0]) for f in feats]
        start = np.cumsum([0] + n[:-1])
        return cls(torch.cat(list(feats)), None if side is None else [torch.cat(list(layer)) for layer in side],
                   [np.arange(k) for k in n], [np.arange(k) + s for k, s in zip(n, start)], n)

    def rows_of(self, kept: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per image, the source row of each kept cell (each must have a token)."""
        out = []
        for cells, rows, k in zip(self.cells, self.rows, kept):
            at = np.searchsorted(cells, k)
            if len(k) and (at.max() >= len(cells) or not np.array_equal(cells[at], k)):
                raise ValueError("a kept cell has no encoded token; the tower encodes every kept cell")
            out.append(rows[at])
        return out

    def gather(self, kept: Sequence[np.ndarray]) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]] | None]:
        """(per image [K_i, D], side features per layer per image) of the kept cells: one index op per tensor."""
        counts = [len(k) for k in kept]
        index = upload(np.concatenate(self.rows_of(kept)).astype(np.int64), self.source.device)
        feats = tuple(self.source.index_select(0, index).split(counts))
        side = None if self.side is None else [tuple(d.index_select(0, index).split(counts)) for d in self.side]
        return feats, side

    def full(self, source: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Per image [n_i, D]: every cell with a token in place, zeros elsewhere (made on demand)."""
        source = self.source if source is None else source
        out = []
        for cells, rows, n in zip(self.cells, self.rows, self.n_tokens):
            full = source.new_zeros(n, source.shape[-1])
            full[torch.as_tensor(cells, device=source.device)] = source[torch.as_tensor(rows, device=source.device)]
            out.append(full)
        return tuple(out)

    def extended(self, tokens: torch.Tensor, side: list[torch.Tensor] | None,
                 new: dict[int, np.ndarray]) -> VisualRows:
        """These rows with `tokens` appended: rows for the cells of `new` (unit -> cells, unit after unit in
        `new`'s order); each unit's cells stay ascending."""
        cells, rows = list(self.cells), list(self.rows)
        start = self.source.shape[0]
        for i, c in new.items():
            merged = np.concatenate([cells[i], c])
            order = np.argsort(merged, kind="stable")
            cells[i] = merged[order]
            rows[i] = np.concatenate([rows[i], start + np.arange(len(c))])[order]
            start += len(c)
        source = torch.cat([self.source, tokens.to(self.source.dtype)])
        side_source = None if self.side is None else [torch.cat([a, b.to(a.dtype)]) for a, b in zip(self.side, side)]
        return VisualRows(source, side_source, cells, rows, self.n_tokens)


__all__ = ["VisualRows"]
