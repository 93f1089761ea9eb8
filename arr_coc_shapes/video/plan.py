"""Planning a clip's question first: its type's attributes and a uniformly drawn answer, then the
actors (and their events) that make the answer true and make it need time: a recolor, a decoy that
is there only at the other end, earlier appearances, other movers.
"""

from __future__ import annotations

import numpy as np

from ..seeding import choice
from ..vocabulary import COLOR_NAMES, SHAPES
from .build import Builder, draw_velocity
from .spec import DIAGONALS, DIRECTIONS


def _other(rng: np.random.Generator, options, *not_these):
    return choice(rng, [o for o in options if o not in not_these])


def plan_clip(rng: np.random.Generator, qtype: str, b: Builder) -> tuple[dict, str]:
    """Add the actors the planned question needs; returns (question attributes, planned answer)."""
    n, last = b.base.n_frames, b.base.n_frames - 1
    travel = b.opts.travel
    if qtype in ("moving_shape", "moving_color"):
        shape, color = choice(rng, SHAPES), choice(rng, COLOR_NAMES)
        unit = choice(rng, tuple(DIRECTIONS.values()) + DIAGONALS)
        b.add(shape, color, velocity=draw_velocity(rng, unit, n, travel))
        return {}, shape if qtype == "moving_shape" else color
    if qtype == "direction":
        answer, shape = choice(rng, tuple(DIRECTIONS)), choice(rng, SHAPES)
        b.add(shape, choice(rng, COLOR_NAMES), velocity=draw_velocity(rng, DIRECTIONS[answer], n, travel))
        for _ in range(int(rng.integers(0, 3))):  # other movers, other shapes, other ways (where they fit)
            unit = _other(rng, tuple(DIRECTIONS.values()) + DIAGONALS, DIRECTIONS[answer])
            velocity = draw_velocity(rng, unit, n, travel)
            b.add(_other(rng, SHAPES, shape), choice(rng, COLOR_NAMES), velocity=velocity, required=False)
        return {"shape": shape}, answer
    if qtype == "appears_last":
        shape, frames = choice(rng, SHAPES), b.event_frames(0)
        k = choice(rng, frames)
        b.add(shape, choice(rng, COLOR_NAMES), appear=k)
        earlier = [f for f in frames if f < k]
        for _ in range(int(rng.integers(0, 3)) if earlier else 0):  # earlier appearances, other shapes
            b.add(_other(rng, SHAPES, shape), choice(rng, COLOR_NAMES), appear=choice(rng, earlier))
        return {}, shape
    if qtype in ("color_start", "color_end"):
        return _plan_color(rng, qtype, b, 0 if qtype == "color_start" else last)
    if qtype in ("exists_first", "exists_last"):
        return _plan_exists(rng, qtype, b, 0 if qtype == "exists_first" else last)
    raise ValueError(f"unknown video question type {qtype!r}")


def _plan_color(rng: np.random.Generator, qtype: str, b: Builder, t: int) -> tuple[dict, str]:
    """The shape's one object in frame t has the answer's colour; at the other end of its shot it has
    another (recolor), or another object of the shape is there only then (decoy), or neither."""
    color, shape = choice(rng, COLOR_NAMES), choice(rng, SHAPES)
    shot, at_start = b.base.shot_at(t), t == 0
    frames = b.event_frames(shot)
    mechanism = choice(rng, ("recolor", "recolor", "decoy", "none")) if frames else "none"
    other = _other(rng, COLOR_NAMES, color)
    if mechanism == "recolor":
        k = choice(rng, frames)
        if at_start:
            b.add(shape, color, shot, recolor=(k, other))
        else:
            b.add(shape, other, shot, recolor=(k, color))
    else:
        b.add(shape, color, shot)
        if mechanism == "decoy":
            k = choice(rng, frames)
            b.add(shape, other, shot, **({"appear": k} if at_start else {"vanish": k}))
    if b.base.cut is not None and rng.random() < 0.7:  # the other shot's object of the shape
        b.add(shape, _other(rng, COLOR_NAMES, color), 1 - shot)
    return {"shape": shape}, color


def _plan_exists(rng: np.random.Generator, qtype: str, b: Builder, t: int) -> tuple[dict, str]:
    """yes / no 50/50; the pair may be there only at the other end (it appears, vanishes or changes
    colour between), and near misses (same colour other shape, same shape other colour) in frame t."""
    color, shape = choice(rng, COLOR_NAMES), choice(rng, SHAPES)
    present = bool(rng.random() < 0.5)
    shot, at_start = b.base.shot_at(t), t == 0
    frames = b.event_frames(shot)
    other = _other(rng, COLOR_NAMES, color)
    twist = choice(rng, ("time", "recolor")) if frames and rng.random() < (0.5 if present else 0.6) else None
    k = choice(rng, frames) if twist else None
    if present:  # in frame t, perhaps not at the other end
        if twist == "time":
            b.add(shape, color, shot, **({"vanish": k} if at_start else {"appear": k}))
        elif twist == "recolor":
            b.add(shape, color if at_start else other, shot, recolor=(k, other if at_start else color))
        else:
            b.add(shape, color, shot)
    elif twist == "time":  # the pair is there only at the other end of the shot
        b.add(shape, color, shot, **({"appear": k} if at_start else {"vanish": k}))
    elif twist == "recolor":
        b.add(shape, other if at_start else color, shot, recolor=(k, color if at_start else other))
    if not present and b.base.cut is not None and rng.random() < 0.5:  # the pair in the other shot
        b.add(shape, color, 1 - shot)
    if rng.random() < 0.6:
        b.add(_other(rng, SHAPES, shape), color, shot)
    if rng.random() < 0.6:
        b.add(shape, _other(rng, COLOR_NAMES, color), shot)
    return {"color": color, "shape": shape}, "yes" if present else "no"
