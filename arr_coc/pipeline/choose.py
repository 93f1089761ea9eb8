"""Choosing: the selection context of a prompt, and running a selector on it (batch first, item by item if it
fails, keep-all last).

`context` builds what a selector reads (`SelectionContext`) from the prompt through the backend: the units'
pictures, the question embeddings (one embedding call for the batch), the per-unit budgets and counts.
`run_selector` runs it; a selector that raises on the batch is retried per item, and an item that still
fails keeps all its tokens with the error recorded, so one bad image never costs the others their pruning
(the library's contract; the evaluation's strict mode refuses such rows instead).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from ..budget import Budget, BudgetError, BudgetMode, count_of
from ..core.grid import upload
from ..stopwatch import lap
from ..core.temporal import minimum_count
from .backend import MissingCapability, VLMBackend
from .prompt import Prompt
from .selection import Selection, SelectionContext, Selector, method_info, reads_tower_attention

if TYPE_CHECKING:
    from .context import RequestContext

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

    def piece(self, i: int) -> Any:
        """Unit i's own output (its part's, sliced to it), or None where it has none."""
        out, j = self.where.get(i, (None, 0))
        return None if out is None else slice_output(out, [j])

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
        """The tower's tokens per unit with the selector's replacements in (a unit that fell back keeps its own)."""
        return [f if r is None or fb == "keep_all" else replacement(r, f, i)
                for i, (f, r, fb) in enumerate(zip(feats, self.replaced, self.fallback))]



def replacement(tokens: torch.Tensor, feats: torch.Tensor, i: int) -> torch.Tensor:
    """A selector's replacement tokens for unit i, checked against the tower's output [n_i, D]."""
    if tuple(tokens.shape) != tuple(feats.shape):
        raise ValueError(f"the selector returned visual_tokens of shape {tuple(tokens.shape)} for image {i}; "
                         f"expected {tuple(feats.shape)} (the merger output's raster layout [n_i, D])")
    return tokens.to(feats.device, feats.dtype)


def validate_kept(
    kept: Sequence[torch.Tensor | None], n_tokens: Sequence[int], fallback: Sequence[str | None],
    errors: Sequence[str | None],
) -> tuple[list[torch.Tensor], list[str | None], list[str | None]]:
    """Sorted unique in-range non-empty indices per image; anything else keeps all tokens (and says why).
    Host work (numpy); a selector that answered on the device is read back here."""
    out = []
    fallback, errors = list(fallback), list(errors)
    for i, (k, n) in enumerate(zip(kept, n_tokens)):
        problem = None
        if k is None:
            problem = "no indices returned"
        else:
            k = torch.as_tensor(k).detach().cpu().numpy().astype(np.int64).ravel()
            if k.size == 0:
                problem = "empty selection (every image keeps at least one token)"
            elif k.min() < 0 or k.max() >= n:
                problem = f"indices outside [0, {n})"
            else:
                k = torch.from_numpy(np.unique(k))  # sorted ascending
        if problem is not None:
            out.append(torch.from_numpy(np.arange(n)))
            fallback[i] = "keep_all"
            errors[i] = errors[i] or f"invalid selection: {problem}"
        else:
            out.append(k)
    return out, fallback, errors


def unit_counts(budgets: list[Budget], grid_hw: Sequence[tuple[int, int]], clips: Sequence[Sequence[int]] = ()
                ) -> list[int]:
    """K_i per unit. A clip's budget (`clips`: each clip's units in group order), a share or a count, is the clip's:
    its count over the clip's t * n cells, at least its minimum of one token per temporal group, split over its
    groups (earlier groups take the remainder), so a per-group selector keeps what the clip was given and never
    more."""
    counts = [count_of(bud, h * w) for bud, (h, w) in zip(budgets, grid_hw)]
    for units in clips:
        t, n = len(units), grid_hw[units[0]][0] * grid_hw[units[0]][1]
        k = max(minimum_count(t, n), count_of(budgets[units[0]], t * n))
        for g, i in enumerate(units):
            counts[i] = min(n, k // t + (g < k % t))
    return counts


def every_token_units(budgets: list[Budget], grid_hw: Sequence[tuple[int, int]],
                      clips: Sequence[Sequence[int]] = ()) -> list[bool]:
    """Per unit, whether its budget is every token (a share of 1.0, a count of at least its tokens; a clip's over
    the clip). Such a unit keeps every token whatever the budget mode or method: "mean" would scale the count
    down, "adaptive" would ignore it, and either would switch an adapter on for a request of the stock model
    (docs/DESIGN.md, "Budgets")."""
    return [k >= h * w for k, (h, w) in zip(unit_counts(budgets, grid_hw, clips), grid_hw)]


def keep_every_token(choice: Choice, full: Sequence[bool], n_tokens: Sequence[int]) -> Choice:
    """`choice` with every unit in `full` keeping all its cells, as chosen (no fallback, no replaced tokens)."""
    for i, whole in enumerate(full):
        if whole:
            choice.kept[i], choice.replaced[i] = torch.arange(n_tokens[i]), None
    return choice


def padded_questions(per_unit: Sequence[Sequence[int]], pad: int, embed: Callable[[torch.Tensor], torch.Tensor],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Each unit's question-token embeddings, in one embedding call for the batch.
    -> (query [N, L, D] in the embedding's dtype, mask [N, L] bool, lengths L_i) on `device`."""
    longest = max(len(q) for q in per_unit)
    padded = np.full((len(per_unit), longest), pad, dtype=np.int64)
    real = np.zeros((len(per_unit), longest), dtype=bool)
    for i, q in enumerate(per_unit):
        padded[i, : len(q)], real[i, : len(q)] = q, True
    return embed(upload(padded, device)), upload(real, device), [len(q) for q in per_unit]


