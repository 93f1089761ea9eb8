"""Selection: what every selector receives and returns, and the registry of selectors by name.

A selector is `fn(ctx: SelectionContext) -> Selection | list[LongTensor]`: per image, the raster
indices of the merged visual tokens the language model keeps. The wrapper (`arr_coc.qwen`) builds
the context, runs the selector and rewrites the inputs; a selector never touches the prompt.

Every built-in method is a module of `arr_coc.methods` that registers its selector when imported.
`get_selector(name)` imports the module that owns `name` on first use (one lazy loader, here), so
nothing else needs to import `arr_coc.methods` to make a name resolvable.
"""

from __future__ import annotations

import dataclasses
import importlib
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

from .budget import Budget, BudgetMode

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .layer import ARRCOCLayer, ARRCOCOutput
    from .qwen.pixels import PatchImages
    from .stopwatch import Stopwatch


@dataclass
class Selection:
    """A selector's answer for the images of a `SelectionContext`.

    kept: LongTensor[K_i] per image, raster indices into the merged grid (any order; sorted and
    checked by the caller). fallback / errors: per image, optional.
    visual_tokens: per image, optional Tensor[n_i, D] replacing the merger output in the same raster
    layout; the LM then sees visual_tokens[i][kept_i] (e.g. VisionZip's merged contextual tokens).
    """

    kept: list[torch.Tensor]
    arr_coc: ARRCOCOutput | None = None
    fallback: list[str | None] | None = None
    errors: list[str | None] | None = None
    visual_tokens: list[torch.Tensor | None] | None = None


@dataclass(frozen=True)
class VLMHandles:
    """What a selector may read of the VLM beyond the context's tensors (nothing else of the wrapper).

    model  the frozen Qwen-VL (FastV runs its LM prefix, VisionZip records its vision tower)
    layer  the ARR-COC layer to run, built on first call (a trained one for `arr_coc_trained`)
    """

    model: PreTrainedModel
    layer: Callable[[], ARRCOCLayer]


