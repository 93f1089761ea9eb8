"""ShapesVQA: procedural, query-dependent VQA scenes (spec: shared/SHAPESVQA.md).

Each item is a cluttered canvas of 8-24 small coloured shapes and one templated
question whose answer depends on one small region (or, for "count", on every
instance of a shape). A token budget that cannot cover every object therefore
rewards an allocator that finds the region the question is about, which is the
whole point of ARR-COC's participatory ("query-aware") knowing.

Determinism: every item draws from its own ``numpy.random.Generator(PCG64)``
seeded by ``(seed, split, index)``, so items are independent (parallel or
on-the-fly generation gives the same bytes) and two splits with the same seed
differ. Rendering is a pure function of the ``Scene`` (texture noise has its
own stored seed), so ``render_scene(scene)`` always reproduces the image.

Generation plans the question first (type, then a uniformly drawn answer), then
builds a scene that makes that answer true, then re-derives the answer from the
scene with ``ask``: question types and answers are balanced by construction and
the ground truth always comes from the scene, never from the plan.

Coordinates: boxes are ``(x0, y0, x1, y1)`` integer pixels with ``x1``/``y1``
exclusive (PIL crop convention), so width = x1 - x0 and a box fits an image
of size (W, H) when 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H. Sizes are
(width, height) as in PIL; arrays are [height, width] as in numpy.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence, Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# ---------------------------------------------------------------------------
# Spec constants (shared/SHAPESVQA.md). Ids used by ``cell_labels`` are the
# 1-based positions in these tuples; 0 is background.
# ---------------------------------------------------------------------------

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
    "cyan": (40, 200, 210),
    "white": (245, 245, 245),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross", "star")
LETTERS: str = string.ascii_uppercase
QUESTION_TYPES: tuple[str, ...] = ("color", "shape", "exists", "count", "letter")
HARD_KINDS: tuple[str, ...] = ("low_contrast", "void", "border")

# The spec's templates, verbatim. NB: "{shape}s" gives "crosss" and "a {color}"
# gives "a orange"; kept literal because the spec says exact (see the report).
TEMPLATES: dict[str, str] = {
    "color": "What color is the {shape}?",
    "shape": "What shape is the {color} object?",
    "exists": "Is there a {color} {shape}?",
    "count": "How many {shape}s are there?",
    "letter": "What letter is on the {color} {shape}?",
}

CELL_PX = 28  # Qwen2-VL / 2.5-VL merged-token size; canvases are multiples of it
CANVAS_MIN, CANVAS_MAX = 12 * CELL_PX, 32 * CELL_PX  # 336 .. 896 px
DEFAULT_CANVAS: tuple[int, int] = (448, 448)
MIN_OBJECTS, MAX_OBJECTS = 8, 24
MIN_SIDE, MAX_SIDE = 20, 64  # longer side of an object's box, px
MIN_LETTER_SIDE = 28  # lettered objects: shorter side at least this, px
MIN_LETTER_FRAC = 0.6  # font size >= 60% of the box height
COLOR_JITTER = 15  # per-channel, +-
MAX_QUERY_FRACTION = 0.04  # queried object box area / image area
DEFAULT_HARD_RATE = 0.3  # P(item is a hard case), split evenly over HARD_KINDS

# The largest box (64 x 64) is below 4% of the smallest canvas (336 x 336), so
# the queried-object limit holds for every object without a per-item check.
assert MAX_SIDE * MAX_SIDE <= MAX_QUERY_FRACTION * CANVAS_MIN * CANVAS_MIN

# Letters go only on shapes whose interior holds a glyph of >= 60% box height
# (measured on Pillow's default font: cap height ~0.7 s, "W" ~0.96 s wide); on
# triangles, crosses and stars the glyph would spill onto the background.
LETTERED_SHAPES: tuple[str, ...] = ("circle", "square", "diamond")
# Largest font size / box height per lettered shape that still keeps "W" inside.
_MAX_LETTER_FRAC = {"circle": 0.72, "square": 0.75, "diamond": 0.6}
P_LETTER = 0.35  # chance that an eligible non-target object carries a letter

# Hard case "low_contrast": the lettered target takes a mid-luminance colour
# (black/white text contrasts least on these) and sits beside a large, bright,
# saturated distractor that draws any saliency-driven allocator away.
LOW_CONTRAST_COLORS = ("green", "cyan", "purple", "orange")
BRIGHT_COLORS = ("yellow", "red", "orange")

# A regular star of outer radius R spans 2 R cos 18deg across and R (1 + sin 54deg) down.
_STAR_H_OVER_W = (1 + math.sin(math.radians(54))) / (2 * math.cos(math.radians(18)))  # ~0.951
_TEXTURES = ("flat", "noise", "blobs", "stripes")
_TEXTURE_P = (0.45, 0.15, 0.2, 0.2)

Size = tuple[int, int]  # (width, height) px
Box = tuple[int, int, int, int]  # (x0, y0, x1, y1) px, x1/y1 exclusive
Canvas = Union[str, Size]  # "448x448", "random" or (width, height)


# ---------------------------------------------------------------------------
# Data types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SceneObject:
    """One filled shape. ``letter`` is a capital A-Z or None."""

    shape: str
    color: str
    rgb: tuple[int, int, int]  # jittered fill colour, exactly as drawn
    box: Box
    letter: str | None = None
    letter_size: int | None = None  # font size passed to load_default(size=)

    @property
    def width(self) -> int:
        return self.box[2] - self.box[0]

    @property
    def height(self) -> int:
        return self.box[3] - self.box[1]

    @property
    def letter_rgb(self) -> tuple[int, int, int]:
        """Black or white, whichever contrasts more with the fill (luma)."""
        return letter_ink(self.rgb)


@dataclass(frozen=True)
class FaintMark:
    """A barely visible outline on the background (the "void" hard case)."""

    kind: str  # "line" | "rect" | "ellipse"
    xy: Box  # end points for a line, bounding box otherwise (inclusive coords)
    delta: int  # grey-level offset from the background, small (+-3..8)
    width: int = 1


@dataclass(frozen=True)
class Scene:
    """Everything needed to render an item; ``render_scene`` is pure in it."""

    width: int
    height: int
    background: tuple[int, int, int]
    objects: tuple[SceneObject, ...]
    texture: str = "flat"  # flat | noise | blobs | stripes
    texture_amp: int = 0  # max grey-level deviation of the texture
    texture_seed: int = 0
    faint: tuple[FaintMark, ...] = ()
    hard: str | None = None  # one of HARD_KINDS, or None

    @property
    def size(self) -> Size:
        return (self.width, self.height)


@dataclass(frozen=True)
class Question:
    """A question about a scene with its ground truth derived from the scene."""

    type: str
    text: str
    answers: tuple[str, ...]
    boxes: tuple[Box, ...]  # answer-relevant objects (spec: "boxes")
    color: str | None = None  # attributes named in the question
    shape: str | None = None


class Item(NamedTuple):
    """One generated item: ``image, record, scene = make_item(...)``."""

    image: Image.Image
    record: dict
    scene: Scene


@dataclass(frozen=True)
class CellLabels:
    """Per-cell ids on a grid of ``cell_px`` cells; each array is int64 [h, w].

    h = ceil(H / cell_px), w = ceil(W / cell_px). A cell takes the labels of the
    object that covers most of its pixels (ties -> lower object index); 0 means
    background. Ids are 1-based positions in COLOR_NAMES / SHAPES / LETTERS and
    ``object`` is the 1-based index into ``scene.objects``.
    """

    color: np.ndarray
    shape: np.ndarray
    letter: np.ndarray
    object: np.ndarray
    coverage: np.ndarray  # float32 [h, w]: winner's pixels / cell pixels


@dataclass(frozen=True)
class _Req:
    """An object the planned question needs in the scene."""

    shape: str
    color: str
    letter: str | None = None
    auto_letter: bool = True  # draw a random letter (P_LETTER) when eligible
    side: tuple[int, int] = (MIN_SIDE, MAX_SIDE)  # inclusive range, longer side
    at_border: bool = False
    beside: int | None = None  # index of an earlier _Req to touch (or nearly)


@dataclass(frozen=True)
class _Plan:
    qtype: str
    color: str | None
    shape: str | None
    answer: str
    required: tuple[_Req, ...]
    # Distractors may not have this shape / colour / (colour, shape) pair, which
    # is what keeps the referred object unique and the answer true.
    forbid_shape: str | None = None
    forbid_color: str | None = None
    forbid_pair: tuple[str, str] | None = None
    min_objects: int = MIN_OBJECTS


# ---------------------------------------------------------------------------
# Seeding and canvas
# ---------------------------------------------------------------------------


def item_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator for one item: PCG64 seeded by (seed, split, index).

    The split name enters through a stable hash (not Python's salted ``hash``),
    so "train" and "test" with the same seed share no items.
    """
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
    split_key = int.from_bytes(hashlib.sha256(split.encode("utf-8")).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split_key, index])))


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


