"""ShapesVQA's vocabulary and constants (spec: docs/SHAPESVQA.md): colours, shapes, letters,
question types and templates, the hard-case kinds, sizes, and the letter ink.

Ids used by ``cell_labels`` are the 1-based positions in COLOR_NAMES / SHAPES / LETTERS;
0 is background. Standard library only (no numpy), so the command line can read the
defaults without loading the generator.
"""

from __future__ import annotations

import math
import string
from typing import Sequence, Union

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
MAX_LETTER_FRAC = {"circle": 0.72, "square": 0.75, "diamond": 0.6}
P_LETTER = 0.35  # chance that an eligible non-target object carries a letter

# Hard case "low_contrast": the lettered target takes a mid-luminance colour
# (black/white text contrasts least on these) and sits beside a large, bright,
# saturated distractor that draws any saliency-driven allocator away.
LOW_CONTRAST_COLORS = ("green", "cyan", "purple", "orange")
BRIGHT_COLORS = ("yellow", "red", "orange")

# A regular star of outer radius R spans 2 R cos 18deg across and R (1 + sin 54deg) down.
STAR_H_OVER_W = (1 + math.sin(math.radians(54))) / (2 * math.cos(math.radians(18)))  # ~0.951
TEXTURES = ("flat", "noise", "blobs", "stripes")
TEXTURE_P = (0.45, 0.15, 0.2, 0.2)

Size = tuple[int, int]  # (width, height) px
Box = tuple[int, int, int, int]  # (x0, y0, x1, y1) px, x1/y1 exclusive
Canvas = Union[str, Size]  # "448x448", "random" or (width, height)


def letter_ink(rgb: Sequence[int]) -> tuple[int, int, int]:
    """Black or white, whichever contrasts more with ``rgb`` (Rec. 601 luma)."""
    luma = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return (0, 0, 0) if luma >= 127.5 else (255, 255, 255)
