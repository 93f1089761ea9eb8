"""What a request asks of the pruning: read once at the edge, then carried typed through the pipeline.

`Pruning.of(method=..., budget=..., budget_mode=..., encode=..., strict=..., kept_indices=...)` is the one
place where a caller's values become typed settings: the budget(s) through the one parser
(`arr_coc.budget.parse_budget`, `wire=True` for what came over JSON), the mode through `check_mode`, the
encoding through `as_encode_config`, the method through the registry. Nothing after it parses again: the
pipeline, the selectors and the allocator count with `budget.count_of`, which trusts a read budget.

The validator's words for a method and the encoding (the app, `ask`, the lmms-eval plugin) are here too, since
they need the method registry: `check_method`, `check_encode`, `check_for_video`, and `validate` for a whole
request (budget, method, question, image, in that order; the budget, the images, the clips and the questions
themselves are `arr_coc.validation`'s, which the pipeline runs and so which cannot import it).

**A missing budget** has one meaning: the method's default, resolved here per unit (`unit_budgets`): the ARR-COC
layer's configured budget (`attending.budget`, 0.25 for every shipped layer) for the ARR-COC methods, and
`DEFAULT_BUDGET` (0.25) for the others; a layer configured `mode="adaptive"` makes a missing budget adaptive.
The selector, the allocator and the trace all read the resolved value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..budget import DEFAULT_BUDGET, Budget, BudgetMode, BudgetSpec, check_mode, parse_budget
from ..encode import EncodeConfig, EncodeMode, as_encode_config
from ..errors import InputError
from ..validation.images import ImageInfo, check_image
from ..validation.limits import LIMITS, InputLimits
from ..validation.requests import check_question, read_budget
from ..buckets import Buckets
from .selection import (Selector, available_methods, runs_layer, get_selector, method_info, methods_where, selector_name,
                        selects_before_encoding, selects_video, unknown_method_message, video_methods)

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer
    from .prompt import Prompt

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Pruning:
    """How one request is pruned.

    method       how traces and tables name it ("none", "explicit" for given cells, a registry name, or a custom
                 selector's __name__)
    selector     what chooses; None: nothing is chosen (every cell, or the given `kept`)
    budget       one budget for every unit, or one entry per row (a budget, or a list with one per visual of
                 that row); parsed; None entries are the method's default (`unit_budgets`)
    budget_mode  None | "exact" | "mean" | "adaptive" (arr_coc.budget), checked
    encode       what the tower encodes and how many looks (`EncodeConfig`)
    strict       a failing selector raises (`SelectorFailed`) instead of keeping every token of its items
    kept         explicit cells per unit (LongTensor[K_i]); overrides the method
    buckets      fixed shapes (`buckets.Buckets`): each unit's cells and the prompt's length rounded up to a bucket,
                 for a compiled execution; None: every request its own shape
    adapter      the backend's adapter may run for the rows this prunes (False: the stock model for every row)
    """

    method: str = "none"
    selector: Selector | None = None
    budget: BudgetSpec = None
    budget_mode: BudgetMode | None = None
    encode: EncodeConfig = EncodeConfig()
    strict: bool = False
    kept: tuple[torch.Tensor, ...] | None = None
    buckets: Buckets | None = None
    adapter: bool = True

    @classmethod
    def of(cls, method: str | Selector = "arr_coc", budget: BudgetSpec = None, budget_mode: BudgetMode | None = None,
           encode: EncodeConfig | EncodeMode | None = None, strict: bool = False,
           kept_indices: Sequence[torch.Tensor] | None = None, wire: bool = False, parsed: bool = False,
           buckets: Buckets | None = None, adapter: bool = True) -> Pruning:
        """The one read of a caller's values (see the module docstring); ValueError / BudgetError on bad ones.

        parsed: the budget was read at the caller's own edge already (`read_budget`, argparse's `budget_arg`), so
        it is taken as it is: every path reads a budget once."""
        name = "explicit" if kept_indices is not None and method == "arr_coc" else selector_name(method)
        selector = None if kept_indices is not None or name == "none" else \
            get_selector(method) if isinstance(method, str) else method
        encoding = as_encode_config(encode)
        if encoding.mode == "before" and selector is not None and not selects_before_encoding(selector):
            raise ValueError(f"method {name!r} reads the encoded visual tokens, so it cannot choose before the "
                             "vision tower; run it with encode='after'")
        kept = None if kept_indices is None else tuple(torch.as_tensor(k, dtype=torch.long) for k in kept_indices)
        return cls(name, selector, budget if parsed else read_budgets(budget, wire), check_mode(budget_mode), encoding,
                   strict, kept, buckets, bool(adapter))

    @property
    def before(self) -> bool:
        return self.encode.mode == "before"

    def check_prompt(self, prompt: Prompt) -> None:
        """Refuse, before any work, a method that cannot prune what the prompt holds."""
        if prompt.has_video and self.selector is not None and not selects_video(self.selector):
            raise InputError(video_refusal(self.method), "method")
        if prompt.has_video and self.encode.passes > 1:
            raise InputError(LOOKS_REFUSAL, "encode")

    def unit_budgets(self, prompt: Prompt, layer: Callable[[], ARRCOCLayer] | None = None) -> list[Budget]:
        """One budget per unit: this request's, or the method's default where it gave none (module docstring)."""
        given = expand_budgets(self.budget, prompt.item_of_image, prompt.rows, prompt.visual_index)
        if all(b is not None for b in given):
            return given                                       # type: ignore[return-value]
        default = self.default_budget(layer)
        return [default if b is None else b for b in given]

    def default_budget(self, layer: Callable[[], ARRCOCLayer] | None) -> Budget:
        if self.selector is not None and uses_layer(self.selector) and layer is not None:
            return layer().config.attending.budget
        return DEFAULT_BUDGET

    def unit_mode(self, layer: Callable[[], ARRCOCLayer] | None) -> BudgetMode | None:
        """The budget mode the selector gets: this request's, or "adaptive" when no budget was given at all and
        the layer is configured adaptive (a budget given for some rows only is met exactly where it is given
        and at the layer's budget elsewhere)."""
        if self.budget_mode is not None or self.budget is not None or self.selector is None \
                or not uses_layer(self.selector) or layer is None:
            return self.budget_mode
        return ADAPTIVE if layer().config.attending.mode == ADAPTIVE else None


LOOKS_REFUSAL = ("Looking again (passes > 1) applies to images only: a video's budget is spread over its temporal "
                 "groups by the time stage, which a second look would have to re-run per clip; answer videos with "
                 "passes=1 (docs/DESIGN.md, Saccades).")


def video_refusal(method: str) -> str:
    """Why a method cannot be given a clip, and which can."""
    return (f"Method {method!r} cannot prune a video: it reads the unpruned prompt's layout itself; choose one of "
            f"{', '.join(video_methods())} for videos.")


def check_for_video(method: str, encode: EncodeConfig) -> None:
    """Refuse, before any work, what a clip cannot be asked with: a method that cannot be given one, or more than
    one look (InputError, the validator's words)."""
    if method not in ("none", "explicit") and method in methods_where() and not method_info(method).video:
        raise InputError(video_refusal(method), "method")
    if encode.passes > 1:
        raise InputError(LOOKS_REFUSAL, "encode")


def uses_layer(selector: Selector) -> bool:
    """A selector that runs the ARR-COC layer (its default budget is the layer's): the registry's mark."""
    return runs_layer(selector)


def read_budgets(budget: BudgetSpec, wire: bool = False) -> BudgetSpec:
    """A budget spec with every entry through the one parser (None entries stay None: the default)."""
    parse = lambda x: None if x is None else parse_budget(x, wire=wire)  # noqa: E731
    if budget is None or isinstance(budget, (int, float, str)):
        return parse(budget)
    return [[parse(x) for x in entry] if isinstance(entry, (list, tuple)) else parse(entry) for entry in budget]


def expand_budgets(budget: BudgetSpec, item_of_image: list[int], batch: int,
                   visual_of_image: list[int] | None = None) -> list[Budget | None]:
    """One budget per unit from a parsed spec: a scalar for all, or one entry per row (scalar or per-visual list).

    A video reaches the pipeline as its temporal groups: visual_of_image gives each unit its visual's place in
    its row, so a per-row list has one entry per image or video, and a video's entry is its clip's budget.
    """
    if budget is None or isinstance(budget, (int, float)):
        return [budget] * len(item_of_image)
    budget = list(budget)
    if len(budget) != batch:
        raise ValueError(f"got {len(budget)} budgets for a batch of {batch}; pass one per question (or one for all)")
    if visual_of_image is None:
        visual_of_image, seen = [], {}
        for b in item_of_image:
            visual_of_image.append(seen.get(b, 0))
            seen[b] = visual_of_image[-1] + 1
    out: list[Budget | None] = []
    for b, j in zip(item_of_image, visual_of_image):
        entry = budget[b]
        if isinstance(entry, (list, tuple)):
            n_visual = 1 + max(v for r, v in zip(item_of_image, visual_of_image) if r == b)
            if len(entry) != n_visual:
                raise ValueError(f"question {b} has {n_visual} images or videos but {len(entry)} budgets")
            out.append(entry[j])
        else:
            out.append(entry)
    return out


# ----------------------------------------------------------------------------- what a user typed


def check_method(method: Any, default: str = "arr_coc") -> str:
    """A selector name that `get_selector` resolves (None, not given, is `default`)."""
    if method is None:
        return default
    if not isinstance(method, str) or method not in available_methods():
        raise InputError(unknown_method_message(method), "method")
    return method


def check_encode(method: Any, encode: Any = None) -> EncodeConfig:
    """What the vision tower encodes, for `method` -> an `EncodeConfig`. `encode` is an EncodeConfig, a mode
    ("after", "before"), None ("after") or a mapping of EncodeConfig's fields (the command line's --encode,
    --gist, --margin, --periphery, --whole-windows). Refused: settings that contradict each other (a gist
    or a margin without encode before, a periphery without a gist), and encode before for a method that reads
    the encoded visual tokens (FastV, VisionZip, ...), which cannot choose before the tower. method None or
    "none" selects nothing, so only the settings are checked."""
    try:
        config = EncodeConfig(**encode) if isinstance(encode, dict) else as_encode_config(encode)
    except (TypeError, ValueError) as exc:
        raise InputError(str(exc), "encode") from None
    if config.mode == "before" and isinstance(method, str) and method != "none":
        if not selects_before_encoding(get_selector(method)):
            before = [m for m in available_methods() if m != "none" and selects_before_encoding(get_selector(m))]
            raise InputError(f"method {method!r} reads the encoded visual tokens, so it cannot choose before the "
                             "vision tower: run it with --encode after (encode='after'), or pick a method that "
                             f"chooses before ({', '.join(before)})", "encode")
    return config


@dataclass
class CheckedRequest:
    """Everything a request sends, checked, in the order the validator checks it."""

    budget: Budget | None
    method: str
    question: str
    image: Any                      # RGB PIL image, or None when no image was asked for
    info: ImageInfo | None
    notes: list[str]


def validate(image: Any, question: Any, budget: Any = None, method: Any = None, limits: InputLimits = LIMITS,
             name: str | None = None, default_budget: Budget | None = DEFAULT_BUDGET) -> CheckedRequest:
    """Check a whole request in one fixed order (budget, method, question, visual), so a request with
    several problems gets the same first verdict everywhere. An animated GIF / PNG path is a clip, as everywhere
    (`image` is then the checked `Clip`, `info` None). Raises InputError."""
    from ..validation.clips import check_clip
    from ..video.animation import animated_notes
    from ..video.reading import is_clip_path

    checked_budget = read_budget(budget, default_budget, limits)
    checked_method = check_method(method)
    text, notes = check_question(question, limits)
    if is_clip_path(image):
        return CheckedRequest(checked_budget, checked_method, text, check_clip(image, limits, name), None,
                              notes + animated_notes(image))
    picture, info = check_image(image, limits, name)
    return CheckedRequest(checked_budget, checked_method, text, picture, info, notes + info.notes)


__all__ = ["CheckedRequest", "LOOKS_REFUSAL", "Pruning", "check_encode", "check_for_video", "check_method",
           "expand_budgets", "video_refusal",
           "read_budgets", "uses_layer", "validate"]

