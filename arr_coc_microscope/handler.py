"""One request of the microscope, about an image or a clip: the baseline run, configs A and B, and what the page
shows of them.

`ask` checks the inputs (`arr_coc_microscope.inputs`, i.e. the library's one validator, and `.configs` for the
encoding and layer choices), admits the request by its pixels (`.admission`), runs the same VLM up to
three times through the pipeline (`ARRCOC.respond`: method="none", every visual token; then config A: the
chosen method, layer and encoding; then config B: ARR-COC with its own layer and encoding), counts their FLOPs
off the clock (`arr_coc.evaluation.cost`, as `eval` counts them), draws the pictures (`.pictures`) and
writes them and the JSON trace (`.readout`) into a fresh folder. A clip is a request like any other: it
replaces the image, its units are its temporal groups, and the pictures show them side by side. It never raises:
a bad input or a failure comes back as `Result.error`, and a failing pruned run falls back to the baseline.

Run inside `arr_coc.cancel.cancellable(token)` (the page does), a cancelled request stops at the next step
boundary: after decoding, when it gets the model, inside each run (after the gist, the vision tower, the
selection, the prefill and each generated token) and between the runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arr_coc.answer_notes import empty_answer_notes
from arr_coc_microscope.asked import Asked, open_asked
from arr_coc_microscope.configs import RunConfig, read_configs
from arr_coc_microscope.inputs import InputError, check_method, check_question, read_budget, read_flag, reason
from arr_coc_microscope.readout import stats_rows, trace_record
from arr_coc_microscope.scope import MEMO_LIMIT, Microscope, Pruned, Run  # noqa: F401 - re-exported: its types

if TYPE_CHECKING:
    from arr_coc import ARRCOC
    from arr_coc.budget import Budget
    from arr_coc.pipeline import Pruning

logger = logging.getLogger("arr_coc.app")

# Each request writes its pictures and trace into its own folder here; Gradio copies them into its cache
# atomically. (Returning PIL images instead makes Gradio rewrite one content-addressed cache file in place for
# identical pictures, so a client still downloading it from a concurrent request can get a truncated file.)
OUTPUT_ROOT = os.path.join(tempfile.gettempdir(), "arr_coc_app")
OUTPUT_MAX_AGE_S = 3600

OUTPUT_NAMES = ("answer_baseline", "answer_arr", "answer_compare", "stats", "heatmap", "resolution_a",
                "resolution_b", "maps", "weights", "channels", "trace", "error")


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
        periphery: Any = None, looks: Any = None, threshold: Any = None, video: Any = None) -> Result:
    """The `ask` event: never raises; problems come back as `Result.error` (shown in the page).

    `budget` is what the page or an API client sent: a share (0.25, "0.25", "10%") or a token count
    (64, "64", "64tok"), read by `arr_coc.budget.parse_budget`. Every input but the image (or `video`, a clip
    that replaces it) and the question is optional: None means the page's default (ARR-COC on, the library's
    budget, not adaptive, arr_coc, config A encoding after with the first layer, config B as
    `Microscope.default_compare`, no gist, no margin, no periphery, one look). `looks` (1-3) and `threshold` are
    the before mode's saccades (`arr_coc.saccade`): with more than one look, an answer whose first token's
    uncertainty is above the threshold looks again, adding cells; every look is in the table, the trace and
    the FLOPs.
    """
    from arr_coc.cancel import Cancelled

    try:
        return _ask(scope, image, question, arr_coc, budget, adaptive, method,
                    (encode, layer, compare_layer, compare_encode, gist, margin, periphery, looks, threshold), video)
    except InputError as exc:
        return Result(error=f"**Error:** {exc}")
    except Cancelled:
        logger.info("a request was cancelled; its work stopped")
        return Result(error=CANCELLED)
    except Exception as exc:  # noqa: BLE001 - keep serving, say what happened
        logger.exception("ask failed")
        return Result(error=f"**Error:** the request failed ({reason(exc)}). Try another image or question; "
                            "if it keeps failing, restart the app and report the trace in the server log.")


@dataclass
class _Request:
    """A request's settings, read once."""

    question: str
    arr_on: bool
    budget: Budget
    adaptive: bool
    method: str
    configs: list[RunConfig]
    notes: list[str]


def _ask(scope: Microscope, image: Any, question: Any, arr_on: Any, budget: Any, adaptive: Any,
         method: Any, choices: tuple, video: Any = None) -> Result:
    # the validator's order (arr_coc.pipeline.request.validate): budget, method, question, visual; configs after
    arr_on = read_flag(arr_on, "arr_coc", True)
    adaptive = read_flag(adaptive, "adaptive", False)
    budget = read_budget(budget)
    method = check_method(method)
    notes: list[str] = []
    configs = read_configs(scope, method, *choices, notes=notes)
    question, q_notes = check_question(question, scope.limits)
    asked = open_asked(image, video, scope.limits, scope.vlm_for(None, "clip").video_sampling())
    if asked.kind == "clip":
        configs = _for_a_clip(method, configs, notes)
    request = _Request(question, arr_on, budget, adaptive, method, configs, q_notes + notes)
    try:
        with scope.admission.admit(asked.pixels):
            return _answer(scope, asked, request)
    finally:
        asked.close()


