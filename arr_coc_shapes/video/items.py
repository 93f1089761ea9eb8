"""One ShapesVQA-video item in memory: plan the question, build the track, re-derive the answer from
the track, render the frames, and the JSONL record."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..layout import draw_canvas
from ..seeding import choice, item_rng
from ..vocabulary import DEFAULT_CANVAS, Canvas
from .ask import ClipQuestion, ask_clip, movers
from .build import Builder, draw_pan, draw_shots, fill
from .plan import plan_clip
from .render import render_clip
from .spec import CUT_TYPES, FPS, PAN_TYPES, VIDEO_QUESTION_TYPES, VideoOptions
from .track import Track


class ClipItem(NamedTuple):
    """``frames, record, track = make_clip_item(...)``; frames are uint8 [N, H, W, 3]."""

    frames: np.ndarray
    record: dict
    track: Track


def clip_id(split: str, index: int) -> str:
    return f"{split}-{index:06d}"


def events_of(track: Track) -> list[dict]:
    """What happens in the clip, in frame order: pan, moves, appearances, disappearances, recolors, cut."""
    out: list[dict] = []
    last = track.n_frames - 1
    if track.pan is not None:
        out.append({"kind": "pan", "frames": [0, last], "velocity": list(track.pan)})
    moving = set(movers(track))
    for i, a in enumerate(track.actors):
        frames = track.frames_of(i)
        who = {"object": i, "shape": a.shape, "color": a.color}
        start = track.shot_frames(a.shot).start
        if a.appear > start:
            out.append({"kind": "appear", "frame": a.appear, **who})
        if a.vanish is not None:
            out.append({"kind": "disappear", "frame": a.vanish, **who})
        if a.recolor is not None:
            out.append({"kind": "recolor", "frame": a.recolor.frame, **who, "to": a.recolor.color})
        if i in moving:
            out.append({"kind": "move", "frames": [frames[0], frames[-1]], **who, "velocity": list(a.velocity)})
    if track.cut is not None:
        out.append({"kind": "cut", "frame": track.cut})
    return sorted(out, key=lambda e: (e.get("frame", e.get("frames", [0])[0]), e.get("object", -1)))


def make_clip_record(question: ClipQuestion, track: Track, split: str, index: int, seed: int, suffix: str) -> dict:
    rid = clip_id(split, index)
    return {
        "id": rid,
        "split": split,
        "video": f"clips/{rid}{suffix}",
        "question": question.text,
        "answer": question.answer,
        "answers": [question.answer],
        "qtype": question.qtype,
        "n_frames": track.n_frames,
        "fps": FPS,
        "size": [track.width, track.height],
        "boxes_over_time": [[list(b) for b in boxes] for boxes in question.boxes_over_time(track)],
        "events": events_of(track),
        "scene_cut": track.cut,
        "pan": None if track.pan is None else list(track.pan),
        "seed": seed,
    }


def make_clip_item(seed: int, split: str = "test", index: int = 0, canvas: Canvas = DEFAULT_CANVAS,
                   opts: VideoOptions | None = None) -> ClipItem:
    """Generate clip ``index`` of ``split`` in memory: (frames uint8 [N, H, W, 3], record, track).

    Deterministic in (seed, split, index, canvas, opts). The question type is uniform over the eight
    video types and its answer uniform over the type's answers; the track is built to make it true and
    the answer in the record is re-derived from the track.
    """
    from .clips import clip_suffix

    opts = (opts or VideoOptions()).checked()
    rng = item_rng(seed, f"video:{split}", index)  # its own stream: not the image item of the same id
    size = draw_canvas(rng, canvas)
    qtype = choice(rng, VIDEO_QUESTION_TYPES)
    n_frames = int(choice(rng, opts.lengths))
    n_types = len(VIDEO_QUESTION_TYPES)
    pan = cut = None
    if qtype in PAN_TYPES and rng.random() < opts.pan_rate * n_types / len(PAN_TYPES):
        pan = draw_pan(rng, size, n_frames)
    if qtype in CUT_TYPES and rng.random() < opts.cut_rate * n_types / len(CUT_TYPES):
        cut = int(choice(rng, range(2, n_frames - 1, 2)))
    b = Builder(rng, size, n_frames, draw_shots(rng, cut), pan, cut, opts)
    params, answer = plan_clip(rng, qtype, b)
    question = ask_clip(b.track, qtype, **params)
    if question is None or question.answer != answer:
        raise RuntimeError(f"bug: planned {qtype} answer {answer!r} but the track gives {question}; "
                           f"report seed={seed} split={split!r} index={index}")
    # one mover is the question of moving_shape / moving_color: their distractors never move
    fill(b, question, params, allow_motion=qtype not in ("moving_shape", "moving_color"))
    track = b.track
    final = ask_clip(track, qtype, **params)
    if final is None or final.answer != answer:
        raise RuntimeError(f"bug: distractors changed the {qtype} answer {answer!r} to {final}; "
                           f"report seed={seed} split={split!r} index={index}")
    frames = render_clip(track)
    return ClipItem(frames, make_clip_record(final, track, split, index, seed, clip_suffix(frames)), track)
