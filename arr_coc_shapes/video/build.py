"""Building a clip's track: the camera and cut, the shots' backgrounds, placing actors (never
overlapping, always in view, a mover's whole path included) and the distractors that keep the
planned answer true (``fill``).
"""

from __future__ import annotations

import math

import numpy as np

from ..drawing import box_dims
from ..layout import _draw_background, _make_object, jitter_color
from ..plan import Req
from ..seeding import choice
from ..vocabulary import COLOR_NAMES, MAX_SIDE, MIN_SIDE, SHAPES, Box, Size
from .ask import ClipQuestion, ask_clip
from .spec import DIAGONALS, DIRECTIONS, MAX_PAN_FRACTION, MAX_SHOT_OBJECTS, MIN_SHOT_OBJECTS, VideoOptions
from .track import Actor, Recolor, Shot, Track

MIN_CUT_CONTRAST = 60  # L1 distance (RGB levels) between the two shots' background colours


def draw_pan(rng: np.random.Generator, size: Size, n_frames: int) -> tuple[int, int]:
    """Camera px per frame: horizontal, vertical or diagonal; the whole travel is <= 20% of the side."""
    axes = choice(rng, ((1, 0), (0, 1), (1, 1)))
    pan = []
    for on, side in zip(axes, size):
        hi = max(1, math.floor(MAX_PAN_FRACTION * side / (n_frames - 1)))
        speed = int(rng.integers(max(1, math.ceil(hi / 3)), hi + 1)) if on else 0
        pan.append(speed * (1 if rng.random() < 0.5 else -1))
    return (pan[0], pan[1])


def draw_shots(rng: np.random.Generator, cut: int | None) -> tuple[Shot, ...]:
    """The backgrounds (the image set's: grey or muted, flat or faintly textured); a cut's second shot
    differs from the first by at least MIN_CUT_CONTRAST levels (L1) in its base colour."""
    first = Shot(*_draw_background(rng, None))
    if cut is None:
        return (first,)
    for _ in range(50):
        second = Shot(*_draw_background(rng, None))
        if sum(abs(a - b) for a, b in zip(first.background, second.background)) >= MIN_CUT_CONTRAST:
            break
    return (first, second)


