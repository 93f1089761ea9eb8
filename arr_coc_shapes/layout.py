"""Scene layout: the canvas size, the hard-case kind, the background, and placing the planned
objects first, then distractors that keep the planned answer true (``compose``).
"""

from __future__ import annotations

import colorsys
import math

import numpy as np

from .drawing import box_dims
from .plan import Plan, Req, random_plan
from .scene import FaintMark, Scene, SceneObject
from .seeding import choice
from .vocabulary import (
    CANVAS_MAX, CANVAS_MIN, CELL_PX, COLOR_JITTER, COLOR_NAMES, COLORS, DEFAULT_CANVAS, DEFAULT_HARD_RATE,
    HARD_KINDS, LETTERED_SHAPES, LETTERS, MAX_LETTER_FRAC, MAX_OBJECTS, MAX_SIDE, MIN_LETTER_FRAC,
    MIN_LETTER_SIDE, MIN_OBJECTS, MIN_SIDE, P_LETTER, QUESTION_TYPES, SHAPES, TEXTURE_P, TEXTURES, Box, Canvas,
    Size,
)


def parse_canvas(canvas: Canvas) -> Size | str:
    """'448x448' or (448, 448) -> (448, 448); 'random' -> 'random'.

    Raises ValueError saying what is allowed when a side is not a multiple of 28
    in [336, 896].
    """
    if isinstance(canvas, str):
        text = canvas.strip().lower()
        if text == "random":
            return "random"
        parts = text.split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"canvas must look like '448x448' (WIDTHxHEIGHT) or be 'random', got {canvas!r}")
        canvas = (int(parts[0]), int(parts[1]))
    width, height = (int(v) for v in canvas)
    for name, value in (("width", width), ("height", height)):
        if value % CELL_PX or not CANVAS_MIN <= value <= CANVAS_MAX:
            raise ValueError(
                f"canvas {name} {value} is not allowed: use a multiple of {CELL_PX} "
                f"between {CANVAS_MIN} and {CANVAS_MAX} (e.g. 448x448), or 'random'"
            )
    return (width, height)


def draw_canvas(rng: np.random.Generator, canvas: Canvas = DEFAULT_CANVAS) -> Size:
    """The canvas size for one item; 'random' draws each side from the whole range."""
    parsed = parse_canvas(canvas)
    if parsed == "random":
        lo, hi = CANVAS_MIN // CELL_PX, CANVAS_MAX // CELL_PX
        return (CELL_PX * int(rng.integers(lo, hi + 1)), CELL_PX * int(rng.integers(lo, hi + 1)))
    return parsed  # type: ignore[return-value]


def draw_hard(rng: np.random.Generator, qtype: str, hard_rate: float = DEFAULT_HARD_RATE) -> str | None:
    """The hard-case kind for an item of question type ``qtype`` (or None).

    Each kind occurs in ``hard_rate / 3`` of all items. "low_contrast" is a
    letter question by nature, so it is drawn only for letter items, with its
    conditional probability scaled up so the overall rate (and the uniform
    question-type mix) is unchanged.
    """
    if not 0.0 <= hard_rate <= 0.42:
        raise ValueError(f"hard_rate must be in [0, 0.42] so letter items can absorb 'low_contrast', got {hard_rate}")
    each = hard_rate / len(HARD_KINDS)
    u = float(rng.random())
    if qtype == "letter":
        p_low = each * len(QUESTION_TYPES)  # P(low_contrast | letter)
        if u < p_low:
            return "low_contrast"
        u -= p_low
    if u < each:
        return "void"
    if u < 2 * each:
        return "border"
    return None


def jitter_color(rng: np.random.Generator, name: str) -> tuple[int, int, int]:
    """The named colour's RGB centre with per-channel jitter in [-15, 15]."""
    centre = np.array(COLORS[name], dtype=np.int64)
    rgb = np.clip(centre + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1, size=3), 0, 255)
    return (int(rgb[0]), int(rgb[1]), int(rgb[2]))