def _for_a_clip(method: str, configs: list[RunConfig], notes: list[str]) -> list[RunConfig]:
    """A clip's configs: a method that cannot be given a clip is refused; more than one look becomes one, said."""
    from arr_coc.pipeline.selection import method_info
    from arr_coc.saccade import SaccadeConfig

    if method != "none" and not method_info(method).video:
        from arr_coc.pipeline.selection import video_methods

        raise InputError(f"Method {method!r} cannot prune a video (it reads the unpruned prompt's layout); choose "
                         f"{', '.join(video_methods())} for a clip.", "method")
    if any(c.encode.passes > 1 for c in configs):   # a saccade adds cells of an image (arr_coc.pipeline.looks)
        configs = [dataclasses.replace(c, encode=dataclasses.replace(c.encode, saccade=SaccadeConfig()))
                   for c in configs]
        notes.append("Looks again (saccades) apply to images: the clip was answered with one look.")
    return configs


def _answer(scope: Microscope, asked: Asked, request: _Request) -> Result:
    from arr_coc.cancel import Cancelled, checkpoint
    from arr_coc.pipeline import Pruning

    notes = request.notes + asked.finish(scope.limits)
    checkpoint("decoding")
    try:
        base = _generate(scope, scope.vlm_for(None, asked.kind), asked, request.question, Pruning.of("none"))
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001
        logger.exception("baseline generate failed")
        raise InputError(f"The model could not answer on this input ({reason(exc)}).")
    checkpoint("the baseline run")
    pruned: list[Pruned] = []
    for config in request.configs if request.arr_on else []:
        pruned.append(_run_pruned(scope, config, asked, request, base, notes, labelled=len(request.configs) > 1))
        checkpoint(f"config {config.label}")
    # issue 39: an empty answer is said of the run(s) that gave it, not of all three
    notes += empty_answer_notes({"the baseline": base.answer, **{f"config {p.config.label}": p.run.answer
                                                                 for p in pruned if p.run is not None}},
                                request.question, scope.vlm.tokenizer)
    if asked.kind == "clip":
        notes.append(f"A video: {asked.clip.num_frames} frames sampled, {len(base.trace.kept_per_image)} temporal "
                     f"groups, answered by {scope.model_for('clip')}.")
    notes += list(dict.fromkeys(n for p in pruned if p.run is not None for n in p.run.trace.notes))
    _count_flops(scope, base, pruned)
    return _result(scope, asked, request, base, pruned, notes)


def _result(scope: Microscope, asked: Asked, request: _Request, base: Run, pruned: list[Pruned],
            notes: list[str]) -> Result:
    """What the page shows: answers, the table, the pictures and the trace, written into a fresh folder."""
    from arr_coc_microscope import pictures

    first = pruned[0].run if pruned else None
    heatmap = pictures.relevance(asked, first.trace, scope.cell_px) if first is not None else None
    maps, channels, weights = pictures.layer_maps(first.trace) if first is not None else ([], [], "")
    chose = first is not None and first.trace.kept_tokens < first.trace.total_tokens   # a budget of every token: none
    if chose and first.trace.arr_coc is None and request.method != "none":
        notes.append(f"Method {request.method!r} has no relevance maps: the picture shows its kept tokens only.")
    resolution = [pictures.resolution(asked, p.run.trace, scope.cell_px, _title(p)) if p.run is not None else None
                  for p in pruned] + [None, None]
    record = trace_record(scope, request.question, asked, request.method, request.budget, request.adaptive,
                          request.arr_on, base, pruned, notes)
    folder = request_folder()

    def answer_of(k: int) -> str:
        if not request.arr_on:
            return OFF_ANSWER
        if k >= len(pruned):
            return NO_COMPARE
        return pruned[k].run.answer if pruned[k].run is not None else base.answer

    save = lambda im, stem: _save_png(im, folder, stem) if im is not None else None  # noqa: E731
    return Result(
        answer_baseline=base.answer, answer_arr=answer_of(0), answer_compare=answer_of(1),
        stats=stats_rows(base, pruned), heatmap=save(heatmap, "heatmap"),
        resolution_a=save(resolution[0], "resolution_a"), resolution_b=save(resolution[1], "resolution_b"),
        maps=[(_save_png(im, folder, f"map_{k}_{cap.split()[0]}"), cap) for k, (im, cap) in enumerate(maps)],
        weights=weights,
        channels=[(_save_png(im, folder, f"channel_{k:02d}_{name}"), name) for k, (im, name) in enumerate(channels)],
        trace=write_trace(record, folder), error="\n\n".join(f"**Note:** {n}" for n in notes), record=record)


