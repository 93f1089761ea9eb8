"""The object group's components as they were before the pixel-list rewrite (issue 64): every pixel of the batch,
labels on a [B, N] grid. The reference `tests/test_exact_speed.py` holds `arr_coc.core.components` against."""

from __future__ import annotations

import torch

from arr_coc.core.components import CAP, MIN_AREA, STEPS, _descriptions, _run_ids, _spread


def label_components(mask: torch.Tensor, steps: int | None = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, w = mask.shape
    n = h * w
    big = b * n
    inside = mask.reshape(-1)
    index = torch.arange(b * n)
    label = torch.where(inside, index, big)
    rows, cols = _run_ids(mask, 2), _run_ids(mask, 1)
    changed = torch.ones(b, dtype=torch.bool)
    step = 0
    while steps is None or step < steps:
        new = _spread(_spread(label, rows, big), cols, big)
        new = torch.where(inside, torch.minimum(new, new.index_select(0, new.clamp(max=big - 1))), big)
        step += 1
        if steps is None or step == steps:
            changed = (new != label).reshape(b, n).any(1)
        label = new
        if steps is None and not bool(changed.any()):
            break
    local = torch.where(inside, label - index.div(n, rounding_mode="floor") * n, -1)
    return local.reshape(b, n), ~changed


def object_channels(mask: torch.Tensor, grid_hw: tuple[int, int], steps: int | None = STEPS,
                    cap: int | None = CAP) -> tuple[torch.Tensor, torch.Tensor]:
    b, hh, ww = mask.shape
    h, w = grid_hw
    n = hh * ww
    label, converged = label_components(mask, steps)
    inside = label >= 0
    index = torch.arange(n)
    root = label.clamp_min(0) + torch.arange(b)[:, None] * n
    area = torch.zeros(b * n).index_add_(0, root.reshape(-1), inside.reshape(-1).float())
    kept = (label == index) & (area.reshape(b, n) >= MIN_AREA)
    many = kept.sum(1)
    if cap is None:
        cap = max(1, int(many.max()))
    rank = kept.long().cumsum(1) - 1
    slots = b * cap
    number = torch.where(kept & (rank < cap), rank + torch.arange(b)[:, None] * cap, slots)
    comp = torch.where(inside, number.reshape(-1).index_select(0, root.reshape(-1)).reshape(b, n), slots)
    comp = comp.reshape(-1)
    ys, xs = index.div(ww, rounding_mode="floor"), index.remainder(ww)
    ys, xs = ys.repeat(b), xs.repeat(b)
    described = _descriptions(comp, ys, xs, slots + 1, n, hh / h)
    cell = (index.div(ww * (hh // h), rounding_mode="floor") * w
            + index.remainder(ww).div(ww // w, rounding_mode="floor"))
    cell = cell + torch.arange(b)[:, None] * (h * w)
    local = comp.reshape(b, n) - torch.arange(b)[:, None] * cap
    local = torch.where(comp.reshape(b, n) < slots, local, cap)
    table = torch.zeros(b * h * w * (cap + 1)).index_add_(
        0, (cell * (cap + 1) + local).reshape(-1), torch.ones(b * n))
    table = table.reshape(b, h * w, cap + 1)[:, :, :cap]
    total = table @ described[:-1].reshape(b, cap, -1)
    out = total / table.sum(-1, keepdim=True).clamp_min(1.0)
    ok = converged & (many <= cap)
    return out.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous(), ok