# ---------------------------------------------------------------------------
# Small pure helpers
# ---------------------------------------------------------------------------


def _choice(rng: np.random.Generator, options: Sequence):
    return options[int(rng.integers(len(options)))]


def letter_ink(rgb: Sequence[int]) -> tuple[int, int, int]:
    """Black or white, whichever contrasts more with ``rgb`` (Rec. 601 luma)."""
    luma = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return (0, 0, 0) if luma >= 127.5 else (255, 255, 255)


def jitter_color(rng: np.random.Generator, name: str) -> tuple[int, int, int]:
    """The named colour's RGB centre with per-channel jitter in [-15, 15]."""
    centre = np.array(COLORS[name], dtype=np.int64)
    rgb = np.clip(centre + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1, size=3), 0, 255)
    return (int(rgb[0]), int(rgb[1]), int(rgb[2]))


def box_dims(shape: str, side: int) -> tuple[int, int]:
    """(w, h) of a shape's tight box whose longer side is ``side``.

    Stars keep a regular star's proportions (slightly wider than tall); every
    other shape has a square box.
    """
    if shape == "star":
        return side, round(side * _STAR_H_OVER_W)
    return side, side


def boxes_overlap(a: Box, b: Box) -> bool:
    """True if the boxes share area; boxes that only touch do not overlap."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def box_area(box: Sequence[float]) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


# ---------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------


def _star_points(box: Box) -> list[tuple[float, float]]:
    """A five-point star, one point up, stretched to fill ``box`` exactly."""
    angles = np.deg2rad(-90 + 36 * np.arange(10))  # outer, inner, outer, ...
    radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.382)  # regular star ratio
    xs, ys = radii * np.cos(angles), radii * np.sin(angles)
    x0, y0, x1, y1 = box
    # Map the star's own extent onto the inclusive pixel range of the box.
    xs = x0 + (xs - xs.min()) / (xs.max() - xs.min()) * (x1 - 1 - x0)
    ys = y0 + (ys - ys.min()) / (ys.max() - ys.min()) * (y1 - 1 - y0)
    return list(zip(xs.tolist(), ys.tolist()))


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: Box, fill) -> None:
    """Fill ``shape`` so its pixels span exactly ``box`` (x1/y1 exclusive)."""
    x0, y0, x1, y1 = box
    xr, yb = x1 - 1, y1 - 1  # PIL's drawing coordinates are inclusive
    cx, cy = (x0 + xr) / 2, (y0 + yb) / 2
    if shape == "circle":
        draw.ellipse((x0, y0, xr, yb), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, xr, yb), fill=fill)
    elif shape == "triangle":  # upright, apex at top centre
        draw.polygon([(x0, yb), (cx, y0), (xr, yb)], fill=fill)
    elif shape == "diamond":  # square rotated 45 degrees
        draw.polygon([(cx, y0), (xr, cy), (cx, yb), (x0, cy)], fill=fill)
    elif shape == "cross":  # plus sign, arm width about a third of the box
        w, h = x1 - x0, y1 - y0
        arm_w, arm_h = max(3, round(w / 3)), max(3, round(h / 3))
        left, top = x0 + (w - arm_w) // 2, y0 + (h - arm_h) // 2
        draw.rectangle((left, y0, left + arm_w - 1, yb), fill=fill)
        draw.rectangle((x0, top, xr, top + arm_h - 1), fill=fill)
    elif shape == "star":
        draw.polygon(_star_points(box), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


@lru_cache(maxsize=128)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


@lru_cache(maxsize=4096)
def _glyph_offset(size: int, letter: str) -> tuple[float, float]:
    """Offset from the ink centre to PIL's text origin, so glyphs centre on ink."""
    left, top, right, bottom = _font(size).getbbox(letter)
    return (-(left + right) / 2, -(top + bottom) / 2)