@dataclass
class SelectionContext:
    """Everything a selector may use, for N images (all images of a batch, prompt order).

    vlm           typed handles to the model and the ARR-COC layer (`VLMHandles`)
    pixels        the processor's patches on the VLM's device (`arr_coc.qwen.pixels.PatchImages`): the
                  texture's input without rebuilding a picture; `images` rebuilds them on the host on demand
    grid_hw       list[(h_i, w_i)] merged-token grid; n_i = h_i * w_i
    visual_tokens list[Tensor[n_i, D]] merger output (VLM dtype); with encode="before" the gist's tokens
                  under each cell, or None without a gist
    query         Tensor[N, L, D] input embeddings of each image's question tokens (padded; VLM dtype) and
    query_mask    BoolTensor[N, L] the real ones; `query_embeds` gives them per image
    budgets       list[Budget | None] per image, as the caller gave them (None: the selector's default)
    budget_mode   None | "exact" | "mean" (arr_coc.budget), as the caller gave it
    counts        list[int] K_i for exact-count selectors (budget resolved against n_i; None -> default)
    item_of_image list[int] batch row of each image
    inputs        the unpruned batch (input_ids, attention_mask, ...) on the VLM's device, for LM-based selectors
    image_spans   list[(row, start, end)]: where image i's pads sit in `inputs["input_ids"]`
    position_ids  LongTensor[3, B, S] unpruned M-RoPE positions
    clips         per image: -1, or the video it is a temporal group of (`arr_coc.qwen.units`: a video reaches
                  selectors as its groups, each a picture; `counts` already splits a clip's count over them)
    groups        per image: its temporal group in that video (0 for an image)
    questions     per image: its question's text (empty when unknown)
    """

    vlm: VLMHandles
    pixels: PatchImages
    grid_hw: list[tuple[int, int]]
    visual_tokens: list[torch.Tensor] | None
    query: torch.Tensor
    query_mask: torch.Tensor
    budgets: list[Budget | None]
    counts: list[int]
    item_of_image: list[int]
    inputs: dict[str, torch.Tensor]
    image_spans: list[tuple[int, int, int]]
    position_ids: torch.Tensor
    budget_mode: BudgetMode | None = None
    image_ids: list[int] = field(default_factory=list)   # batch-global index of each image
    seed: int = 0
    deepstack_features: list[list[torch.Tensor]] | None = None  # Qwen3-VL: per image, one [n_i, D] per deepstack layer
    query_lengths: list[int] = field(default_factory=list)    # L_i per image (host), for `query_embeds`
    clock: Stopwatch | None = None   # stage times of this pass (`arr_coc.stopwatch`); a selector may lap it
    clips: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)

    @property
    def has_video(self) -> bool:
        return any(c >= 0 for c in self.clips)

    def clip_units(self) -> list[list[int]]:
        """Per video in the context, its images (temporal groups) in group order."""
        return clip_members(self.clips, self.groups)

    def __len__(self) -> int:
        return len(self.grid_hw)

    @property
    def images(self) -> list[torch.Tensor]:
        """list[FloatTensor[3, H_i, W_i]] in [0, 1] on the host: the resized images the VLM saw (rebuilt once)."""
        return self.pixels.images

    @property
    def query_embeds(self) -> list[torch.Tensor]:
        """list[Tensor[L_i, D]] each image's question-token embeddings (views of `query`)."""
        return [self.query[i, :n] for i, n in enumerate(self.query_lengths)]

    def subset(self, which: Sequence[int]) -> SelectionContext:
        pick = lambda xs: [xs[i] for i in which]  # noqa: E731
        rows = torch.tensor(list(which), dtype=torch.long, device=self.query.device)
        return dataclasses.replace(
            self, pixels=self.pixels.subset(which), grid_hw=pick(self.grid_hw),
            visual_tokens=pick(self.visual_tokens) if self.visual_tokens is not None else None,
            query=self.query.index_select(0, rows), query_mask=self.query_mask.index_select(0, rows),
            query_lengths=pick(self.query_lengths), budgets=pick(self.budgets), counts=pick(self.counts),
            item_of_image=pick(self.item_of_image), image_spans=pick(self.image_spans),
            image_ids=pick(self.image_ids), clips=pick(self.clips) if self.clips else [],
            groups=pick(self.groups) if self.groups else [], questions=pick(self.questions) if self.questions else [],
            deepstack_features=pick(self.deepstack_features) if self.deepstack_features is not None else None,
        )

    def generator(self, i: int) -> torch.Generator:
        """A per-image generator seeded by (seed, image content): the same image draws the same
        tokens whether it runs alone or in a batch, different images draw different ones."""
        pixels = (self.images[i].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy().tobytes()
        return torch.Generator().manual_seed((zlib.crc32(pixels) + 7919 * self.seed) % (2**63))


Selector = Callable[[SelectionContext], Union[Selection, Sequence[torch.Tensor]]]

# name -> the arr_coc.methods module that registers it (imported on first use).
BUILTIN: dict[str, str] = {
    "none": "arr_coc.methods.none",
    "random": "arr_coc.methods.random_sampling",
    "grid": "arr_coc.methods.grid",
    "arr_coc": "arr_coc.methods.arrcoc",
    "arr_coc_adaptive": "arr_coc.methods.arrcoc",
    "fastv": "arr_coc.methods.fastv",
    "visionzip": "arr_coc.methods.visionzip",
    "divprune": "arr_coc.methods.divprune",
    "cdpruner": "arr_coc.methods.cdpruner",
    "evs": "arr_coc.methods.over_time",
    "uniform_frames": "arr_coc.methods.over_time",
}

SELECTORS: dict[str, Selector] = {}


def clip_members(clips: Sequence[int], groups: Sequence[int]) -> list[list[int]]:
    """Per video (clip id >= 0, in id order), the indices of its temporal groups in group order."""
    out: dict[int, list[int]] = {}
    for i, c in enumerate(clips):
        if c >= 0:
            out.setdefault(c, []).append(i)
    return [sorted(out[c], key=lambda i: groups[i]) for c in sorted(out)]


def register_selector(name: str, fn: Selector | None = None, *, overwrite: bool = False):
    """Register `fn(ctx: SelectionContext) -> Selection | list[LongTensor]` under `name`.

    Usable as `register_selector("mine", fn)` or as a decorator `@register_selector("mine")`.
    """

    def add(f: Selector) -> Selector:
        if name in SELECTORS and not overwrite and SELECTORS[name] is not f:
            raise ValueError(f"selector {name!r} is already registered; pass overwrite=True to replace it")
        SELECTORS[name] = f
        return f

    return add(fn) if fn is not None else add


def available_methods() -> list[str]:
    """Every name `get_selector` resolves: the built-in methods and whatever was registered."""
    return sorted(set(BUILTIN) | set(SELECTORS))


def get_selector(name: str) -> Selector:
    """The selector registered under `name`, importing its built-in module on first use."""
    if name not in SELECTORS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in SELECTORS:
        raise ValueError(unknown_method_message(name))
    return SELECTORS[name]


def choose_before_encoding(fn: Selector) -> Selector:
    """Mark a selector that needs no encoded visual tokens (it reads the image, the question and, when
    given, the gist), so it can run with encode="before". Returns `fn`."""
    fn.selects_before_encoding = True  # type: ignore[attr-defined]
    return fn


def selects_before_encoding(fn: Selector) -> bool:
    return bool(getattr(fn, "selects_before_encoding", False))


def handles_video(fn: Selector) -> Selector:
    """Mark a selector that may be given a video's temporal groups (`SelectionContext.clips`): one that reads
    only each group's picture, tokens and question, or one that allocates over time. A selector that reads the
    unpruned prompt's layout itself (FastV's language-model attention, VisionZip's tower attention) is not
    marked, and a video given to it is refused before any work. Returns `fn`."""
    fn.handles_video = True  # type: ignore[attr-defined]
    return fn


def selects_video(fn: Selector) -> bool:
    return bool(getattr(fn, "handles_video", False))


def video_methods() -> list[str]:
    """The registered methods that can prune a video."""
    out = []
    for name in available_methods():
        try:
            if selects_video(get_selector(name)):
                out.append(name)
        except Exception:  # noqa: BLE001 - a method that cannot load cannot prune a video either
            continue
    return out


def unknown_method_message(name: object) -> str:
    """What every caller says about a method name nothing resolves (the library, the CLI, the app)."""
    shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:55] + "...'"
    return (f"unknown method {shown}; choose one of the registered methods, {', '.join(available_methods())} "
            "(or register your own with arr_coc.selection.register_selector)")


def selector_name(method: str | Selector) -> str:
    """How a method is named in traces and tables."""
    return method if isinstance(method, str) else getattr(method, "__name__", "custom")