def _draw_background(rng: np.random.Generator, hard: str | None) -> tuple[tuple[int, int, int], str, int, int]:
    """(rgb, texture, amp, texture_seed): grey 20-120 or muted (sat <= 0.25, val <= 0.5).

    The base colour keeps ``amp`` levels of headroom so the textured pixels
    stay inside the spec's background range.
    """
    texture = "flat" if hard == "void" else str(TEXTURES[int(rng.choice(len(TEXTURES), p=TEXTURE_P))])
    amp_range = {"flat": (0, 0), "noise": (1, 3), "blobs": (3, 8), "stripes": (2, 4)}[texture]  # grey levels
    amp = int(rng.integers(amp_range[0], amp_range[1] + 1))
    texture_seed = int(rng.integers(2**63))
    if rng.random() < 0.5:
        grey = int(rng.integers(20 + amp, 120 - amp + 1))
        return (grey, grey, grey), texture, amp, texture_seed
    hue = float(rng.random())
    sat = float(rng.uniform(0.05, 0.22))  # < 0.25 leaves room for rounding to 8 bits
    val = float(rng.uniform(0.12, 0.5 - (amp + 1) / 255))
    r, g, b = colorsys.hsv_to_rgb(hue, sat, val)
    return (round(r * 255), round(g * 255), round(b * 255)), texture, amp, texture_seed


def _faint_marks(rng: np.random.Generator, size: Size, background: tuple[int, int, int]) -> tuple[FaintMark, ...]:
    """Faint structure for "void" scenes: 3-8 outlines a few grey levels off."""
    w, h = size
    marks = []
    for _ in range(int(rng.integers(3, 9))):
        kind = choice(rng, ("line", "rect", "ellipse"))
        delta = int(rng.integers(3, 9)) * (1 if rng.random() < 0.5 or max(background) < 30 else -1)
        x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
        x1, y1 = int(rng.integers(x0 + 30, min(w, x0 + 240))), int(rng.integers(y0 + 30, min(h, y0 + 240)))
        if kind == "line" and rng.random() < 0.5:
            x0, x1 = x1, x0  # either diagonal
        marks.append(FaintMark(kind, (x0, y0, x1, y1), delta, int(rng.integers(1, 3))))
    return tuple(marks)


def _candidate_positions(
    rng: np.random.Generator, size: Size, wh: tuple[int, int], at_border: bool, beside: Box | None, k: int = 64
) -> np.ndarray:
    """int64 [k, 2] top-left corners (x0, y0) for a w x h box."""
    (W, H), (w, h) = size, wh
    xs = rng.integers(0, W - w + 1, size=k)
    ys = rng.integers(0, H - h + 1, size=k)
    if at_border:  # pin one coordinate to a side: left, right, top, bottom
        side = rng.integers(0, 4, size=k)
        xs = np.where(side == 0, 0, np.where(side == 1, W - w, xs))
        ys = np.where(side == 2, 0, np.where(side == 3, H - h, ys))
    elif beside is not None:  # touch (gap 0-3 px) one side of the anchor box
        bx0, by0, bx1, by1 = beside
        side = rng.integers(0, 4, size=k)
        gap = rng.integers(0, 4, size=k)
        along_x = rng.integers(bx0 - w + 1, bx1, size=k)
        along_y = rng.integers(by0 - h + 1, by1, size=k)
        xs = np.select([side == 0, side == 1], [bx0 - w - gap, bx1 + gap], along_x)
        ys = np.select([side == 2, side == 3], [by0 - h - gap, by1 + gap], along_y)
        xs, ys = np.clip(xs, 0, W - w), np.clip(ys, 0, H - h)
    return np.stack([xs, ys], axis=1)


def _place(
    rng: np.random.Generator, size: Size, wh: tuple[int, int], placed: np.ndarray,
    at_border: bool = False, beside: Box | None = None, tries: int = 3,
) -> Box | None:
    """A free box of size ``wh`` (no shared area with ``placed`` [n, 4]) or None."""
    w, h = wh
    for _ in range(tries):
        xy = _candidate_positions(rng, size, wh, at_border, beside)  # [k, 2]
        if len(placed):
            x0, y0 = xy[:, 0:1], xy[:, 1:2]  # [k, 1] against [n] placed boxes
            hit = (x0 < placed[:, 2]) & (placed[:, 0] < x0 + w) & (y0 < placed[:, 3]) & (placed[:, 1] < y0 + h)
            free = ~hit.any(axis=1)
        else:
            free = np.ones(len(xy), dtype=bool)
        if free.any():
            x, y = (int(v) for v in xy[int(np.argmax(free))])
            return (x, y, x + w, y + h)
    return None


