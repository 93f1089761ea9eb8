"""What a run cost in FLOPs, per item: the whole prefill (vision tower, selector, language model), counted off the
clock with the evaluation's counter. One owner for `eval` (images and clips), `bench` and the microscope.

    vision    the tower as the run spent it: every patch of every unit ("after"), or the gist plus the tower on
              the encoded cells ("before"; with more than one look, every look's tower pass on the cells it
              encoded). Counted by running the same tower calls again under `flop_counter` (the attention kernel
              included: tests/test_encoding.py checks the count against 2 * 2 * n^2 * d per layer). A tower's
              cost depends on the grid and the number of encoded cells only, so counts are memoised by those, unless
              `EncodesBefore.cost_by_count` says otherwise (a windowed tower: its window layers cost by which
              cells, so it is counted every time).
    selector  the run's selector once more under the counter, on the context(s) it saw (`CountedSelector`),
              shared evenly by the batch's items; 0 for every token; None (unknown) when it cannot be counted
    lm        the language model's prefill of each look's prompt for the item alone (no padding, logits of the
              last position only, as `generate` does); memoised by length
    adapter   when an adapter ran for the item (`Trace.adapter`): its LoRA FLOPs, 2 r (d_in + d_out) per token per
              adapted linear (`VLMBackend.adapter_flops`), for the tower's patches of the cells it encoded with the
              adapter on (encode="before"; the gist and an "after" tower run stock) and for every token of each look's
              prompt. Counted exactly, not run (tests/test_adapter.py checks it against the counter with the adapter
              on); added to `vision` and `lm` and reported on its own as `adapter`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..pipeline.backend import EncodesBefore, has
from .flops import count_flops

if TYPE_CHECKING:
    from ..pipeline.answer import Answered
    from ..pipeline.backend import VLMBackend
    from ..pipeline.prompt import Prompt
    from ..pipeline.trace import Trace


@dataclass
class Flops:
    """FLOPs of one item's prefill."""

    vision: int                  # gist + tower, as the run encoded (the adapter's share included)
    selector: int | None         # None: could not be counted (unknown, never 0)
    lm: int                      # language-model prefill (every look's; the adapter's share included)
    adapter: int = 0             # of vision + lm: the adapter's LoRA FLOPs (0: none ran)

    @property
    def whole(self) -> int | None:
        return None if self.selector is None else self.vision + self.selector + self.lm

    def to_dict(self) -> dict[str, int | None]:
        return {"vision": self.vision, "selector": self.selector, "lm_prefill": self.lm, "adapter": self.adapter,
                "whole_prefill": self.whole}


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
    by_count = has(backend, EncodesBefore) and backend.cost_by_count()   # else the cost depends on which cells
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
                key = ("before", grid, int(cells.numel())) if by_count else None
                total += _memo(memo, key, lambda: count_flops(backend.encode_cells, prompt, [i],
                                                              [cells.numpy()])[1])
            if tr.gist_grid:
                total += _memo(memo, ("gist", grid, tuple(tr.gist_grid[j])), lambda: count_flops(
                    backend.encode_gist, prompt, [i], [tuple(tr.gist_grid[j])])[1])
        out.append(total)
        first += len(tr.total_per_image)
    return out


def lm_flops(backend: VLMBackend, pruned: Any, row: int, memo: dict[Any, int]) -> int:
    """The stock LM prefill of one row of a pruned prompt alone (no padding, last-position logits; an adapter's
    share is `adapter_flops`)."""
    length = pruned.lengths[row]
    if length not in memo:
        alone = pruned.rows([row])
        alone.adapted = None              # the stock count; the adapter's is exact arithmetic (`adapter_flops`)
        memo[length] = count_flops(backend.prefill, alone, logits_to_keep=1)[1]
    return memo[length]


def adapter_flops(backend: VLMBackend, done: Answered, b: int) -> tuple[int, int]:
    """Row b's adapter FLOPs: (tower, language model); (0, 0) when no adapter ran for it."""
    tr = done.traces[b]
    if not tr.adapter:
        return 0, 0
    cells = 0
    if tr.encode == "before":          # the cells the tower encoded at full resolution, on every look
        looks = [look.encoded for look in tr.looks] if tr.looks else [tr.encoded_cells]
        cells = sum(int(c.numel()) for encoded in looks for c in encoded)
    tokens = sum(p.pruned.lengths[p.rows.index(b)] for p in done.passes
                 if b in p.rows and p.pruned.adapted and p.pruned.adapted[p.rows.index(b)])
    return backend.adapter_flops(cells, 0), backend.adapter_flops(0, tokens)


def item_flops(backend: VLMBackend, done: Answered, selector_flops: int | None, gist_share: float,
               memo: dict[Any, int]) -> list[Flops]:
    """Per row of an answered batch: what its whole prefill cost (module docstring)."""
    traces = done.traces
    vision = vision_flops(backend, done.first.batch, traces, gist_share, memo)
    per_item = None if selector_flops is None else selector_flops / len(traces)
    out = []
    for b in range(len(traces)):
        lm = sum(lm_flops(backend, p.pruned, p.rows.index(b), memo) for p in done.passes if b in p.rows)
        tower, text = adapter_flops(backend, done, b)
        out.append(Flops(vision=int(vision[b]) + tower, selector=per_item, lm=int(lm) + text, adapter=tower + text))
    return out


__all__ = ["Flops", "adapter_flops", "item_flops", "lm_flops", "vision_flops"]
