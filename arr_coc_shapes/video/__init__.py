"""ShapesVQA-video (spec: docs/SHAPESVQA.md, "ShapesVQA-video"): seeded clips of the image set's shapes
with questions that need time (what moves, which way, what appears last, a colour or a pair at the
start or the end) and relevance targets over time (per frame, the boxes the answer needs).

    from arr_coc_shapes.video import make_clip_item, write_video_split, load_clip_frames
    frames, record, track = make_clip_item(seed=0, split="test", index=7)   # uint8 [N, H, W, 3]
    write_video_split("data/shapes_video", split="test", n=2000, seed=0)    # clips/ + test.jsonl

Modules, by responsibility (none imports torch but `tuning`, which this package never imports itself):

    spec     question types, templates, directions, lengths, rates, presets (standard library only)
    track    Actor, Shot, Track: positions, colours and presence over time, the camera and the cut
    ask      ask_clip: the ground truth and the per-frame relevant objects, from a track
    build    the camera, the backgrounds, placing actors, distractors that keep the answer (fill)
    plan     the question planned first, and the actors and events that make it true
    render   render_clip: frames with the image set's drawing
    items    make_clip_item: one clip in memory, and its record
    clips    save_clip / load_clip_frames: one lossless GIF (or APNG) per clip
    files    write_video_split: clips + JSONL on disk
    tuning   the embedded model's fine-tune on these clips and the image set (`train-vlm --video`)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "VIDEO_QUESTION_TYPES": "spec",
    "VIDEO_TEMPLATES": "spec",
    "PRESETS": "spec",
    "VideoOptions": "spec",
    "options": "spec",
    "video_words": "spec",
    "Actor": "track",
    "Shot": "track",
    "Track": "track",
    "ClipQuestion": "ask",
    "ask_clip": "ask",
    "render_clip": "render",
    "ClipItem": "items",
    "make_clip_item": "items",
    "load_clip_frames": "clips",
    "save_clip": "clips",
    "write_video_split": "files",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