def _make_object(rng: np.random.Generator, req: Req, box: Box, letter_rate: float = P_LETTER) -> SceneObject:
    """Fill colour, letter and font size for a placed request."""
    w, h = box[2] - box[0], box[3] - box[1]
    letter = req.letter
    eligible = req.shape in LETTERED_SHAPES and min(w, h) >= MIN_LETTER_SIDE
    if letter is None and req.auto_letter and eligible and rng.random() < letter_rate:
        letter = choice(rng, LETTERS)
    letter_size = None
    if letter is not None:
        if not eligible:
            raise RuntimeError(f"bug: letter requested on an ineligible {req.shape} of {w}x{h} px")
        lo = math.ceil(MIN_LETTER_FRAC * h)
        hi = max(lo, math.floor(MAX_LETTER_FRAC[req.shape] * h))
        letter_size = int(rng.integers(lo, hi + 1))
    return SceneObject(req.shape, req.color, jitter_color(rng, req.color), box, letter, letter_size)


def _allowed(plan: Plan, color: str, shape: str) -> bool:
    return not (
        shape == plan.forbid_shape or color == plan.forbid_color or (color, shape) == plan.forbid_pair
    )


def compose(
    rng: np.random.Generator, size: Size, plan: Plan, hard: str | None, letter_rate: float = P_LETTER,
) -> Scene:
    """Place the plan's objects first, then distractors that keep the answer true."""
    background, texture, amp, texture_seed = _draw_background(rng, hard)
    if hard == "void":
        n_target = max(MIN_OBJECTS, plan.min_objects, len(plan.required) + int(rng.integers(0, 3)))
        side_range = (MIN_SIDE, 32)
    else:
        n_target = max(int(rng.integers(MIN_OBJECTS, MAX_OBJECTS + 1)), plan.min_objects, len(plan.required))
        side_range = (MIN_SIDE, MAX_SIDE)
    n_target = min(n_target, MAX_OBJECTS)

    objects: list[SceneObject] = []
    placed = np.zeros((0, 4), dtype=np.int64)
    for req in plan.required:
        lo, hi = req.side
        side = int(rng.integers(lo, hi + 1))
        anchor = objects[req.beside].box if req.beside is not None else None
        box = None
        while box is None:  # shrink until it fits; a required object must exist
            box = _place(rng, size, box_dims(req.shape, side), placed, req.at_border, anchor, tries=4)
            if box is None and anchor is not None:
                anchor = None  # no room beside the target: anywhere will do
            elif box is None:
                if side <= lo:
                    raise RuntimeError(f"bug: no room for a required {req.shape} on a {size} canvas; report the seed")
                side = max(lo, int(side * 0.8))
        objects.append(_make_object(rng, req, box, letter_rate))
        placed = np.vstack([placed, np.asarray(box)[None]])

    n_border = int(rng.integers(1, 4)) if hard == "border" else 0  # extra distractors on the edge
    failures = 0
    while len(objects) < n_target and failures < 40:
        color, shape = choice(rng, COLOR_NAMES), choice(rng, SHAPES)
        if not _allowed(plan, color, shape):
            continue
        side = int(rng.integers(side_range[0], side_range[1] + 1))
        box = _place(rng, size, box_dims(shape, side), placed, at_border=n_border > 0, tries=2)
        if box is None and side > 32:
            box = _place(rng, size, box_dims(shape, 32), placed, tries=2)  # crowded: try small
        if box is None:
            failures += 1
            continue
        n_border = max(0, n_border - 1)
        objects.append(_make_object(rng, Req(shape, color), box, letter_rate))
        placed = np.vstack([placed, np.asarray(box)[None]])
    if len(objects) < MIN_OBJECTS:
        raise RuntimeError(f"bug: placed only {len(objects)} objects on a {size} canvas; report the seed")

    faint = _faint_marks(rng, size, background) if hard == "void" else ()
    return Scene(size[0], size[1], background, tuple(objects), texture, amp, texture_seed, faint, hard)


def generate_scene(rng: np.random.Generator, size: Size = DEFAULT_CANVAS, hard: str | None = None) -> Scene:
    """A random scene with no planned question (use ``questions_for_scene`` on it)."""
    if hard is not None and hard not in HARD_KINDS:
        raise ValueError(f"hard must be None or one of {HARD_KINDS}, got {hard!r}")
    size = parse_canvas(size)  # type: ignore[assignment]
    if size == "random":
        raise ValueError("generate_scene needs a concrete (width, height); draw one with draw_canvas(rng, 'random')")
    return compose(rng, size, random_plan(rng, hard), hard)
