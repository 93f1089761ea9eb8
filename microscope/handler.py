"""One request of the microscope: the baseline run, the ARR-COC run, and what the page shows of them.

`ask` checks the inputs (`microscope.inputs`, i.e. the library's one validator), admits the request by
its image's pixels (`microscope.admission`), runs the same `ARRCOCQwen` twice, one instrumented
`generate()` each (method="none": every visual token; then the chosen method), draws the pictures
with `arr_coc.viz`, and writes them and the JSON trace into a fresh folder. It never raises: a bad
input or a failure comes back as `Result.error`, and a failing ARR-COC run falls back to the baseline.

Run inside `arr_coc.cancel.cancellable(token)` (the page does), a cancelled request stops at the
next step boundary: after decoding, when it gets the model, inside each run (after the vision tower,
the selection, the prefill and each generated token) and between the runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arr_coc.inputs import LIMITS, InputLimits, answer_notes, finish_image
from microscope.admission import Admission
from microscope.inputs import ImageInfo, InputError, check_method, check_question, open_upload, read_budget, reason

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc import ARRCOCQwen, Trace
    from arr_coc.budget import Budget

logger = logging.getLogger("arr_coc.app")

# Each request writes its pictures and trace into its own folder here; Gradio copies them into its cache
# atomically. (Returning PIL images instead makes Gradio rewrite one content-addressed cache file in place for
# identical pictures, so a client still downloading it from a concurrent request can get a truncated file.)
OUTPUT_ROOT = os.path.join(tempfile.gettempdir(), "arr_coc_app")
OUTPUT_MAX_AGE_S = 3600

STATS_HEADERS = ["", "baseline", "ARR-COC"]
OUTPUT_NAMES = ("answer_baseline", "answer_arr", "stats", "heatmap", "maps", "weights", "channels", "trace", "error")


@dataclass
class Microscope:
    """What the handlers share: read-only after `microscope.server.load()` (the lock only serialises model calls)."""

    wrapper: ARRCOCQwen
    model_name: str
    methods: list[str]               # arr_coc.selection.available_methods() at start-up, "arr_coc" first
    max_new_tokens: int = 32
    layer_name: str = "untrained"    # which ARR-COC scorer weights: "trained (<folder>)" or "untrained"
    lock: threading.Lock = field(default_factory=threading.Lock)
    limits: InputLimits = LIMITS     # arr_coc.inputs.limits_for(this model's processor)
    admission: Admission = field(default_factory=Admission)

    @property
    def cell_px(self) -> int:
        """Pixels per merged visual token side (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        from arr_coc.qwen.processing import image_processor_of

        return int(image_processor_of(self.wrapper.processor).patch_size) * int(self.wrapper.merge)


@dataclass
class Run:
    """One instrumented generate() call."""

    answer: str
    trace: Trace


@dataclass
class Result:
    """Everything one request shows; `outputs()` orders it as the `ask` event returns it."""

    answer_baseline: str = ""
    answer_arr: str = ""
    stats: list[list[str]] = field(default_factory=list)
    heatmap: str | None = None     # PNG path (pictures are files: see OUTPUT_ROOT)
    maps: list[tuple[str, str]] = field(default_factory=list)        # (PNG path, caption)
    weights: str = ""
    channels: list[tuple[str, str]] = field(default_factory=list)    # (PNG path, channel name)
    trace: str | None = None       # path of the JSON trace
    error: str = ""
    record: dict[str, Any] | None = None   # the trace's content (direct callers and tests)

    def outputs(self) -> tuple:
        return tuple(getattr(self, name) for name in OUTPUT_NAMES)


# ----------------------------------------------------------------------------- the request


CANCELLED = "**Error:** the request was cancelled."


def read_flag(value: Any, name: str, default: bool) -> bool:
    """A checkbox as the page or an API client sent it: a bool, 0/1, "true"/"false"; None is the default."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise InputError(f"{name} must be true or false, not {str(value)[:40]!r}.", "flag")


def ask(scope: Microscope, image: Any, question: Any, arr_coc: Any = True, budget: Any = None,
        adaptive: Any = False, method: Any = "arr_coc") -> Result:
    """The `ask` event: never raises; problems come back as `Result.error` (shown in the page).

    `budget` is what the page or an API client sent: a share (0.25, "0.25", "10%") or a token count
    (64, "64", "64tok"), read by `arr_coc.budget.parse_budget`. Every input but the image and the
    question is optional: None means its default (ARR-COC on, the library's budget, not adaptive, arr_coc).
    """
    from arr_coc.cancel import Cancelled

    try:
        return _ask(scope, image, question, arr_coc, budget, adaptive, method)
    except InputError as exc:
        return Result(error=f"**Error:** {exc}")
    except Cancelled:
        logger.info("a request was cancelled; its work stopped")
        return Result(error=CANCELLED)
    except Exception as exc:  # noqa: BLE001 - keep serving, say what happened
        logger.exception("ask failed")
        return Result(error=f"**Error:** the request failed ({reason(exc)}). Try another image or question; "
                            "if it keeps failing, restart the app and report the trace in the server log.")


def _generate(scope: Microscope, image: Image, question: str, method: Any, budget: Budget | None) -> Run:
    from arr_coc.cancel import checkpoint

    while not scope.lock.acquire(timeout=0.1):   # a cancelled request stops waiting for the model
        checkpoint("waiting for the model")
    try:
        checkpoint("waiting for the model")
        answer, trace = scope.wrapper.generate(image, question, budget=budget, method=method,
                                               max_new_tokens=scope.max_new_tokens)
    finally:
        scope.lock.release()
    return Run(answer=str(answer).strip(), trace=trace)


def _ask(scope: Microscope, image: Any, question: Any, arr_on: Any, budget: Any, adaptive: Any,
         method: Any) -> Result:
    # the validator's order (arr_coc.inputs.validate): budget, method, question, image
    arr_on = read_flag(arr_on, "arr_coc", True)
    adaptive = read_flag(adaptive, "adaptive", False)
    budget = read_budget(budget)
    method = check_method(method)
    question, notes = check_question(question, scope.limits)
    opened = open_upload(image, scope.limits)
    try:
        with scope.admission.admit(opened.pixels):
            return _answer(scope, opened, question, arr_on, budget, adaptive, method, notes)
    finally:
        opened.close()


def _answer(scope: Microscope, opened: Any, question: str, arr_on: bool, budget: Budget, adaptive: bool,
            method: str, notes: list[str]) -> Result:
    from arr_coc.cancel import Cancelled, checkpoint

    picture, info = finish_image(opened, scope.limits)
    notes = notes + info.notes
    checkpoint("decoding")
    try:
        base = _generate(scope, picture, question, "none", 1.0)
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001
        logger.exception("baseline generate failed")
        raise InputError(f"The model could not answer on this input ({reason(exc)}).")
    checkpoint("the baseline run")
    notes += answer_notes(base.answer, question, scope.wrapper.tokenizer)

    arr, arr_failed = (_run_pruned(scope, picture, question, method, budget, adaptive, base, notes)
                       if arr_on else (None, None))
    checkpoint("the pruned run")
    heatmap, maps, channels, weights_md = _pictures(scope, picture, method, arr, notes)
    answer_arr = arr.answer if arr is not None else (base.answer if arr_failed else "")
    record = trace_record(scope, question, info, method, budget, adaptive, arr_on, base, arr, arr_failed, notes)
    folder = request_folder()
    return Result(
        answer_baseline=base.answer,
        answer_arr=answer_arr if arr_on else "(ARR-COC is off: only the baseline ran)",
        stats=stats_rows(base, arr),
        heatmap=_save_png(heatmap, folder, "heatmap") if heatmap is not None else None,
        maps=[(_save_png(im, folder, f"map_{k}_{cap.split()[0]}"), cap) for k, (im, cap) in enumerate(maps)],
        weights=weights_md,
        channels=[(_save_png(im, folder, f"channel_{k:02d}_{name}"), name) for k, (im, name) in enumerate(channels)],
        trace=write_trace(record, folder),
        error="\n\n".join(f"**Note:** {n}" for n in notes),
        record=record,
    )


def _run_pruned(scope: Microscope, picture: Image, question: str, method: str, budget: Budget, adaptive: bool,
                base: Run, notes: list[str]) -> tuple[Run | None, str | None]:
    """The pruned run -> (run, None), or (None, why) when it failed; what the user should know goes to notes."""
    from arr_coc.budget import budget_label
    from arr_coc.cancel import Cancelled

    selector, arr_budget = method, budget
    if adaptive and method == "arr_coc":
        selector, arr_budget = "arr_coc_adaptive", None
    elif adaptive:
        notes.append(f"Adaptive budgets belong to ARR-COC; method {method!r} used the fixed budget "
                     f"{budget_label(budget)}.")
    try:
        arr = _generate(scope, picture, question, selector, arr_budget)
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001 - ARR-COC must never cost the user the answer
        logger.exception("ARR-COC generate failed; falling back to the baseline")
        notes.append(f"ARR-COC failed ({reason(exc)}): the ARR-COC column shows the baseline answer "
                     f"(all {base.trace.total_tokens} visual tokens).")
        return None, reason(exc)
    if selector == "arr_coc_adaptive":
        arr.trace.budget = "adaptive"
        arr.trace.method = "arr_coc"
    fb = [f for f in arr.trace.fallback if f]
    if "keep_all" in fb or arr.trace.error:
        why = arr.trace.error or "keep_all"
        notes.append(f"ARR-COC fell back to the baseline path for this image ({why}): "
                     f"it kept all {arr.trace.total_tokens} visual tokens.")
    elif "grid" in fb:
        notes.append("Low-structure image: ARR-COC spread its tokens over an even grid instead of top-k.")
    return arr, None


def _pictures(scope: Microscope, picture: Image, method: str, arr: Run | None, notes: list[str]):
    """(heatmap, scorer maps, texture channels, balancer weights as markdown), drawn on the image exactly
    as the processor resized it (one cell per merged token)."""
    from arr_coc import viz

    if arr is None:
        return None, [], [], ""
    out = arr.trace.arr_coc
    maps, channels, weights_md = [], [], ""
    grid = arr.trace.grid_hw[0]
    shown = picture.resize((grid[1] * scope.cell_px, grid[0] * scope.cell_px))
    if out is not None and getattr(out, "relevance", None) is not None and out.information is not None:
        heatmap = viz.overlay_heatmap(shown, out)
        maps = viz.scorer_maps(out)
        weights_md = _weights_markdown(viz.balancer_weights(out))
    else:
        heatmap = viz.outline_kept(shown, arr.trace.kept_indices[0], grid)
    if out is not None and out.texture is not None:
        channels = viz.texture_gallery(out)
    if out is None and method != "none":
        notes.append(f"Method {method!r} has no relevance maps: the heatmap shows its kept tokens only.")
    return heatmap, maps, channels, weights_md


# ----------------------------------------------------------------------------- what the page shows


def _weights_markdown(weights: dict[str, float]) -> str:
    if not weights:
        return ""
    rows = "\n".join(f"| {name} | {w:.3f} |" for name, w in weights.items())
    return ("**Balancer weights** (relevance = sum of weight x map / 3)\n\n| scorer | weight |\n| --- | --- |\n" + rows)


def _ms(seconds: float) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{1000 * seconds:.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b and math.isfinite(a) and math.isfinite(b) and b > 0 else "-"


def kept_per_budget(t: Trace) -> str:
    """1.00x, or how the trained layer scaled this question's budget (more cells relevant, more tokens)."""
    from arr_coc.budget import resolve_count

    if isinstance(t.budget, bool) or not isinstance(t.budget, (int, float)) or not t.total_tokens:
        return "-"  # adaptive: no budget to compare with
    return f"{t.kept_tokens / resolve_count(t.budget, t.total_tokens):.2f}x"


def stats_rows(base: Run, arr: Run | None) -> list[list[str]]:
    b = base.trace
    a = arr.trace if arr is not None else None
    col = (lambda f: f(a)) if a is not None else (lambda f: "-")
    return [
        ["method", "none (all tokens)", col(lambda t: str(t.method))],
        ["budget", "1.0", col(lambda t: str(t.budget))],
        ["visual tokens (total)", str(b.total_tokens), col(lambda t: str(t.total_tokens))],
        ["visual tokens (kept)", str(b.kept_tokens),
         col(lambda t: f"{t.kept_tokens} ({100 * t.kept_ratio:.0f}%)")],
        ["kept / budget", "-", col(kept_per_budget)],
        ["prompt tokens", str(b.prompt_tokens), col(lambda t: str(t.prompt_tokens))],
        ["vision tower (ms)", _ms(b.vision_s), col(lambda t: _ms(t.vision_s))],
        ["selection (ms)", _ms(b.select_s), col(lambda t: _ms(t.select_s))],
        ["prefill (ms)", _ms(b.prefill_s), col(lambda t: _ms(t.prefill_s))],
        ["total (ms)", _ms(b.total_s), col(lambda t: _ms(t.total_s))],
        ["prefill speedup", "1.00x", col(lambda t: _ratio(b.prefill_s, t.prefill_s))],
        ["total speedup", "1.00x", col(lambda t: _ratio(b.total_s, t.total_s))],
        ["new tokens", str(b.new_tokens), col(lambda t: str(t.new_tokens))],
    ]


def _grid_list(t: Any, h: int, w: int) -> list[list[float]]:
    return [[round(float(x), 4) for x in row] for row in t[0, :h, :w].tolist()]


def trace_record(scope: Microscope, question: str, info: ImageInfo, method: str, budget: Budget, adaptive: bool,
                 arr_on: bool, base: Run, arr: Run | None, arr_failed: str | None, notes: list[str]) -> dict:
    """The downloadable trace: request, image handling, both runs, and ARR-COC's maps and decisions."""
    record: dict[str, Any] = {
        "model": scope.model_name,
        "arr_coc_layer": scope.layer_name,
        "question": question,
        "request": {"arr_coc": arr_on, "method": method, "budget": budget, "adaptive": adaptive},
        "image": {"original_size": list(info.original_size or ()), "used_size": list(info.used_size or ()),
                  "mode": info.mode, "format": info.format, "frames": info.frames},
        "notes": notes,
        "baseline": {"answer": base.answer, **base.trace.to_dict()},
        "arr_coc": None,
    }
    if arr_failed is not None:
        record["arr_coc"] = {"failed": arr_failed, "answer": base.answer, "fell_back_to": "baseline"}
    if arr is not None:
        t = arr.trace
        entry = {"answer": arr.answer, **t.to_dict(), "kept_indices": [k.tolist() for k in t.kept_indices]}
        out = t.arr_coc
        if out is not None and getattr(out, "relevance", None) is not None:
            h, w = out.grid_hw[0]
            maps = {name: _grid_list(getattr(out, name), h, w)
                    for name in ("relevance", "information", "perspectival", "participatory")
                    if getattr(out, name, None) is not None}
            from arr_coc import viz

            entry["layer"] = {"grid_hw": [h, w], "weights": viz.balancer_weights(out),
                              "channel_names": list(out.channel_names or []), "fallback": out.fallback[0],
                              "error": out.errors[0], "maps": maps}
        record["arr_coc"] = entry
    return record


# ----------------------------------------------------------------------------- files


def request_folder() -> str:
    """A fresh folder for one request's files under OUTPUT_ROOT; folders older than an hour are removed."""
    os.makedirs(OUTPUT_ROOT, exist_ok=True)
    now = time.time()
    try:
        for name in os.listdir(OUTPUT_ROOT):
            path = os.path.join(OUTPUT_ROOT, name)
            if now - os.path.getmtime(path) > OUTPUT_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass  # another request is pruning at the same time
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=OUTPUT_ROOT)


def _save_png(image: Image, folder: str, stem: str) -> str:
    path = os.path.join(folder, f"{stem}.png")
    image.save(path, format="PNG")
    return path


def write_trace(record: dict, folder: str) -> str:
    path = os.path.join(folder, "arr_coc_trace.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path
