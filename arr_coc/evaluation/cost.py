"""What a run cost in FLOPs, per item: the whole prefill (vision tower, selector, language model), counted off the
clock with the evaluation's counter. One owner for `eval` (images and clips), `bench` and the microscope.

    vision    the tower as the run spent it: every patch of every unit ("after"), or the gist plus the tower on
              the encoded cells ("before"; with more than one look, every look's tower pass on the cells it
              encoded). Counted by running the same tower calls again under `flop_counter` (the attention kernel
              included: tests/test_encoding.py checks the count against 2 * 2 * n^2 * d per layer). A tower's
              cost depends on the grid and the number of encoded cells only (a windowed tower aside: its window
              layers cost by which cells, so it is counted every time), so counts are memoised by those.
    selector  the run's selector once more under the counter, on the context(s) it saw (`CountedSelector`),
              shared evenly by the batch's items; 0 for every token; None (unknown) when it cannot be counted
    lm        the language model's prefill of each look's prompt for the item alone (no padding, logits of the
              last position only, as `generate` does); memoised by length
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .flops import count_flops

if TYPE_CHECKING:
    from ..pipeline.answer import Answered
    from ..pipeline.backend import VLMBackend
    from ..pipeline.prompt import Prompt
    from ..pipeline.trace import Trace


@dataclass
class Flops:
    """FLOPs of one item's prefill."""

    vision: int                  # gist + tower, as the run encoded
    selector: int | None         # None: could not be counted (unknown, never 0)
    lm: int                      # language-model prefill (every look's)

    @property
    def whole(self) -> int | None:
        return None if self.selector is None else self.vision + self.selector + self.lm

    def to_dict(self) -> dict[str, int | None]:
        return {"vision": self.vision, "selector": self.selector, "lm_prefill": self.lm, "whole_prefill": self.whole}


def _memo(memo: dict[Any, int], key: tuple | None, count) -> int:
    if key is None:
        return count()
    if key not in memo:
        memo[key] = count()
    return memo[key]


@torch.no_grad()
def vision_flops(backend: VLMBackend, prompt: Prompt, traces: Sequence[Trace], gist_share: float,
                 memo: dict[Any, int]) -> list[int]:
    """Per item (trace) of `prompt`: vision FLOPs (gist + tower) as the run spent them."""
    windowed = bool(getattr(getattr(backend, "info", None), "windows", False))   # the cost depends on which cells
    out, first = [], 0
    for tr in traces:
        total = 0
        for j in range(len(tr.total_per_image)):
            i, grid = first + j, tuple(prompt.grid_hw[first + j])
            if tr.encode == "after":
                total += _memo(memo, ("after", grid), lambda: count_flops(backend.encode_units, prompt, [i])[1])
                continue
            looks = [look.encoded[j] for look in tr.looks] if tr.looks else [tr.encoded_cells[j]]
            for cells in (c for c in looks if c.numel()):      # every look's tower pass (passes > 1), each its own
                key = None if windowed else ("before", grid, int(cells.numel()))
                total += _memo(memo, key, lambda: count_flops(backend.encode_cells, prompt, [i],
                                                              [cells.numpy()])[1])
            if tr.gist_grid:
                total += _memo(memo, ("gist", grid, tuple(tr.gist_grid[j])), lambda: count_flops(
                    backend.encode_gist, prompt, [i], [tuple(tr.gist_grid[j])])[1])
        out.append(total)
        first += len(tr.total_per_image)
    return out


def lm_flops(backend: VLMBackend, pruned: Any, row: int, memo: dict[Any, int]) -> int:
    """The LM prefill of one row of a pruned prompt alone (no padding, last-position logits)."""
    length = pruned.lengths[row]
    if length not in memo:
        memo[length] = count_flops(backend.prefill, pruned.rows([row]), logits_to_keep=1)[1]
    return memo[length]


def item_flops(backend: VLMBackend, done: Answered, selector_flops: int | None, gist_share: float,
               memo: dict[Any, int]) -> list[Flops]:
    """Per row of an answered batch: what its whole prefill cost (module docstring)."""
    traces = done.traces
    vision = vision_flops(backend, done.first.batch, traces, gist_share, memo)
    per_item = None if selector_flops is None else selector_flops / len(traces)
    out = []
    for b in range(len(traces)):
        lm = sum(lm_flops(backend, p.pruned, p.rows.index(b), memo) for p in done.passes if b in p.rows)
        out.append(Flops(vision=int(vision[b]), selector=per_item, lm=int(lm)))
    return out


__all__ = ["Flops", "item_flops", "lm_flops", "vision_flops"]
