"""One request of the microscope: the baseline run, configs A and B, and what the page shows of them.

`ask` checks the inputs (`microscope.inputs`, i.e. the library's one validator, and `microscope.configs`
for the encoding and layer choices), admits the request by its image's pixels (`microscope.admission`),
runs the same VLM up to three times, one instrumented `generate()` each (method="none": every visual
token; then config A: the chosen method, layer and encoding; then config B: ARR-COC with its own layer
and encoding), counts their FLOPs off the clock (`microscope.cost`), draws the pictures with
`arr_coc.viz`, and writes them and the JSON trace (`microscope.readout`) into a fresh folder. It never
raises: a bad input or a failure comes back as `Result.error`, and a failing pruned run falls back to
the baseline.

Run inside `arr_coc.cancel.cancellable(token)` (the page does), a cancelled request stops at the
next step boundary: after decoding, when it gets the model, inside each run (after the gist, the
vision tower, the selection, the prefill and each generated token) and between the runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arr_coc.answer_notes import empty_answer_notes
from arr_coc.inputs import LIMITS, InputLimits, finish_image
from microscope.admission import Admission
from microscope.configs import RunConfig, read_configs
from microscope.inputs import InputError, check_method, check_question, open_upload, read_budget, read_flag, reason
from microscope.readout import stats_rows, trace_record

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc import ARRCOCQwen, Trace
    from arr_coc.budget import Budget
    from arr_coc.qwen.encoding import EncodeConfig
    from microscope.cost import Flops

logger = logging.getLogger("arr_coc.app")

# Each request writes its pictures and trace into its own folder here; Gradio copies them into its cache
# atomically. (Returning PIL images instead makes Gradio rewrite one content-addressed cache file in place for
# identical pictures, so a client still downloading it from a concurrent request can get a truncated file.)
OUTPUT_ROOT = os.path.join(tempfile.gettempdir(), "arr_coc_app")
OUTPUT_MAX_AGE_S = 3600

OUTPUT_NAMES = ("answer_baseline", "answer_arr", "answer_compare", "stats", "heatmap", "resolution_a",
                "resolution_b", "maps", "weights", "channels", "trace", "error")


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
    more_layers: dict[str, ARRCOCQwen] = field(default_factory=dict)   # --compare-arr-coc, by name (configs.py)
    count_flops: bool = True         # count each run's FLOPs off the clock (microscope.cost); --no-flops: off
    flops_memo: dict = field(default_factory=dict)                      # shape-only counts, shared by requests
    before_layer: str | None = None  # the layer trained for encode="before" (embedded model), by name, if offered

    @property
    def cell_px(self) -> int:
        """Pixels per merged visual token side (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        from arr_coc.qwen.processing import image_processor_of

        return int(image_processor_of(self.wrapper.processor).patch_size) * int(self.wrapper.merge)

    @property
    def layers(self) -> dict[str, ARRCOCQwen]:
        """Every ARR-COC layer the server offers, by name, the --arr-coc one first (one VLM under all)."""
        return {self.layer_name: self.wrapper, **self.more_layers}

    @property
    def default_compare(self) -> tuple[str, str]:
        """Config B when a request does not say: the shipped layer trained for encode="before", encoding before
        (the embedded model's default: after vs. before, each with its own layer); else the first
        --compare-arr-coc layer, encoding after like A's default (compare checkpoints); without one, the same
        layer encoding before (compare the modes)."""
        if self.before_layer in self.more_layers:
            return self.before_layer, "before"
        return (next(iter(self.more_layers)), "after") if self.more_layers else (self.layer_name, "before")


@dataclass
class Run:
    """One instrumented generate() call."""

    answer: str
    trace: Trace
    counted: Any = None              # the CountedSelector it ran (FLOPs), or None
    flops: Flops | None = None       # filled off the clock by microscope.cost


@dataclass
class Pruned:
    """A configuration's run: its answer and trace, or (run None) why it failed and fell back to the baseline."""

    config: RunConfig
    run: Run | None
    failed: str | None = None


@dataclass
class Result:
    """Everything one request shows; `outputs()` orders it as the `ask` event returns it."""

    answer_baseline: str = ""
    answer_arr: str = ""
    answer_compare: str = ""
    stats: list[list[str]] = field(default_factory=list)
    heatmap: str | None = None     # PNG path (pictures are files: see OUTPUT_ROOT)
    resolution_a: str | None = None  # PNG path: what config A encoded at which resolution (with its legend)
    resolution_b: str | None = None  # the same for config B
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
OFF_ANSWER = "(ARR-COC is off: only the baseline ran)"
NO_COMPARE = "(config B is off)"


def ask(scope: Microscope, image: Any, question: Any, arr_coc: Any = True, budget: Any = None,
        adaptive: Any = False, method: Any = "arr_coc", encode: Any = None, layer: Any = None,
        compare_layer: Any = None, compare_encode: Any = None, gist: Any = None, margin: Any = None,
        periphery: Any = None, looks: Any = None, threshold: Any = None) -> Result:
    """The `ask` event: never raises; problems come back as `Result.error` (shown in the page).

    `budget` is what the page or an API client sent: a share (0.25, "0.25", "10%") or a token count
    (64, "64", "64tok"), read by `arr_coc.budget.parse_budget`. Every input but the image and the
    question is optional: None means the page's default (ARR-COC on, the library's budget, not adaptive,
    arr_coc, config A encoding after with the first layer, config B as `Microscope.default_compare`,
    no gist, no margin, no periphery, one look). `looks` (1-3) and `threshold` are the before mode's saccades
    (`arr_coc.saccade`): with more than one look, an answer whose first token's uncertainty is above the
    threshold looks again, adding cells; every look is in the table, the trace and the FLOPs.
    """
    from arr_coc.cancel import Cancelled

    try:
        return _ask(scope, image, question, arr_coc, budget, adaptive, method,
                    (encode, layer, compare_layer, compare_encode, gist, margin, periphery, looks, threshold))
    except InputError as exc:
        return Result(error=f"**Error:** {exc}")
    except Cancelled:
        logger.info("a request was cancelled; its work stopped")
        return Result(error=CANCELLED)
    except Exception as exc:  # noqa: BLE001 - keep serving, say what happened
        logger.exception("ask failed")
        return Result(error=f"**Error:** the request failed ({reason(exc)}). Try another image or question; "
                            "if it keeps failing, restart the app and report the trace in the server log.")


def _generate(scope: Microscope, wrapper: ARRCOCQwen, image: Image, question: str, method: str,
              budget: Budget | None, encode: EncodeConfig | None = None) -> Run:
    from arr_coc.cancel import checkpoint
    from arr_coc.selection import get_selector

    counted = None
    if scope.count_flops and method != "none":   # runs the selector as is; its FLOPs are counted afterwards
        from arr_coc.evaluation.flops import CountedSelector

        counted = CountedSelector(get_selector(method), method)
    while not scope.lock.acquire(timeout=0.1):   # a cancelled request stops waiting for the model
        checkpoint("waiting for the model")
    try:
        checkpoint("waiting for the model")
        answer, trace = wrapper.generate(image, question, budget=budget, method=counted or method,
                                         max_new_tokens=scope.max_new_tokens, encode=encode)
    finally:
        scope.lock.release()
    return Run(answer=str(answer).strip(), trace=trace, counted=counted)


def _ask(scope: Microscope, image: Any, question: Any, arr_on: Any, budget: Any, adaptive: Any,
         method: Any, choices: tuple) -> Result:
    # the validator's order (arr_coc.inputs.validate): budget, method, question, image; the configs after the method
    arr_on = read_flag(arr_on, "arr_coc", True)
    adaptive = read_flag(adaptive, "adaptive", False)
    budget = read_budget(budget)
    method = check_method(method)
    notes: list[str] = []
    configs = read_configs(scope, method, *choices, notes=notes)
    question, q_notes = check_question(question, scope.limits)
    opened = open_upload(image, scope.limits)
    try:
        with scope.admission.admit(opened.pixels):
            return _answer(scope, opened, question, arr_on, budget, adaptive, method, configs, q_notes + notes)
    finally:
        opened.close()


def _answer(scope: Microscope, opened: Any, question: str, arr_on: bool, budget: Budget, adaptive: bool,
            method: str, configs: list[RunConfig], notes: list[str]) -> Result:
    from arr_coc.cancel import Cancelled, checkpoint

    picture, info = finish_image(opened, scope.limits)
    notes = notes + info.notes
    checkpoint("decoding")
    try:
        base = _generate(scope, scope.wrapper, picture, question, "none", 1.0)
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001
        logger.exception("baseline generate failed")
        raise InputError(f"The model could not answer on this input ({reason(exc)}).")
    checkpoint("the baseline run")

    pruned: list[Pruned] = []
    for config in configs if arr_on else []:
        pruned.append(_run_pruned(scope, config, picture, question, budget, adaptive, base, notes,
                                  labelled=len(configs) > 1))
        checkpoint(f"config {config.label}")
    # issue 39: an empty answer is said of the run(s) that gave it, not of all three
    notes += empty_answer_notes({"the baseline": base.answer, **{f"config {p.config.label}": p.run.answer
                                                                 for p in pruned if p.run is not None}},
                                question, scope.wrapper.tokenizer)
    _count_flops(scope, picture, question, base, pruned)
    first = pruned[0] if pruned else None
    heatmap, maps, channels, weights_md = _pictures(scope, picture, method, first.run if first else None, notes)
    resolution = [_resolution(scope, picture, p) if p.run is not None else None for p in pruned] + [None, None]
    record = trace_record(scope, question, info, method, budget, adaptive, arr_on, base, pruned, notes)
    folder = request_folder()

    def answer_of(k: int) -> str:
        if not arr_on:
            return OFF_ANSWER
        if k >= len(pruned):
            return NO_COMPARE
        return pruned[k].run.answer if pruned[k].run is not None else base.answer

    return Result(
        answer_baseline=base.answer,
        answer_arr=answer_of(0),
        answer_compare=answer_of(1),
        stats=stats_rows(base, pruned),
        heatmap=_save_png(heatmap, folder, "heatmap") if heatmap is not None else None,
        resolution_a=_save_png(resolution[0], folder, "resolution_a") if resolution[0] is not None else None,
        resolution_b=_save_png(resolution[1], folder, "resolution_b") if resolution[1] is not None else None,
        maps=[(_save_png(im, folder, f"map_{k}_{cap.split()[0]}"), cap) for k, (im, cap) in enumerate(maps)],
        weights=weights_md,
        channels=[(_save_png(im, folder, f"channel_{k:02d}_{name}"), name) for k, (im, name) in enumerate(channels)],
        trace=write_trace(record, folder),
        error="\n\n".join(f"**Note:** {n}" for n in notes),
        record=record,
    )


def _run_pruned(scope: Microscope, config: RunConfig, picture: Image, question: str, budget: Budget,
                adaptive: bool, base: Run, notes: list[str], labelled: bool) -> Pruned:
    """One configuration's run; when it fails, why (its column then shows the baseline). Notes for the user."""
    from arr_coc.budget import budget_label
    from arr_coc.cancel import Cancelled
    from microscope.configs import wrapper_of

    who = f"Config {config.label}: " if labelled else ""
    method, selector, arr_budget = config.method, config.method, budget
    if adaptive and method == "arr_coc":
        selector, arr_budget = "arr_coc_adaptive", None
    elif adaptive:
        notes.append(f"{who}Adaptive budgets belong to ARR-COC; method {method!r} used the fixed budget "
                     f"{budget_label(budget)}.")
    try:
        run = _generate(scope, wrapper_of(scope, config), picture, question, selector, arr_budget, config.encode)
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001 - ARR-COC must never cost the user the answer
        logger.exception("config %s failed; falling back to the baseline", config.label)
        notes.append(f"{who}ARR-COC failed ({reason(exc)}): its column shows the baseline answer "
                     f"(all {base.trace.total_tokens} visual tokens).")
        return Pruned(config, None, reason(exc))
    if selector == "arr_coc_adaptive":
        run.trace.budget = "adaptive"
        run.trace.method = "arr_coc"
    fb = [f for f in run.trace.fallback if f]
    if "keep_all" in fb or run.trace.error:
        why = run.trace.error or "keep_all"
        notes.append(f"{who}ARR-COC fell back to the baseline path for this image ({why}): "
                     f"it kept all {run.trace.total_tokens} visual tokens.")
    elif "grid" in fb:
        notes.append(f"{who}Low-structure image: ARR-COC spread its tokens over an even grid instead of top-k.")
    return Pruned(config, run)


def _count_flops(scope: Microscope, picture: Image, question: str, base: Run, pruned: list[Pruned]) -> None:
    """Each run's FLOPs (microscope.cost), off the clock and under the model lock; skipped for a cancelled
    request (nobody waits for it) and when the server counts none. A count that fails is left out, logged."""
    from arr_coc.cancel import current_token
    from microscope import cost

    token = current_token()
    if not scope.count_flops or (token is not None and token.cancelled):
        return
    runs = [(scope.wrapper, base, 0.0)] + [(scope.layers[p.config.layer], p.run, p.config.encode.gist)
                                            for p in pruned if p.run is not None]
    with scope.lock:
        try:
            inputs = cost.build_inputs(scope.wrapper, picture, question)
            for wrapper, run, gist in runs:
                run.flops = cost.count_run(wrapper, inputs, run.trace, run.counted, cost.trim(scope.flops_memo), gist)
        except Exception:  # noqa: BLE001 - the answers stand without their FLOPs
            logger.exception("counting FLOPs failed; the page shows '-'")
        finally:
            for _, run, _ in runs:
                run.counted = None   # the selector's context (images, tensors) is not kept past the request


def _pictures(scope: Microscope, picture: Image, method: str, arr: Run | None, notes: list[str]):
    """(heatmap, scorer maps, texture channels, balancer weights as markdown) of config A, drawn on the image
    exactly as the processor resized it (one cell per merged token)."""
    from arr_coc import viz

    if arr is None:
        return None, [], [], ""
    out = arr.trace.arr_coc
    out = None if out is None else out.cpu()   # the maps stay on the VLM's device until drawn
    maps, channels, weights_md = [], [], ""
    grid = arr.trace.grid_hw[0]
    shown = _shown(scope, picture, grid)
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


def _shown(scope: Microscope, picture: Image, grid: tuple[int, int]) -> Image:
    """The image as the processor resized it: one cell_px square per merged token."""
    return picture.resize((grid[1] * scope.cell_px, grid[0] * scope.cell_px))


def _resolution(scope: Microscope, picture: Image, p: Pruned) -> Image:
    """What config p encoded at which resolution (viz.resolution_picture of Trace.resolution), titled."""
    from arr_coc import viz

    t = p.run.trace
    tokens = t.periphery_cells[0] if t.periphery_cells else None
    return viz.resolution_picture(_shown(scope, picture, t.grid_hw[0]), t.resolution(0), t.grid_hw[0], tokens,
                                  title=f"{p.config.label}: {t.method}, encode {p.config.encode_text()}")


# ----------------------------------------------------------------------------- what the page shows


def _weights_markdown(weights: dict[str, float]) -> str:
    if not weights:
        return ""
    rows = "\n".join(f"| {name} | {w:.3f} |" for name, w in weights.items())
    return ("**Balancer weights** (relevance = sum of weight x map / 3)\n\n| scorer | weight |\n| --- | --- |\n" + rows)


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
