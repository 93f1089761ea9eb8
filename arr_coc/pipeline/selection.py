"""Selection: what every selector receives and returns, and the one registry of methods by name.

A selector is `fn(ctx: SelectionContext) -> Selection | list[LongTensor]`: per unit (an image, or a video's
temporal group), the raster indices of the merged visual tokens the language model keeps. The pipeline
builds the context (`choose.py`), runs the selector and rewrites the prompt; a selector never touches the
prompt, and reaches the model only through `ctx.backend` (`arr_coc.pipeline.backend.VLMBackend`).

`METHODS` is the one registry: every built-in method with what it is (`Method`: its module, whether it can
choose before the tower, whether it can be given a video, what else it needs). `get_selector(name)` imports
the owning module of `arr_coc.methods` on first use; `register_selector` adds your own.
"""

from __future__ import annotations

import dataclasses
import importlib
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

from ..budget import Budget, BudgetMode
from .prompt import Prompt, clip_members

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer
    from ..core.output import ARRCOCOutput
    from ..stopwatch import Stopwatch
    from .backend import UnitPixels, VLMBackend


@dataclass
class Selection:
    """A selector's answer for the units of a `SelectionContext`.

    kept: LongTensor[K_i] per unit, raster indices into the merged grid (any order; sorted and
    checked by the caller). fallback / errors: per unit, optional.
    visual_tokens: per unit, optional Tensor[n_i, D] replacing the tower's output in the same raster
    layout; the LM then sees visual_tokens[i][kept_i] (e.g. VisionZip's merged contextual tokens).
    """

    kept: list[torch.Tensor]
    arr_coc: ARRCOCOutput | None = None
    fallback: list[str | None] | None = None
    errors: list[str | None] | None = None
    visual_tokens: list[torch.Tensor | None] | None = None