def draw_letter(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    """Draw ``obj.letter`` centred on the object in black or white."""
    if obj.letter is None or obj.letter_size is None:
        return
    x0, y0, x1, y1 = obj.box
    dx, dy = _glyph_offset(obj.letter_size, obj.letter)
    origin = (round((x0 + x1) / 2 + dx), round((y0 + y1) / 2 + dy))
    draw.text(origin, obj.letter, fill=obj.letter_rgb, font=_font(obj.letter_size))


def _texture_field(scene: Scene) -> np.ndarray | None:
    """Luminance offsets float32 [H, W] in [-amp, amp], or None for flat."""
    if scene.texture == "flat" or scene.texture_amp <= 0:
        return None
    rng = np.random.Generator(np.random.PCG64(scene.texture_seed))
    h, w, amp = scene.height, scene.width, scene.texture_amp
    if scene.texture == "noise":  # fine grain; luminance only so hue is kept
        return rng.integers(-amp, amp + 1, size=(h, w)).astype(np.float32)
    if scene.texture == "blobs":  # low-frequency mottling: coarse noise, upsampled
        coarse = rng.standard_normal((h // 32 + 2, w // 32 + 2)).astype(np.float32)
        field_ = np.asarray(Image.fromarray(coarse, "F").resize((w, h), Image.Resampling.BILINEAR))
        return field_ / max(1e-6, float(np.abs(field_).max())) * amp
    if scene.texture == "stripes":  # faint oriented sinusoid
        theta = float(rng.uniform(0, math.pi))
        period = float(rng.uniform(12, 48))
        phase = float(rng.uniform(0, 2 * math.pi))
        ys = np.arange(h, dtype=np.float32)[:, None]
        xs = np.arange(w, dtype=np.float32)[None, :]
        return amp * np.sin((xs * math.cos(theta) + ys * math.sin(theta)) * (2 * math.pi / period) + phase)
    raise ValueError(f"unknown texture {scene.texture!r}; expected one of {_TEXTURES}")


def render_background(scene: Scene) -> Image.Image:
    """The background (colour + texture + faint marks) as an RGB image."""
    offsets = _texture_field(scene)
    if offsets is None:
        image = Image.new("RGB", scene.size, scene.background)
    else:
        base = np.asarray(scene.background, dtype=np.float32)  # [3]
        pixels = np.clip(np.rint(base + offsets[..., None]), 0, 255).astype(np.uint8)  # [H, W, 3]
        image = Image.fromarray(pixels, "RGB")
    if scene.faint:
        draw = ImageDraw.Draw(image)
        for mark in scene.faint:
            ink = tuple(int(np.clip(c + mark.delta, 0, 255)) for c in scene.background)
            if mark.kind == "line":
                draw.line(mark.xy, fill=ink, width=mark.width)
            elif mark.kind == "rect":
                draw.rectangle(mark.xy, outline=ink, width=mark.width)
            elif mark.kind == "ellipse":
                draw.ellipse(mark.xy, outline=ink, width=mark.width)
            else:
                raise ValueError(f"unknown faint mark {mark.kind!r}")
    return image


def render_scene(scene: Scene) -> Image.Image:
    """The scene as an RGB PIL image of size (W, H); deterministic in ``scene``."""
    image = render_background(scene)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        draw_shape(draw, obj.shape, obj.box, obj.rgb)
        draw_letter(draw, obj)
    return image


def object_index_map(scene: Scene) -> np.ndarray:
    """uint8 [H, W]: 1-based index of the object whose shape covers each pixel, 0 = none."""
    canvas = Image.new("L", scene.size, 0)
    draw = ImageDraw.Draw(canvas)
    for i, obj in enumerate(scene.objects):  # objects never overlap, so order is moot
        draw_shape(draw, obj.shape, obj.box, i + 1)
    return np.asarray(canvas)


# ---------------------------------------------------------------------------
# Cell-level labels (for training / analysing allocators on the token grid)
# ---------------------------------------------------------------------------


def _grid_hw(size: Size, cell_px: int) -> tuple[int, int]:
    if cell_px <= 0:
        raise ValueError(f"cell_px must be positive, got {cell_px}")
    return math.ceil(size[1] / cell_px), math.ceil(size[0] / cell_px)


def cell_labels(scene: Scene, cell_px: int = CELL_PX, min_cover: float = 0.0) -> CellLabels:
    """Rasterise the scene to per-cell colour / shape / letter / object ids.

    The grid is ceil(H / cell_px) x ceil(W / cell_px) (partial edge cells are
    padded with background). A cell is labelled with the object covering the
    most of its pixels, provided that object covers more than ``min_cover`` of
    the cell; otherwise it is background (0).
    """
    index = object_index_map(scene)  # [H, W]
    gh, gw = _grid_hw(scene.size, cell_px)
    padded = np.zeros((gh * cell_px, gw * cell_px), dtype=np.int64)
    padded[: scene.height, : scene.width] = index
    n = len(scene.objects) + 1  # +1 for background id 0
    # [gh, cell, gw, cell] -> cell id per pixel, then one bincount for all cells.
    cell_id = (np.arange(gh)[:, None, None, None] * gw + np.arange(gw)[None, None, :, None])
    cell_id = np.broadcast_to(cell_id, (gh, cell_px, gw, cell_px))
    flat = (cell_id * n + padded.reshape(gh, cell_px, gw, cell_px)).ravel()
    counts = np.bincount(flat, minlength=gh * gw * n).reshape(gh * gw, n)[:, 1:]  # [cells, objects]
    if counts.shape[1] == 0:
        winner = np.zeros(gh * gw, dtype=np.int64)
        cover = np.zeros(gh * gw, dtype=np.float32)
    else:
        winner = counts.argmax(axis=1)  # ties -> lower object index
        cover = (counts[np.arange(gh * gw), winner] / float(cell_px * cell_px)).astype(np.float32)
    keep = cover > min_cover
    obj_id = np.where(keep, winner + 1, 0)
    # Lookup tables indexed by object id (0 = background).
    color_lut = np.array([0] + [COLOR_NAMES.index(o.color) + 1 for o in scene.objects], dtype=np.int64)
    shape_lut = np.array([0] + [SHAPES.index(o.shape) + 1 for o in scene.objects], dtype=np.int64)
    letter_lut = np.array(
        [0] + [LETTERS.index(o.letter) + 1 if o.letter else 0 for o in scene.objects], dtype=np.int64
    )
    as_grid = lambda a: a.reshape(gh, gw)  # noqa: E731
    return CellLabels(
        color=as_grid(color_lut[obj_id]),
        shape=as_grid(shape_lut[obj_id]),
        letter=as_grid(letter_lut[obj_id]),
        object=as_grid(obj_id),
        coverage=as_grid(np.where(keep, cover, 0).astype(np.float32)),
    )


def boxes_to_cell_shares(boxes: Sequence[Sequence[float]], image_size: Size, cell_px: int = CELL_PX) -> np.ndarray:
    """float32 [h, w]: how much of each box's area falls in each cell (of ``cell_px``), summed over boxes.

    Every box spreads a weight of 1 over the cells it overlaps (less if it reaches past the
    image), so an object's centre cell outweighs its edge cells and every counted instance
    weighs the same whatever its size. ``image_size`` is (width, height); h = ceil(H /
    cell_px), w = ceil(W / cell_px). Boxes are (x0, y0, x1, y1) px with x1/y1 exclusive;
    empty boxes are ignored.
    """
    gh, gw = _grid_hw(image_size, cell_px)
    shares = np.zeros((gh, gw), dtype=np.float32)
    edges_x, edges_y = np.arange(gw + 1) * cell_px, np.arange(gh + 1) * cell_px
    for x0, y0, x1, y1 in boxes:
        if x1 <= x0 or y1 <= y0:
            continue
        ix = np.clip(np.minimum(x1, edges_x[1:]) - np.maximum(x0, edges_x[:-1]), 0, None)
        iy = np.clip(np.minimum(y1, edges_y[1:]) - np.maximum(y0, edges_y[:-1]), 0, None)
        shares += (np.outer(iy, ix) / ((x1 - x0) * (y1 - y0))).astype(np.float32)
    return shares


def boxes_to_cell_mask(boxes: Sequence[Sequence[float]], image_size: Size, cell_px: int = CELL_PX) -> np.ndarray:
    """bool [h, w]: cells (of ``cell_px``) that share area with any box (`boxes_to_cell_shares` > 0).

    Touching a cell's edge does not count.
    """
    return boxes_to_cell_shares(boxes, image_size, cell_px) > 0


# ---------------------------------------------------------------------------
# Questions: ground truth from a scene
# ---------------------------------------------------------------------------


def ask(scene: Scene, qtype: str, color: str | None = None, shape: str | None = None) -> Question | None:
    """The question of type ``qtype`` about ``color``/``shape`` with its answer.

    Returns None when the question is not valid for this scene: the referred
    object is missing or not unique (color, shape, letter), it carries no
    letter (letter), or the count exceeds 9 (count).
    """
    objs = scene.objects
    if qtype == "color":
        hits = [o for o in objs if o.shape == shape]
        if len(hits) != 1:
            return None
        return Question(qtype, TEMPLATES[qtype].format(shape=shape), (hits[0].color,), (hits[0].box,), None, shape)
    if qtype == "shape":
        hits = [o for o in objs if o.color == color]
        if len(hits) != 1:
            return None
        return Question(qtype, TEMPLATES[qtype].format(color=color), (hits[0].shape,), (hits[0].box,), color, None)
    if qtype == "letter":
        hits = [o for o in objs if o.color == color and o.shape == shape]
        if len(hits) != 1 or hits[0].letter is None:
            return None
        text = TEMPLATES[qtype].format(color=color, shape=shape)
        return Question(qtype, text, (hits[0].letter.lower(),), (hits[0].box,), color, shape)
    if qtype == "exists":
        hits = [o for o in objs if o.color == color and o.shape == shape]
        text = TEMPLATES[qtype].format(color=color, shape=shape)
        return Question(qtype, text, ("yes" if hits else "no",), tuple(o.box for o in hits), color, shape)
    if qtype == "count":
        hits = [o for o in objs if o.shape == shape]
        if len(hits) > 9:
            return None
        text = TEMPLATES[qtype].format(shape=shape)
        return Question(qtype, text, (str(len(hits)),), tuple(o.box for o in hits), None, shape)
    raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")


def _candidates(scene: Scene) -> dict[str, list[Question]]:
    """Every valid question per type (exists split into yes / no)."""
    out: dict[str, list[Question]] = {t: [] for t in QUESTION_TYPES}
    out["exists_no"] = []
    pairs = {(o.color, o.shape) for o in scene.objects}
    for shape in SHAPES:
        for qtype in ("color", "count"):
            if (q := ask(scene, qtype, shape=shape)) is not None:
                out[qtype].append(q)
    for color in COLOR_NAMES:
        if (q := ask(scene, "shape", color=color)) is not None:
            out["shape"].append(q)
        for shape in SHAPES:
            if (color, shape) in pairs and (q := ask(scene, "letter", color, shape)) is not None:
                out["letter"].append(q)
            q = ask(scene, "exists", color, shape)
            out["exists" if (color, shape) in pairs else "exists_no"].append(q)  # type: ignore[arg-type]
    return out


def questions_for_scene(scene: Scene, rng: np.random.Generator, n: int = 1) -> list[Question]:
    """Up to ``n`` distinct valid questions about ``scene``.

    Each question's type is drawn uniformly among the types that still have
    candidates; exists questions are yes/no 50/50 when both exist; within a
    type the candidate is uniform. Fewer than ``n`` come back only when the
    scene has fewer valid questions.
    """
    pools = _candidates(scene)
    chosen: list[Question] = []
    while len(chosen) < n:
        types = [t for t in QUESTION_TYPES if pools[t] or (t == "exists" and pools["exists_no"])]
        if not types:
            break
        qtype = _choice(rng, types)
        key = qtype
        if qtype == "exists":
            options = [k for k in ("exists", "exists_no") if pools[k]]
            key = _choice(rng, options)
        chosen.append(pools[key].pop(int(rng.integers(len(pools[key])))))
    return chosen


# ---------------------------------------------------------------------------
# Planning and composing a scene
# ---------------------------------------------------------------------------


def _plan_question(rng: np.random.Generator, qtype: str, hard: str | None) -> _Plan:
    """Pick the question's attributes and answer uniformly; list what the scene needs."""
    # Void scenes are sparse and small so that most of the canvas is empty.
    side = (MIN_SIDE, 32) if hard == "void" else (MIN_SIDE, MAX_SIDE)
    letter_side = (MIN_LETTER_SIDE, max(MIN_LETTER_SIDE, side[1]))
    border = hard == "border"
    if qtype == "color":
        shape, color = _choice(rng, SHAPES), _choice(rng, COLOR_NAMES)
        return _Plan(qtype, None, shape, color, (_Req(shape, color, side=side, at_border=border),), forbid_shape=shape)
    if qtype == "shape":
        color, shape = _choice(rng, COLOR_NAMES), _choice(rng, SHAPES)
        return _Plan(qtype, color, None, shape, (_Req(shape, color, side=side, at_border=border),), forbid_color=color)
    if qtype == "letter":
        letter = _choice(rng, LETTERS)
        shape = _choice(rng, LETTERED_SHAPES)
        if hard == "low_contrast":
            color = _choice(rng, LOW_CONTRAST_COLORS)
            target = _Req(shape, color, letter, auto_letter=False, side=(MIN_LETTER_SIDE, 34))
            bright_shape = _choice(rng, SHAPES)
            # The distractor often carries its own, high-contrast letter.
            bright_letter = None
            if bright_shape in LETTERED_SHAPES and rng.random() < 0.7:
                bright_letter = _choice(rng, [c for c in LETTERS if c != letter])
            bright = _Req(
                bright_shape,
                _choice(rng, [c for c in BRIGHT_COLORS if c != color]),
                bright_letter,
                auto_letter=False,
                side=(52, MAX_SIDE),
                beside=0,
            )
            required: tuple[_Req, ...] = (target, bright)
        else:
            color = _choice(rng, COLOR_NAMES)
            required = (_Req(shape, color, letter, auto_letter=False, side=letter_side, at_border=border),)
        return _Plan(qtype, color, shape, letter.lower(), required, forbid_pair=(color, shape))
    if qtype == "exists":
        color, shape = _choice(rng, COLOR_NAMES), _choice(rng, SHAPES)
        present = bool(rng.random() < 0.5)
        reqs: list[_Req] = []
        if present:
            reqs += [_Req(shape, color, side=side, at_border=border)] * (2 if rng.random() < 0.2 else 1)
        # Near misses (same colour other shape, same shape other colour) so the
        # answer needs both attributes of one object, not either alone.
        if rng.random() < 0.6:
            reqs.append(_Req(_choice(rng, [s for s in SHAPES if s != shape]), color, side=side))
        if rng.random() < 0.6:
            reqs.append(_Req(shape, _choice(rng, [c for c in COLOR_NAMES if c != color]), side=side))
        if border and not present:
            reqs = [r if i else _Req(r.shape, r.color, side=side, at_border=True) for i, r in enumerate(reqs)]
        return _Plan(qtype, color, shape, "yes" if present else "no", tuple(reqs), forbid_pair=(color, shape))
    if qtype == "count":
        shape, k = _choice(rng, SHAPES), int(rng.integers(0, 10))
        reqs = [_Req(shape, _choice(rng, COLOR_NAMES), side=side, at_border=border and i == 0) for i in range(k)]
        return _Plan(qtype, None, shape, str(k), tuple(reqs), forbid_shape=shape, min_objects=k + 2)
    raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")


def _random_plan(rng: np.random.Generator, hard: str | None) -> _Plan:
    """No question: an unconstrained scene (used by ``generate_scene``)."""
    reqs: tuple[_Req, ...] = ()
    if hard == "low_contrast":
        return _plan_question(rng, "letter", hard)
    if hard == "border":
        reqs = (_Req(_choice(rng, SHAPES), _choice(rng, COLOR_NAMES), at_border=True),)
    return _Plan("none", None, None, "", reqs)


def _draw_background(rng: np.random.Generator, hard: str | None) -> tuple[tuple[int, int, int], str, int, int]:
    """(rgb, texture, amp, texture_seed): grey 20-120 or muted (sat <= 0.25, val <= 0.5).

    The base colour keeps ``amp`` levels of headroom so the textured pixels
    stay inside the spec's background range.
    """
    texture = "flat" if hard == "void" else str(_TEXTURES[int(rng.choice(len(_TEXTURES), p=_TEXTURE_P))])
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
        kind = _choice(rng, ("line", "rect", "ellipse"))
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


def _make_object(rng: np.random.Generator, req: _Req, box: Box, letter_rate: float = P_LETTER) -> SceneObject:
    """Fill colour, letter and font size for a placed request."""
    w, h = box[2] - box[0], box[3] - box[1]
    letter = req.letter
    eligible = req.shape in LETTERED_SHAPES and min(w, h) >= MIN_LETTER_SIDE
    if letter is None and req.auto_letter and eligible and rng.random() < letter_rate:
        letter = _choice(rng, LETTERS)
    letter_size = None
    if letter is not None:
        if not eligible:
            raise RuntimeError(f"bug: letter requested on an ineligible {req.shape} of {w}x{h} px")
        lo = math.ceil(MIN_LETTER_FRAC * h)
        hi = max(lo, math.floor(_MAX_LETTER_FRAC[req.shape] * h))
        letter_size = int(rng.integers(lo, hi + 1))
    return SceneObject(req.shape, req.color, jitter_color(rng, req.color), box, letter, letter_size)


def _allowed(plan: _Plan, color: str, shape: str) -> bool:
    return not (
        shape == plan.forbid_shape or color == plan.forbid_color or (color, shape) == plan.forbid_pair
    )


def _compose(
    rng: np.random.Generator, size: Size, plan: _Plan, hard: str | None, letter_rate: float = P_LETTER,
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
        color, shape = _choice(rng, COLOR_NAMES), _choice(rng, SHAPES)
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
        objects.append(_make_object(rng, _Req(shape, color), box, letter_rate))
        placed = np.vstack([placed, np.asarray(box)[None]])
    if len(objects) < MIN_OBJECTS:
        raise RuntimeError(f"bug: placed only {len(objects)} objects on a {size} canvas; report the seed")

    faint = _faint_marks(rng, size, background) if hard == "void" else ()
    return Scene(size[0], size[1], background, tuple(objects), texture, amp, texture_seed, faint, hard)


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def generate_scene(rng: np.random.Generator, size: Size = DEFAULT_CANVAS, hard: str | None = None) -> Scene:
    """A random scene with no planned question (use ``questions_for_scene`` on it)."""
    if hard is not None and hard not in HARD_KINDS:
        raise ValueError(f"hard must be None or one of {HARD_KINDS}, got {hard!r}")
    size = parse_canvas(size)  # type: ignore[assignment]
    if size == "random":
        raise ValueError("generate_scene needs a concrete (width, height); draw one with draw_canvas(rng, 'random')")
    return _compose(rng, size, _random_plan(rng, hard), hard)


def item_id(split: str, index: int) -> str:
    """'test', 123 -> 'test-000123' (also the PNG's stem)."""
    return f"{split}-{index:06d}"


def make_record(question: Question, split: str, index: int, hard: str | None = None) -> dict:
    """The JSONL record (spec keys in spec order, plus "hard" for hard cases)."""
    rid = item_id(split, index)
    record = {
        "id": rid,
        "image": f"images/{rid}.png",
        "question": question.text,
        "answers": list(question.answers),
        "type": question.type,
        "boxes": [list(b) for b in question.boxes],
    }
    if hard is not None:
        record["hard"] = hard
    return record


def make_item(
    seed: int, split: str = "test", index: int = 0, canvas: Canvas = DEFAULT_CANVAS,
    hard_rate: float = DEFAULT_HARD_RATE, letter_rate: float = P_LETTER,
) -> Item:
    """Generate item ``index`` of ``split`` in memory: (PIL image, record, scene).

    Deterministic in (seed, split, index, canvas, hard_rate, letter_rate); nothing is
    written. The question type is uniform over QUESTION_TYPES and its answer uniform
    over the type's answers (exists: yes/no 50/50, count: 0-9). ``letter_rate`` (the
    chance an eligible distractor carries a letter) is for training only: the
    benchmark uses the default.
    """
    rng = item_rng(seed, split, index)
    size = draw_canvas(rng, canvas)
    qtype = _choice(rng, QUESTION_TYPES)
    hard = draw_hard(rng, qtype, hard_rate)
    plan = _plan_question(rng, qtype, hard)
    scene = _compose(rng, size, plan, hard, letter_rate)
    question = ask(scene, plan.qtype, plan.color, plan.shape)
    if question is None or question.answers != (plan.answer,):
        raise RuntimeError(
            f"bug: planned {plan.qtype} answer {plan.answer!r} but the scene gives {question}; "
            f"report seed={seed} split={split!r} index={index}"
        )
    return Item(render_scene(scene), make_record(question, split, index, hard), scene)


def generate_split(
    n: int, seed: int = 0, split: str = "test", canvas: Canvas = DEFAULT_CANVAS,
    hard_rate: float = DEFAULT_HARD_RATE, start: int = 0,
) -> Iterator[Item]:
    """Items ``start .. start + n - 1`` of a split, lazily, in index order."""
    for index in range(start, start + n):
        yield make_item(seed, split, index, canvas, hard_rate)


# ---------------------------------------------------------------------------
# Writing a split to disk
# ---------------------------------------------------------------------------

PNG_COMPRESS_LEVEL = 3  # zlib level: ~2x faster than 6 for ~15% larger files; bytes fixed per zlib build


def _write_one(args: tuple[str, str, int, int, Canvas, float]) -> dict:
    """Generate item ``index`` and save its PNG; returns the record (pool worker)."""
    out_dir, split, seed, index, canvas, hard_rate = args
    image, record, _ = make_item(seed, split, index, canvas, hard_rate)
    image.save(f"{out_dir}/{record['image']}", format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return record


def write_split(
    out_dir: str | Path, split: str = "test", n: int = 2000, seed: int = 0,
    canvas: Canvas = DEFAULT_CANVAS, hard_rate: float = DEFAULT_HARD_RATE,
    workers: int = 1, progress: bool = False,
) -> Path:
    """Write ``out_dir/images/<split>-NNNNNN.png`` and ``out_dir/<split>.jsonl``.

    Output bytes depend only on the arguments (not on ``workers``): items are
    seeded independently and records are written in index order. Returns the
    JSONL path.
    """
    from .jsonl import write_jsonl

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not split or not all(c.isalnum() or c in "_-" for c in split):
        raise ValueError(f"split {split!r} must be a plain name of letters, digits, '_' or '-' (it names files)")
    parse_canvas(canvas)  # fail before spawning anything
    draw_hard(np.random.Generator(np.random.PCG64(0)), "color", hard_rate)  # validates hard_rate
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    jobs = [(str(out), split, seed, i, canvas, hard_rate) for i in range(n)]

    bar = None
    if progress:
        from tqdm import tqdm  # lazily: only the CLI wants a bar

        bar = tqdm(total=n, desc=f"gen-data {split}", unit="img")
    records: list[dict] = []
    try:
        if workers == 1:
            results: Iterator[dict] = map(_write_one, jobs)
            for record in results:
                records.append(record)
                if bar is not None:
                    bar.update(1)
        else:
            import multiprocessing

            with multiprocessing.get_context().Pool(workers) as pool:
                for record in pool.imap(_write_one, jobs, chunksize=8):  # imap keeps index order
                    records.append(record)
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return write_jsonl(records, out / f"{split}.jsonl")
