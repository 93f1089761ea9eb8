"""The pictures `bench` measures on, drawn here so that the installed library benches without the checkout's test bed.

    image, question = bench_scene(seed=0, index=3, size=896)

A seeded scene like ShapesVQA's (docs/SHAPESVQA.md), not a copy of its generator: a flat background with a faint
seeded texture and 8-24 filled circles, squares, triangles and diamonds of 20-64 px in six colours, and a question
in the embedded model's words. The layer's cost depends on what a picture holds (its object channel labels connected
components, its information scorer reads the spectrum), so a bench picture is cluttered as the test bed's are, never
blank or noise. Deterministic in (seed, index, size): numpy's PCG64, PIL's drawing.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40),
           "purple": (140, 60, 180), "orange": (240, 130, 30)}
SHAPES = ("circle", "square", "triangle", "diamond")
OBJECTS = (8, 24)                  # objects per scene, inclusive
SIDES = (20, 64)                   # an object's side, px, inclusive
TEXTURE = 12.0                     # the background texture's amplitude (grey levels)


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """A light flat colour plus smooth noise (8 x 8 values spread over the picture)."""
    base = rng.integers(200, 246, size=3).astype(np.float32)                      # [3]
    coarse = rng.standard_normal((8, 8)).astype(np.float32) * TEXTURE              # [8, 8]
    field = np.asarray(Image.fromarray(coarse, "F").resize((size, size), Image.BILINEAR))  # [H, W]
    return Image.fromarray(np.clip(np.rint(base + field[..., None]), 0, 255).astype(np.uint8), "RGB")


def _draw(draw: ImageDraw.ImageDraw, shape: str, x0: int, y0: int, side: int, fill: tuple[int, int, int]) -> None:
    x1, y1 = x0 + side - 1, y0 + side - 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        draw.polygon([(x0, y1), (cx, y0), (x1, y1)], fill=fill)
    else:
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)


def bench_scene(seed: int, index: int, size: int) -> tuple[Image.Image, str]:
    """(a size x size RGB picture, a question about it), the same for the same arguments."""
    if size < SIDES[1] + 1:
        raise ValueError(f"bench scenes are at least {SIDES[1] + 1} px a side (got {size})")
    rng = np.random.default_rng((seed, index, size))
    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    names = list(COLOURS)
    for _ in range(int(rng.integers(OBJECTS[0], OBJECTS[1] + 1))):
        side = int(rng.integers(SIDES[0], SIDES[1] + 1))
        x0, y0 = (int(v) for v in rng.integers(0, size - side, size=2))
        _draw(draw, SHAPES[int(rng.integers(len(SHAPES)))], x0, y0, side, COLOURS[names[int(rng.integers(len(names)))]])
    shape, colour = SHAPES[int(rng.integers(len(SHAPES)))], names[int(rng.integers(len(names)))]
    question = (f"How many {shape}s are there?", f"Is there a {colour} {shape}?", f"What color is the {shape}?")
    return image, question[int(rng.integers(len(question)))]


__all__ = ["bench_scene"]
