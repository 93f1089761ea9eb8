"""Rendering a scene: shapes, letters, background textures and faint marks.

``render_scene`` is a pure function of the ``Scene`` (texture noise has its own stored
seed), so it always reproduces an item's image.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .scene import Scene, SceneObject
from .vocabulary import SHAPES, STAR_H_OVER_W, TEXTURES, Box


def box_dims(shape: str, side: int) -> tuple[int, int]:
    """(w, h) of a shape's tight box whose longer side is ``side``.

    Stars keep a regular star's proportions (slightly wider than tall); every
    other shape has a square box.
    """
    if shape == "star":
        return side, round(side * STAR_H_OVER_W)
    return side, side



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
    raise ValueError(f"unknown texture {scene.texture!r}; expected one of {TEXTURES}")


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