def question_embeddings(backend: VLMBackend, prompt: Prompt) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`padded_questions` for a prompt's units, through the backend's embedding."""
    questions = backend.question_tokens(prompt)
    return padded_questions([questions[b] for b in prompt.item_of_image], backend.pad_token_id,
                            backend.embed_tokens, backend.device)


def context(req: RequestContext, prompt: Prompt, visual_tokens: list[torch.Tensor] | None, budgets: list[Budget],
            budget_mode: BudgetMode | None) -> SelectionContext:
    """What a selector reads of this prompt (`SelectionContext`): budgets already resolved per unit."""
    backend, clock = req.backend, req.clock
    query, query_mask, lengths = question_embeddings(backend, prompt)
    texts: list[str] = []
    if prompt.has_video:   # the temporal allocator reads the question's words
        rows = [backend.decode_text(q) for q in backend.question_tokens(prompt)]
        texts = [rows[b] for b in prompt.item_of_image]
    lap(clock, "question")
    side, n = prompt.side, len(prompt.grid_hw)
    if prompt.pixels is None:
        prompt.pixels = backend.pixels(prompt)
    return SelectionContext(
        backend=backend, prompt=prompt, layer=req.layer, pixels=prompt.pixels, grid_hw=list(prompt.grid_hw),
        visual_tokens=visual_tokens, query=query, query_mask=query_mask, query_lengths=lengths,
        budgets=list(budgets), counts=unit_counts(list(budgets), prompt.grid_hw, prompt.clips),
        item_of_image=list(prompt.item_of_image), budget_mode=budget_mode, image_ids=list(range(n)), seed=req.seed,
        side_features=[[d[i] for d in side] for i in range(n)] if side is not None else None, clock=clock,
        clips=list(prompt.clip), groups=list(prompt.group), questions=texts)


def independent_units(ctx: SelectionContext) -> list[list[int]]:
    """The units whose choices depend on each other, in prompt order: a clip's temporal groups share its budget;
    every image stands alone (its count, texture, scores and ranking read nothing of another image's)."""
    groups: list[list[int]] = []
    clip_at: dict[tuple[int, int], int] = {}
    for i in range(len(ctx)):
        clip = ctx.clips[i] if ctx.clips else -1
        if clip < 0:
            groups.append([i])
            continue
        key = (ctx.item_of_image[i], clip)
        if key not in clip_at:
            clip_at[key] = len(groups)
            groups.append([])
        groups[clip_at[key]].append(i)
    return groups


def chooses_alone(fn: Selector, name: str) -> bool:
    """Whether a selector runs on each independent part alone: every one but those that read the VLM's own
    attention (FastV, VisionZip: a pass of the model over the whole batch, which they read per image)."""
    if reads_tower_attention(fn):
        return False
    try:
        return method_info(name).vlm is None
    except ValueError:
        return True


def run_selector(fn: Selector, ctx: SelectionContext, name: str, strict: bool = False) -> Choice:
    """Run the selector on each independent part of the batch (`independent_units`: an image, a clip) alone, so
    a unit keeps the same cells whatever shares its batch (the same arithmetic on the same shapes: no padding to
    another picture's canvas or another question's length, no kernel chosen by the batch size); a part that
    fails keeps all. Selectors that read the VLM's attention run on the batch (`chooses_alone`).

    A `BudgetError` (the caller asked for something impossible) and a `MissingCapability` (the selector needs a
    service this backend lacks) always propagate, and so does every error with strict=True (the evaluation: a
    row must not silently run another method)."""
    N = len(ctx)
    kept: list[torch.Tensor | None] = [None] * N
    fallback: list[str | None] = [None] * N
    errors: list[str | None] = [None] * N
    replaced: list[torch.Tensor | None] = [None] * N
    parts = independent_units(ctx) if chooses_alone(fn, name) else [list(range(N))]
    groups = []
    for which in parts:
        try:
            part = ctx if len(parts) == 1 else ctx.subset(which)
            groups.append((which, as_selection(fn(part), len(which))))
        except (BudgetError, MissingCapability):
            raise
        except Exception as exc:  # noqa: BLE001 - isolate the failure to the units that cause it
            if strict:
                raise SelectorFailed(name, exc) from exc
            logger.warning("selector %r failed for units %s (%s); they keep all tokens", name, which, exc)
            for i in which:
                fallback[i] = "keep_all"
                errors[i] = f"{type(exc).__name__}: {exc}"
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
        arr_out = merged_output(N, outs)
    return Choice(kept, arr_out, fallback, errors, replaced)


def merged_output(n: int, outs: list[tuple[list[int], Any]]) -> Any:
    """One selector output for the batch from its parts' (each image chosen alone), as if the batch had been one
    call: per-image lists joined, batch-first maps padded to the largest grid (each image valid in its top-left,
    as a batched call pads them) and put in unit order. Outputs that cannot be joined so (another type, a clip's
    temporal signals, a part that failed) stay in pieces (`PerImageOutputs`)."""
    pieces = [o for _, o in outs]
    first = pieces[0]
    joinable = (all(o is not None and type(o) is type(first) for o in pieces) and dataclasses.is_dataclass(first)
                and isinstance(getattr(first, "kept_indices", None), list)
                and all(getattr(o, "temporal", None) is None for o in pieces)
                and sorted(i for which, _ in outs for i in which) == list(range(n)))
    if not joinable:
        return PerImageOutputs(n, outs)
    order = [i for which, _ in outs for i in which]
    back = torch.as_tensor(np.argsort(order, kind="stable"))
    changes = {}
    for f in dataclasses.fields(first):
        if f.name == "channel_names":  # per channel, not per image
            continue
        values = [getattr(o, f.name) for o in pieces]
        sizes = [len(which) for which, _ in outs]
        if isinstance(values[0], list) and all(isinstance(v, list) and len(v) == k for v, k in zip(values, sizes)):
            joined = [x for v in values for x in v]
            changes[f.name] = [joined[j] for j in back.tolist()]
        elif isinstance(values[0], torch.Tensor) and all(isinstance(v, torch.Tensor) and v.dim() > 0
                                                         and v.shape[0] == k for v, k in zip(values, sizes)):
            changes[f.name] = _padded_cat(values).index_select(0, back.to(values[0].device))
    return dataclasses.replace(first, **changes)


def _padded_cat(values: list[torch.Tensor]) -> torch.Tensor:
    """Batch-first tensors of one rank, each zero-padded at the end of every other dim to the largest, joined."""
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        pad = [x for d in reversed(range(1, v.dim())) for x in (0, shape[d - 1] - v.shape[d])]
        padded.append(torch.nn.functional.pad(v, pad) if any(pad) else v)
    return torch.cat(padded)


__all__ = ["Choice", "PerImageOutputs", "SelectorFailed", "as_selection", "context", "every_token_units",
           "independent_units", "keep_every_token", "padded_questions", "question_embeddings", "replacement", "run_selector", "slice_output",
           "unit_counts", "validate_kept"]
