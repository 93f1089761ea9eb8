"""What the vision tower costs per item, in each encoding mode, counted with the evaluation's FLOP counter.

"after": the tower on every patch of the item's image(s). "before": the gist (the tower on the
downscaled copy) plus the tower on the encoded cells: the chosen ones and their context (the
margin and, with whole windows, the rest of each Qwen2.5-VL window; `Trace.encoded_cells` holds
them all); with passes > 1, every look's tower pass on the cells it encoded (`Trace.looks`). Counted off the clock by running the same calls again under `flop_counter` (the
tower's attention kernel included: tests/test_encoding.py checks the count against
2 * 2 * n^2 * d per layer). Costs depend on the grid and the number of encoded cells only
(Qwen2.5-VL aside: its window layers cost by which cells, so it is counted every time), so they
are memoised by those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .flops import count_flops

if TYPE_CHECKING:
    from ..qwen import ARRCOCQwen, Trace


def _image_rows(grid_thw: torch.Tensor) -> list[slice]:
    out, start = [], 0
    for t, h, w in grid_thw.tolist():
        n = int(t) * int(h) * int(w)
        out.append(slice(start, start + n))
        start += n
    return out


def _memo(memo: dict[tuple, int], key: tuple | None, count) -> int:
    if key is None:
        return count()
    if key not in memo:
        memo[key] = count()
    return memo[key]


@torch.no_grad()
def vision_flops(wrapper: ARRCOCQwen, inputs: dict[str, torch.Tensor], traces: Sequence[Trace],
                 gist_share: float, memo: dict[tuple, int]) -> list[int]:
    """Per item of the batch `inputs` was built for: vision FLOPs (gist + tower) as this run spent them."""
    from ..qwen.encoding import encode_cells
    from ..qwen.foveation import encode_gist
    from ..qwen.processing import image_processor_of, unpatchify_images

    model = wrapper.model
    pv, grid_thw = inputs["pixel_values"].to(wrapper.device), inputs["image_grid_thw"].to(wrapper.device)
    rows = _image_rows(grid_thw)
    windowed = model.config.model_type == "qwen2_5_vl"     # window attention: the cost depends on which cells
    out, first = [], 0
    for tr in traces:
        total = 0
        for j in range(len(tr.total_per_image)):
            i = first + j
            pixels, g = pv[rows[i]], grid_thw[i:i + 1]
            grid = tuple(g[0].tolist())
            if tr.encode == "after":
                total += _memo(memo, ("after", grid), lambda: count_flops(model.model.get_image_features, pixels, g)[1])
                continue
            looks = [look.encoded[j] for look in tr.looks] if tr.looks else [tr.encoded_cells[j]]
            for cells in (c for c in looks if c.numel()):      # every look's tower pass (passes > 1), each its own
                key = None if windowed else ("before", grid, int(cells.numel()))
                total += _memo(memo, key, lambda: count_flops(encode_cells, model, pixels, g, [cells])[1])
            if tr.gist_grid:
                total += _memo(memo, ("gist", grid, tuple(tr.gist_grid[j])), lambda: count_flops(
                    encode_gist, model, wrapper.processor,
                    unpatchify_images(pixels, g, image_processor_of(wrapper.processor)), [tr.grid_hw[j]],
                    gist_share)[1])
        out.append(total)
        first += len(tr.total_per_image)
    return out
