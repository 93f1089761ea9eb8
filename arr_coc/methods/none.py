"""`none`: keep every visual token. The reference every other method is measured against.

The wrapper short-cuts this name (no selector runs), so its answers equal the stock model's.
"""

from __future__ import annotations

import torch

from ..pipeline.selection import Selection, SelectionContext, register_selector


@register_selector("none")
def select(ctx: SelectionContext) -> Selection:
    return Selection(kept=[torch.arange(h * w) for h, w in ctx.grid_hw])


__all__ = ["select"]