@dataclass
class SelectionContext:
    """Everything a selector may use, for N units (all units of a batch, prompt order).

    backend       the VLM, through its typed interface (`VLMBackend`): FastV's and VisionZip's attention; None in a
                  pure choice (`pure.choose`), which refuses the methods that read the VLM (`Method.vlm`)
    prompt        the unpruned prompt the units belong to (hand it back to the backend's services); None in a
                  pure choice
    layer         the ARR-COC layer to run, built on first call (a trained one for `arr_coc_trained`)
    pixels        the units' pictures (`UnitPixels`): the texture's input on the device, or `images` on the host
    grid_hw       list[(h_i, w_i)] merged-token grid; n_i = h_i * w_i
    visual_tokens list[Tensor[n_i, D]] the tower's output (VLM dtype); with encode="before" the gist's tokens
                  under each cell, or None without a gist
    query         Tensor[N, L, D] input embeddings of each unit's question tokens (padded; VLM dtype) and
    query_mask    BoolTensor[N, L] the real ones; `query_embeds` gives them per unit
    budgets       list[Budget] per unit: a missing budget is already the method's default (`Pruning`)
    budget_mode   None | "exact" | "mean" | "adaptive" (arr_coc.budget), as the caller gave it
    counts        list[int] K_i for exact-count selectors (a clip's count budget split over its groups)
    item_of_image list[int] batch row of each unit
    image_ids     batch-global index of each unit (what the backend's services take)
    clips         per unit: -1, or the video it is a temporal group of (a video reaches selectors as its
                  groups, each a picture; `counts` already splits a clip's count over them)
    groups        per unit: its temporal group in that video (0 for an image)
    questions     per unit: its question's text (empty when unknown)
    """

    backend: VLMBackend | None
    prompt: Prompt | None
    layer: Callable[[], ARRCOCLayer]
    pixels: UnitPixels
    grid_hw: list[tuple[int, int]]
    visual_tokens: list[torch.Tensor] | None
    query: torch.Tensor
    query_mask: torch.Tensor
    budgets: list[Budget | None]
    counts: list[int]
    item_of_image: list[int]
    budget_mode: BudgetMode | None = None
    image_ids: list[int] = field(default_factory=list)
    seed: int = 0
    side_features: list[list[torch.Tensor]] | None = None  # per unit, one [n_i, D] per side-feature layer
    query_lengths: list[int] = field(default_factory=list)    # L_i per unit (host), for `query_embeds`
    clock: Stopwatch | None = None   # stage times of this pass (`arr_coc.stopwatch`); a selector may lap it
    clips: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)

    @property
    def has_video(self) -> bool:
        return any(c >= 0 for c in self.clips)

    def clip_units(self) -> list[list[int]]:
        """Per video in the context, its units (temporal groups) in group order."""
        return clip_members(self.clips, self.groups)

    def __len__(self) -> int:
        return len(self.grid_hw)

    @property
    def images(self) -> list[torch.Tensor]:
        """list[FloatTensor[3, H_i, W_i]] in [0, 1] on the host: the resized pictures the VLM saw (rebuilt once)."""
        return self.pixels.images

    @property
    def query_embeds(self) -> list[torch.Tensor]:
        """list[Tensor[L_i, D]] each unit's question-token embeddings (views of `query`)."""
        return [self.query[i, :n] for i, n in enumerate(self.query_lengths)]

    def subset(self, which: Sequence[int]) -> SelectionContext:
        pick = lambda xs: [xs[i] for i in which]  # noqa: E731
        rows = torch.tensor(list(which), dtype=torch.long, device=self.query.device)
        # The questions padded to the subset's longest, as a context built for these units alone pads them.
        longest = max(pick(self.query_lengths)) if self.query_lengths else self.query.shape[1]
        return dataclasses.replace(
            self, pixels=self.pixels.subset(which), grid_hw=pick(self.grid_hw),
            visual_tokens=pick(self.visual_tokens) if self.visual_tokens is not None else None,
            query=self.query.index_select(0, rows)[:, :longest],
            query_mask=self.query_mask.index_select(0, rows)[:, :longest],
            query_lengths=pick(self.query_lengths), budgets=pick(self.budgets), counts=pick(self.counts),
            item_of_image=pick(self.item_of_image), image_ids=pick(self.image_ids),
            clips=pick(self.clips) if self.clips else [], groups=pick(self.groups) if self.groups else [],
            questions=pick(self.questions) if self.questions else [],
            side_features=pick(self.side_features) if self.side_features is not None else None,
        )

    def generator(self, i: int) -> torch.Generator:
        """A per-unit generator seeded by (seed, picture content): the same picture draws the same
        tokens whether it runs alone or in a batch, different pictures draw different ones."""
        pixels = (self.images[i].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy().tobytes()
        return torch.Generator().manual_seed((zlib.crc32(pixels) + 7919 * self.seed) % (2**63))


Selector = Callable[[SelectionContext], Union[Selection, Sequence[torch.Tensor]]]


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Method:
    """One method of the registry and what it can do.

    module   the `arr_coc.methods` module that registers its selector (None: registered at run time)
    before   chooses without the encoded tokens, so it can run with encode="before"
    video    may be given a video's temporal groups (it reads each group's picture, tokens and question, or
             allocates over time); one that reads the unpruned prompt's layout itself (FastV, VisionZip) is not
    images   may be given an image (the video anchors EVS and uniform frames prune images as `grid` would)
    needs    what a selection context lacks, for the evaluation's plans: "input" (a new, smaller image),
             "boxes" (the answer's boxes), "weights" (a trained layer's folder); None: a context is enough
    in_all   one of `eval --methods all` (arr_coc_adaptive is arr_coc with a budget mode: not a row of its own)
    tower_attention  reads the tower's last-block attention (`VLMBackend.tower_attention`): the pipeline asks the
             backend to record it during its own tower pass, so the selector needs no second one
    layer    runs the ARR-COC layer (its default budget and budget mode are the layer's; `runs_layer`)
    vlm      what it reads of the VLM itself (a backend service: "the language model's attention", "the tower's
             attention"); None: it runs as a pure choice (`arr_coc.pipeline.pure.choose`) on pixels, the
             question's tokens and, when it reads them, the encoded visual tokens
    """

    name: str
    module: str | None
    before: bool = False
    video: bool = False
    images: bool = True
    needs: str | None = None
    in_all: bool = True
    tower_attention: bool = False
    layer: bool = False
    vlm: str | None = None


_BUILTIN = (   # the evaluation's order of `--methods all` (tables and plots follow it)
    Method("none", "arr_coc.methods.none", before=True, video=True),
    Method("random", "arr_coc.methods.random_sampling", before=True, video=True),
    Method("grid", "arr_coc.methods.grid", before=True, video=True),
    Method("downscale", "arr_coc.methods.downscale", needs="input"),
    Method("fastv", "arr_coc.methods.fastv", vlm="the language model's attention"),
    Method("visionzip", "arr_coc.methods.visionzip", tower_attention=True, vlm="the tower's attention"),
    Method("divprune", "arr_coc.methods.divprune", video=True),
    Method("cdpruner", "arr_coc.methods.cdpruner", video=True),
    Method("evs", "arr_coc.methods.over_time", video=True, images=False),
    Method("uniform_frames", "arr_coc.methods.over_time", before=True, video=True, images=False),
    Method("oracle", "arr_coc.methods.oracle", before=True, video=True, needs="boxes"),
    Method("arr_coc", "arr_coc.methods.arrcoc", before=True, video=True, layer=True),
    Method("arr_coc_adaptive", "arr_coc.methods.arrcoc", before=True, video=True, in_all=False, layer=True),
    Method("arr_coc_trained", "arr_coc.methods.arrcoc", before=True, video=True, needs="weights", layer=True),
)
METHODS: dict[str, Method] = {m.name: m for m in _BUILTIN}
SELECTORS: dict[str, Selector] = {}


def register_selector(name: str, fn: Selector | None = None, *, overwrite: bool = False,
                      before: bool | None = None, video: bool | None = None):
    """Register `fn(ctx: SelectionContext) -> Selection | list[LongTensor]` under `name`.

    Usable as `register_selector("mine", fn)` or as a decorator `@register_selector("mine")`. A built-in name
    takes its properties from `METHODS`; a new one from `before` / `video`, or else from the function's marks
    (`choose_before_encoding`, `handles_video`). The function is marked to match, so a selector passed by
    itself (not by name) says the same, and `method_info(name)` reads them from it.
    """

    def add(f: Selector) -> Selector:
        if name in SELECTORS and not overwrite and SELECTORS[name] is not f:
            raise ValueError(f"selector {name!r} is already registered; pass overwrite=True to replace it")
        known = METHODS.get(name)
        if known is not None:
            marks = (known.before, known.video, known.tower_attention, known.layer)
        else:
            marks = (bool(getattr(f, "selects_before_encoding", False)) if before is None else before,
                     bool(getattr(f, "handles_video", False)) if video is None else video,
                     bool(getattr(f, "reads_tower_attention", False)), runs_layer(f))
        (f.selects_before_encoding, f.handles_video, f.reads_tower_attention,  # type: ignore[attr-defined]
         f.runs_layer) = marks
        SELECTORS[name] = f
        return f

    return add(fn) if fn is not None else add


def available_methods() -> list[str]:
    """Every name `get_selector` resolves (the methods a selection context is enough for), sorted."""
    return sorted({m.name for m in METHODS.values() if not m.needs} | set(SELECTORS))


def method_info(name: str) -> Method:
    """The registry's entry for `name`: a built-in's, or one read off a selector registered at run time (ValueError
    naming the known ones otherwise)."""
    if name in METHODS:
        return METHODS[name]
    if name in SELECTORS:
        fn = SELECTORS[name]
        return Method(name, None, before=selects_before_encoding(fn), video=selects_video(fn),
                      tower_attention=reads_tower_attention(fn), layer=runs_layer(fn))
    raise ValueError(unknown_method_message(name))


def methods_where(*, video: bool | None = None, images: bool | None = None, runnable: bool = False,
                  in_all: bool | None = None) -> list[str]:
    """The registry's names in its order (the built-ins, then those registered at run time), filtered by what they
    can be given; runnable: only those a selection context is enough for (no `needs`); in_all: only the rows of
    `eval --methods all` (the built-ins)."""
    entries = list(METHODS.values()) + [method_info(n) for n in SELECTORS if n not in METHODS]
    return [m.name for m in entries
            if (video is None or m.video == video) and (images is None or m.images == images)
            and not (runnable and m.needs) and (in_all is None or (m.in_all and m.module is not None) == in_all)]


def get_selector(name: str) -> Selector:
    """The selector registered under `name`, importing its built-in module on first use."""
    known = METHODS.get(name)
    if name not in SELECTORS and known is not None and known.module is not None:
        importlib.import_module(known.module)
    if name not in SELECTORS:
        if known is not None and known.needs:
            raise ValueError(f"method {name!r} needs more than a selection context ({known.needs}); "
                             "the evaluation builds it per batch (arr_coc.evaluation.plans)")
        raise ValueError(unknown_method_message(name))
    return SELECTORS[name]


def choose_before_encoding(fn: Selector) -> Selector:
    """Mark a selector of your own that needs no encoded visual tokens (it reads the image, the question and,
    when given, the gist), so it can run with encode="before". Returns `fn`."""
    fn.selects_before_encoding = True  # type: ignore[attr-defined]
    return fn


def handles_video(fn: Selector) -> Selector:
    """Mark a selector of your own that may be given a video's temporal groups (`SelectionContext.clips`).
    Returns `fn`."""
    fn.handles_video = True  # type: ignore[attr-defined]
    return fn


def selects_before_encoding(fn: Selector) -> bool:
    return bool(getattr(fn, "selects_before_encoding", False))


def selects_video(fn: Selector) -> bool:
    return bool(getattr(fn, "handles_video", False))


def reads_tower_attention(fn: Selector | None) -> bool:
    return bool(getattr(fn, "reads_tower_attention", False))


def runs_layer(fn: Selector | None) -> bool:
    """A selector that runs the ARR-COC layer (its default budget and mode are the layer's): marked by the registry
    (`Method.layer`) or by `runs_arr_coc_layer`."""
    return bool(getattr(fn, "runs_layer", False))


def runs_arr_coc_layer(fn: Selector) -> Selector:
    """Mark a selector of your own that runs the context's ARR-COC layer (`ctx.layer()`), so a missing budget is
    the layer's. Returns `fn`."""
    fn.runs_layer = True  # type: ignore[attr-defined]
    return fn


MARKS = ("selects_before_encoding", "handles_video", "reads_tower_attention", "runs_layer")   # what a wrapper copies


def video_methods() -> list[str]:
    """The methods that can prune a video, in the registry's order."""
    return [n for n in methods_where(video=True, runnable=True)]


def unknown_method_message(name: object) -> str:
    """What every caller says about a method name nothing resolves (the library, the CLI, the app)."""
    shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:55] + "...'"
    return (f"unknown method {shown}; choose one of the registered methods, {', '.join(available_methods())} "
            "(or register your own with arr_coc.pipeline.register_selector)")


def selector_name(method: str | Selector) -> str:
    """How a method is named in traces and tables."""
    return method if isinstance(method, str) else getattr(method, "__name__", "custom")


__all__ = ["MARKS", "METHODS", "Method", "SELECTORS", "Selection", "SelectionContext", "Selector",
           "available_methods", "choose_before_encoding", "clip_members", "get_selector", "handles_video",
           "method_info", "methods_where", "reads_tower_attention", "register_selector", "runs_arr_coc_layer", "runs_layer", "selector_name", "selects_before_encoding",
           "selects_video", "unknown_method_message", "video_methods"]
