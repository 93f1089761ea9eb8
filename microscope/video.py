"""The microscope on a video clip: the baseline and the configs side by side, one strip per temporal group.

`ask_video` is the `ask` event when a clip was uploaded (it replaces the image). The clip goes through the one
validator (`arr_coc.inputs.check_clip`: frame count, pixels, a damaged file refused with what to do), sampled
by the model's own rule; the baseline reads every token, config A (and B) spend one budget over the whole clip
(`arr_coc.temporal`). What the page shows:

- the answers, and a table: visual tokens kept, tokens per temporal group, vision tower, ARR-COC's own work,
  LM prefill and the whole prefill (wall time; FLOPs are counted for images only, said in a note);
- "relevance + kept tokens": config A's relevance over each group's first frame with its kept cells outlined,
  the groups side by side in time order;
- "encoded at which resolution", per config: each group's cells tinted by what they became (before mode: the
  tower never saw the rest);
- the trace (JSON): both runs' traces with the per-group decisions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from arr_coc.inputs import check_clip
from microscope.configs import RunConfig, read_configs
from microscope.inputs import InputError, check_method, check_question, read_budget, read_flag, reason

if TYPE_CHECKING:
    from PIL.Image import Image

    from microscope.handler import Microscope, Result, Run

logger = logging.getLogger(__name__)

STRIP_HEIGHT = 160   # px per group picture in the strips


def ask_video(scope: Microscope, video: Any, question: Any, arr_on: Any = True, budget: Any = None,
              method: Any = "arr_coc", choices: tuple = ()) -> Result:
    """Never raises: problems come back as `Result.error`, as for images."""
    from arr_coc.cancel import Cancelled
    from microscope.handler import CANCELLED, Result

    try:
        return _ask_video(scope, video, question, arr_on, budget, method, choices)
    except InputError as exc:
        return Result(error=f"**Error:** {exc}")
    except Cancelled:
        return Result(error=CANCELLED)
    except Exception as exc:  # noqa: BLE001 - keep serving, say what happened
        logger.exception("ask on a video failed")
        return Result(error=f"**Error:** the request failed ({reason(exc)}). Try another clip or question.")


def _ask_video(scope: Microscope, video: Any, question: Any, arr_on: Any, budget: Any, method: Any,
               choices: tuple) -> Result:
    from arr_coc.qwen.processing import video_sampling
    from arr_coc.selection import get_selector, selects_video

    arr_on = read_flag(arr_on, "arr_coc", True)
    budget = read_budget(budget)
    method = check_method(method)
    if method != "none" and not selects_video(get_selector(method)):
        raise InputError(f"Method {method!r} cannot prune a video (it reads the unpruned prompt's layout); choose "
                         "arr_coc, evs, uniform_frames, random, grid, divprune or cdpruner for a clip.")
    notes: list[str] = []
    configs = read_configs(scope, method, *(list(choices) + [None] * (9 - len(choices))), notes=notes)
    if any(c.encode.passes > 1 for c in configs):   # a saccade adds cells of an image (arr_coc.qwen.saccades)
        from dataclasses import replace

        from arr_coc.saccade import SaccadeConfig

        configs = [replace(c, encode=replace(c.encode, saccade=SaccadeConfig())) for c in configs]
        notes.append("Looks again (saccades) apply to images: the clip was answered with one look.")
    question, q_notes = check_question(question, scope.limits)
    path = video if isinstance(video, str) else getattr(video, "path", None) or (video or {}).get("path")
    clip = check_clip(path, scope.limits, name=None, sampling=video_sampling(scope.wrapper.processor))
    with scope.admission.admit(clip.num_frames * clip.height * clip.width):
        return _answer_video(scope, clip, question, arr_on, budget, configs, q_notes + notes)


def _run(scope: Microscope, wrapper: Any, clip: Any, question: str, method: str, budget: Any,
         encode: Any = None) -> Run:
    from arr_coc.cancel import checkpoint
    from microscope.handler import Run

    while not scope.lock.acquire(timeout=0.1):
        checkpoint("waiting for the model")
    try:
        answer, trace = wrapper.generate(clip, question, budget=budget, method=method,
                                         max_new_tokens=scope.max_new_tokens, encode=encode)
    finally:
        scope.lock.release()
    return Run(answer=str(answer).strip(), trace=trace)


def _answer_video(scope: Microscope, clip: Any, question: str, arr_on: bool, budget: Any,
                  configs: list[RunConfig], notes: list[str]) -> Result:
    from arr_coc.cancel import checkpoint
    from microscope.handler import Result, _save_png, request_folder, write_trace

    base = _run(scope, scope.wrapper, clip, question, "none", 1.0)
    checkpoint("the baseline run")
    runs: list[tuple[RunConfig, Run]] = []
    for config in configs if arr_on else []:
        wrapper = scope.layers[config.layer]
        runs.append((config, _run(scope, wrapper, clip, question, config.method, budget, config.encode)))
        checkpoint(f"config {config.label}")
    notes.append(f"A video: {clip.num_frames} frames sampled, {len(base.trace.kept_per_image)} temporal groups. "
                 "Times are wall clock; FLOPs are counted for images only.")
    folder = request_folder()
    first = runs[0][1] if runs else None
    heat = _strip(clip, first.trace, scope, relevance=True) if first is not None and first.trace.arr_coc is not None \
        else None
    resolution = [_strip(clip, r.trace, scope, relevance=False) for _, r in runs] + [None, None]
    record = {"question": question, "video": {"frames": clip.num_frames, "size": [clip.width, clip.height],
                                              "timestamps": [round(float(t), 3) for t in clip.timestamps]},
              "baseline": {"answer": base.answer, **base.trace.to_dict()},
              **{f"config_{c.label}": {"answer": r.answer, "layer": c.layer, **r.trace.to_dict()} for c, r in runs},
              "notes": notes}
    answers = [r.answer for _, r in runs] + ["(config B is off)" if arr_on else "(ARR-COC is off)"] * 2
    return Result(
        answer_baseline=base.answer, answer_arr=answers[0] if arr_on else "(ARR-COC is off: only the baseline ran)",
        answer_compare=answers[1], stats=_stats(base, [r for _, r in runs]),
        heatmap=_save_png(heat, folder, "heatmap") if heat is not None else None,
        resolution_a=_save_png(resolution[0], folder, "resolution_a") if resolution[0] is not None else None,
        resolution_b=_save_png(resolution[1], folder, "resolution_b") if resolution[1] is not None else None,
        trace=write_trace(record, folder), error="\n\n".join(f"**Note:** {n}" for n in notes), record=record)


def _stats(base: Run, runs: list[Run]) -> list[list[str]]:
    def ms(s: float) -> str:
        return f"{1000 * s:.1f}"

    def whole(tr: Any) -> float:
        return tr.vision_s + tr.arr_coc_s + tr.prefill_s

    cols = [base] + runs + [None] * (2 - len(runs))
    rows = [("visual tokens kept", lambda r: f"{r.trace.kept_tokens} / {r.trace.total_tokens}"),
            ("tokens per temporal group", lambda r: " ".join(str(k) for k in r.trace.kept_per_group[0])),
            ("vision tower (ms)", lambda r: ms(r.trace.vision_s)),
            ("ARR-COC's own work (ms)", lambda r: ms(r.trace.arr_coc_s)),
            ("LM prefill (ms)", lambda r: ms(r.trace.prefill_s)),
            ("whole prefill (ms)", lambda r: ms(whole(r.trace)))]
    return [[name] + ["-" if r is None else of(r) for r in cols] for name, of in rows]


def _strip(clip: Any, trace: Any, scope: Microscope, relevance: bool) -> Image:
    """Each temporal group's first frame (at the processor's size) with config's relevance and kept cells, or with
    its resolution levels, side by side in time order."""
    from PIL import Image as PILImage

    from arr_coc.viz import outline_kept, overlay_heatmap, resolution_picture

    pictures = []
    for j, (h, w) in enumerate(trace.grid_hw):
        frame = PILImage.fromarray(clip.frames[min(2 * trace.group_per_image[j], clip.num_frames - 1)])
        frame = frame.resize((w * scope.cell_px, h * scope.cell_px), PILImage.BICUBIC)
        if relevance:
            out = trace.arr_coc.cpu()
            shown = overlay_heatmap(frame, out, j) if out is not None else outline_kept(frame, trace.kept_indices[j], (h, w))
        else:
            shown = resolution_picture(frame, trace.resolution(j), (h, w), legend=False)
        scale = STRIP_HEIGHT / shown.size[1]
        pictures.append(shown.resize((max(1, int(shown.size[0] * scale)), STRIP_HEIGHT)))
    strip = PILImage.new("RGB", (sum(p.size[0] for p in pictures) + 4 * (len(pictures) - 1), STRIP_HEIGHT), "white")
    x = 0
    for p in pictures:
        strip.paste(p, (x, 0))
        x += p.size[0] + 4
    return strip


__all__ = ["ask_video"]