def _title(p: Pruned) -> str:
    return f"{p.config.label}: {p.run.trace.method}, encode {p.config.encode_text()}"


def _generate(scope: Microscope, vlm: ARRCOC, asked: Asked, question: str, pruning: Pruning) -> Run:
    """One pipeline call under the model lock; its selector counts its FLOPs afterwards when the server counts."""
    from arr_coc.cancel import checkpoint

    counted = None
    if scope.count_flops and pruning.selector is not None:   # runs the selector as is; counted afterwards
        from arr_coc.evaluation.flops import CountedSelector

        counted = CountedSelector(pruning.selector, pruning.method)
        pruning = dataclasses.replace(pruning, selector=counted)
    while not scope.lock.acquire(timeout=0.1):   # a cancelled request stops waiting for the model
        checkpoint("waiting for the model")
    try:
        checkpoint("waiting for the model")
        got = vlm.respond([asked.visual], [question], pruning, max_new_tokens=scope.max_new_tokens)
    finally:
        scope.lock.release()
    return Run(answer=str(got.answers[0]).strip(), trace=got.traces[0], counted=counted, vlm=vlm,
               answered=got.answered)


def _run_pruned(scope: Microscope, config: RunConfig, asked: Asked, request: _Request, base: Run, notes: list[str],
                labelled: bool) -> Pruned:
    """One configuration's run; when it fails, why (its column then shows the baseline). Notes for the user."""
    from arr_coc.budget import budget_label
    from arr_coc.cancel import Cancelled
    from arr_coc.pipeline import Pruning

    who = f"Config {config.label}: " if labelled else ""
    adaptive = request.adaptive and config.method == "arr_coc"
    if request.adaptive and not adaptive:
        notes.append(f"{who}Adaptive budgets belong to ARR-COC; method {config.method!r} used the fixed budget "
                     f"{budget_label(request.budget)}.")
    try:
        pruning = Pruning.of(config.method, None if adaptive else request.budget, "adaptive" if adaptive else None,
                             config.encode, parsed=True)
        run = _generate(scope, scope.vlm_for(config.layer, asked.kind), asked, request.question, pruning)
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001 - ARR-COC must never cost the user the answer
        logger.exception("config %s failed; falling back to the baseline", config.label)
        notes.append(f"{who}ARR-COC failed ({reason(exc)}): its column shows the baseline answer "
                     f"(all {base.trace.total_tokens} visual tokens).")
        return Pruned(config, None, reason(exc))
    fb = [f for f in run.trace.fallback if f]
    if "keep_all" in fb or run.trace.error:
        why = run.trace.error or "keep_all"
        notes.append(f"{who}ARR-COC fell back to the baseline path for this image ({why}): "
                     f"it kept all {run.trace.total_tokens} visual tokens.")
    elif "grid" in fb:
        notes.append(f"{who}Low-structure image: ARR-COC spread its tokens over an even grid instead of top-k.")
    return Pruned(config, run)


def _count_flops(scope: Microscope, base: Run, pruned: list[Pruned]) -> None:
    """Each run's FLOPs (`arr_coc.evaluation.cost`), off the clock and under the model lock; skipped for a cancelled
    request (nobody waits for it) and when the server counts none. A count that fails is left out, logged."""
    from arr_coc.cancel import current_token
    from arr_coc.evaluation.cost import item_flops

    token = current_token()
    runs = [(base.vlm, base, 0.0)] + [(p.run.vlm, p.run, p.config.encode.gist)
                                      for p in pruned if p.run is not None]
    try:
        if not scope.count_flops or (token is not None and token.cancelled):
            return
        if len(scope.flops_memo) > MEMO_LIMIT:
            scope.flops_memo.clear()
        with scope.lock:
            for vlm, run, gist in runs:
                selector = run.counted.flops() if run.counted is not None else 0
                run.flops = item_flops(vlm.backend, run.answered, selector, gist, scope.flops_memo)[0]
    except Exception:  # noqa: BLE001 - the answers stand without their FLOPs
        logger.exception("counting FLOPs failed; the page shows '-'")
    finally:
        for _, run, _ in runs:   # the selector's context and the prompt's tensors are not kept past the request
            run.counted, run.answered, run.vlm = None, None, None


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


def _save_png(image: Any, folder: str, stem: str) -> str:
    path = os.path.join(folder, f"{stem}.png")
    image.save(path, format="PNG")
    return path


def write_trace(record: dict, folder: str) -> str:
    path = os.path.join(folder, "arr_coc_trace.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path