def draw_velocity(rng: np.random.Generator, unit: tuple[int, int], n_frames: int, travel: tuple[int, int]):
    """``unit`` scaled by a speed (px per frame, >= 2) whose whole-clip travel falls in ``travel``."""
    lo = max(2, math.ceil(travel[0] / (n_frames - 1)))
    hi = max(lo, travel[1] // (n_frames - 1))
    speed = int(rng.integers(lo, hi + 1))
    return (unit[0] * speed, unit[1] * speed)


class Builder:
    """A track under construction: ``add`` places actors, ``track`` is the clip so far."""

    def __init__(self, rng: np.random.Generator, size: Size, n_frames: int, shots: tuple[Shot, ...],
                 pan: tuple[int, int] | None, cut: int | None, opts: VideoOptions):
        self.rng, self.opts = rng, opts
        self.base = Track(size[0], size[1], n_frames, shots, (), pan, cut)
        self.actors: list[Actor] = []
        self.swept: list[tuple[int, Box]] = []  # (shot, world box the actor covers over the clip)

    @property
    def track(self) -> Track:
        b = self.base
        return Track(b.width, b.height, b.n_frames, b.shots, tuple(self.actors), b.pan, b.cut)

    def event_frames(self, shot: int) -> list[int]:
        """Frames an appear / vanish / recolor may happen at: even (Qwen's frame pairs never straddle
        one) and strictly inside the shot (its first frame shows the shot as it starts)."""
        frames = self.base.shot_frames(shot)
        return list(range(frames.start + 2, frames.stop - 1, 2))

    def count(self, shot: int) -> int:
        return sum(1 for a in self.actors if a.shot == shot)

    def _place(self, shot: int, wh: tuple[int, int], velocity: tuple[int, int]) -> Box | None:
        """A frame-0 world box whose swept path stays in the safe region and overlaps no other's."""
        (w, h), (vx, vy), n = wh, velocity, self.base.n_frames
        sw, sh = w + abs(vx) * (n - 1), h + abs(vy) * (n - 1)
        rx0, ry0, rx1, ry1 = self.base.safe_region
        if rx1 - sw < rx0 or ry1 - sh < ry0:
            return None
        placed = np.array([b for s, b in self.swept if s == shot], dtype=np.int64).reshape(-1, 4)
        xs = self.rng.integers(rx0, rx1 - sw + 1, size=64)
        ys = self.rng.integers(ry0, ry1 - sh + 1, size=64)
        x, y = xs[:, None], ys[:, None]
        hit = (x < placed[:, 2]) & (placed[:, 0] < x + sw) & (y < placed[:, 3]) & (placed[:, 1] < y + sh)
        free = ~hit.any(axis=1)
        if not free.any():
            return None
        k = int(np.argmax(free))
        sx, sy = int(xs[k]), int(ys[k])
        self.swept.append((shot, (sx, sy, sx + sw, sy + sh)))
        x0 = sx + (abs(vx) * (n - 1) if vx < 0 else 0)
        y0 = sy + (abs(vy) * (n - 1) if vy < 0 else 0)
        return (x0, y0, x0 + w, y0 + h)

    def add(self, shape: str, color: str, shot: int = 0, velocity: tuple[int, int] = (0, 0),
            appear: int | None = None, vanish: int | None = None, recolor: tuple[int, str] | None = None,
            required: bool = True) -> int | None:
        """Place an actor; returns its index. A required actor shrinks until it fits (RuntimeError if it
        cannot); an optional one returns None when there is no room."""
        side = int(self.rng.integers(MIN_SIDE, MAX_SIDE + 1))
        for _ in range(3 if not required else 12):
            box = self._place(shot, box_dims(shape, side), velocity)
            if box is not None:
                break
            side = max(MIN_SIDE, int(side * 0.8))
        else:
            if required:
                raise RuntimeError(f"bug: no room for a required {shape} on a {self.base.size} clip; report the seed")
            return None
        obj = _make_object(self.rng, Req(shape, color), box, self.opts.letter_rate)
        start = self.base.shot_frames(shot).start
        change = None if recolor is None else Recolor(recolor[0], recolor[1], jitter_color(self.rng, recolor[1]))
        self.actors.append(Actor(shape, color, obj.rgb, box, shot, velocity, max(start, appear or 0), vanish,
                                 change, obj.letter, obj.letter_size))
        return len(self.actors) - 1

    def pop(self) -> None:
        self.actors.pop()
        self.swept.pop()


def _same(a: ClipQuestion | None, b: ClipQuestion) -> bool:
    return a is not None and a.answer == b.answer and a.relevant == b.relevant


def fill(b: Builder, question: ClipQuestion, params: dict, allow_motion: bool) -> None:
    """Add 3-8 objects per shot in all: distractors with random events, each kept only if the question
    keeps its answer and its relevant objects (so the planned answer stays true)."""
    rng, n = b.rng, b.base.n_frames
    kinds = ["appear", "vanish", "recolor"] + (["move"] if allow_motion and b.base.pan is None else [])
    for shot in range(len(b.base.shots)):
        target = int(rng.integers(MIN_SHOT_OBJECTS, MAX_SHOT_OBJECTS + 1))
        frames = b.event_frames(shot)
        failures = 0
        while b.count(shot) < target and failures < 40:
            shape, color = choice(rng, SHAPES), choice(rng, COLOR_NAMES)
            kind = choice(rng, kinds) if frames and rng.random() < 0.45 else None
            extra: dict = {}
            if kind == "appear":
                extra["appear"] = choice(rng, frames)
            elif kind == "vanish":
                extra["vanish"] = choice(rng, frames)
            elif kind == "recolor":
                extra["recolor"] = (choice(rng, frames), choice(rng, [c for c in COLOR_NAMES if c != color]))
            elif kind == "move":
                unit = choice(rng, tuple(DIRECTIONS.values()) + DIAGONALS)
                extra["velocity"] = draw_velocity(rng, unit, n, b.opts.travel)
            if b.add(shape, color, shot, required=False, **extra) is None:
                failures += 1
            elif not _same(ask_clip(b.track, question.qtype, **params), question):
                b.pop()
                failures += 1
        if b.count(shot) < MIN_SHOT_OBJECTS:
            raise RuntimeError(f"bug: only {b.count(shot)} objects in shot {shot}; report the seed")
