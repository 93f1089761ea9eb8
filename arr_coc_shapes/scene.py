"""The scene description a ShapesVQA item is rendered from: objects, faint marks, background.

Boxes are ``(x0, y0, x1, y1)`` integer pixels with ``x1``/``y1`` exclusive (PIL crop
convention); sizes are (width, height) as in PIL.
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocabulary import Box, Size, letter_ink


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


