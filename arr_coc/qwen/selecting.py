"""Running a selector inside the wrapper: batch first, item by item if it fails, keep-all last.

The wrapper calls `run_selector`; a selector that raises on the batch is retried per item, and
an item that still fails keeps all its tokens with the error recorded, so one bad image never
costs the others their pruning (the library's contract; the evaluation's strict mode refuses
such rows instead).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..budget import BudgetError
from ..selection import Selection, SelectionContext, Selector
from .rewrite import replacement

logger = logging.getLogger(__name__)


class SelectorFailed(RuntimeError):
    """A selector raised and the caller asked for no fallback (strict=True)."""

    def __init__(self, name: str, cause: BaseException):
        super().__init__(f"selector {name!r} failed: {type(cause).__name__}: {cause}")
        self.name, self.cause = name, cause


def as_selection(result: Any, n: int) -> Selection:
    sel = result if isinstance(result, Selection) else Selection(kept=list(result))
    if len(sel.kept) != n:
        raise ValueError(f"selector returned kept indices for {len(sel.kept)} images, expected {n}")
    return sel


class PerImageOutputs:
    """Selector outputs that came back in pieces (per-item retry): slices by image."""

    def __init__(self, n: int, outs: list[tuple[list[int], Any]]):
        self.n = n
        self.where = {}
        for which, out in outs:
            for j, i in enumerate(which):
                self.where[i] = (out, j)

    def slice(self, imgs: list[int]) -> Any:
        pieces = [self.where.get(i) for i in imgs]
        if any(p is None or p[0] is None for p in pieces):
            return None
        out = pieces[0][0]
        if all(p[0] is out for p in pieces):
            return slice_output(out, [p[1] for p in pieces])
        return None


def slice_output(out: Any, imgs: list[int]) -> Any:
    """The selector output restricted to images `imgs` (lists and batch-first tensors are sliced)."""
    if isinstance(out, PerImageOutputs):
        return out.slice(imgs)
    if not dataclasses.is_dataclass(out):
        return out
    per_image = getattr(out, "kept_indices", None)
    if not isinstance(per_image, (list, tuple)):
        return out
    n = len(per_image)
    idx = torch.tensor(imgs, dtype=torch.long)
    changes = {}
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        if f.name == "channel_names":  # per channel, not per image
            continue
        if isinstance(v, list) and len(v) == n:
            changes[f.name] = [v[i] for i in imgs]
        elif isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            changes[f.name] = v[idx.to(v.device)]
    return dataclasses.replace(out, **changes)


@dataclass
class Choice:
    """What a selector chose for N images (host): kept cells, its ARR-COC output (or None), fallbacks, errors and
    replacement tokens (`Selection.visual_tokens`), per image."""

    kept: list[torch.Tensor]
    arr_out: Any
    fallback: list[str | None]
    errors: list[str | None]
    replaced: list[torch.Tensor | None]

    @classmethod
    def of(cls, kept: list[torch.Tensor], n: int) -> Choice:
        """Cells chosen without a selector (given, or every cell)."""
        return cls(kept, None, [None] * n, [None] * n, [None] * n)

    def keep_all(self, i: int, n_tokens: int, why: str) -> None:
        self.kept[i], self.fallback[i], self.errors[i] = torch.arange(n_tokens), "keep_all", why

    def replacing(self, feats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The merger's tokens per image with the selector's replacements in (an image that fell back keeps its own)."""
        return [f if r is None or fb == "keep_all" else replacement(r, f, i)
                for i, (f, r, fb) in enumerate(zip(feats, self.replaced, self.fallback))]


def run_selector(fn: Selector, ctx: SelectionContext, name: str, strict: bool = False) -> Choice:
    """Run the selector on the batch; if it raises, per item; an item that still fails keeps all.

    A `BudgetError` (the caller asked for something impossible) always propagates, and so does
    every error with strict=True (the evaluation: a row must not silently run another method)."""
    N = len(ctx)
    kept: list[torch.Tensor | None] = [None] * N
    fallback: list[str | None] = [None] * N
    errors: list[str | None] = [None] * N
    replaced: list[torch.Tensor | None] = [None] * N
    try:
        sel = as_selection(fn(ctx), N)
        groups = [(list(range(N)), sel)]
    except BudgetError:
        raise
    except Exception as exc:  # noqa: BLE001 - isolate the failure to the items that cause it
        if strict:
            raise SelectorFailed(name, exc) from exc
        logger.warning("selector %r failed on the batch (%s); retrying item by item", name, exc)
        groups = []
        for b in sorted(set(ctx.item_of_image)):
            which = [i for i, r in enumerate(ctx.item_of_image) if r == b]
            try:
                groups.append((which, as_selection(fn(ctx.subset(which)), len(which))))
            except Exception as item_exc:  # noqa: BLE001
                logger.warning("selector %r failed for item %d (%s); it keeps all tokens", name, b, item_exc)
                for i in which:
                    fallback[i] = "keep_all"
                    errors[i] = f"{type(item_exc).__name__}: {item_exc}"
    outs = []
    for which, sel in groups:
        for j, i in enumerate(which):
            kept[i] = sel.kept[j]
            if sel.fallback is not None:
                fallback[i] = sel.fallback[j]
            if sel.errors is not None:
                errors[i] = sel.errors[j]
            if sel.visual_tokens is not None:
                replaced[i] = sel.visual_tokens[j]
        outs.append((which, sel.arr_coc))
    arr_out = None
    if len(outs) == 1 and outs[0][1] is not None and len(outs[0][0]) == N:
        arr_out = outs[0][1]
    elif any(o is not None for _, o in outs):
        arr_out = PerImageOutputs(N, outs)
    return Choice(kept, arr_out, fallback, errors, replaced)
