"""A clip's scene track: the objects (actors) with their positions, colours and presence over time,
the camera (pan) and the shots (a cut starts the second). Everything about a frame follows from the
track, so rendering and the ground truth both read it.

Coordinates: an actor's ``box`` is in world pixels at frame 0 and moves by ``velocity`` px per frame
(box at frame t = box + t * velocity). The world is the canvas grown by the camera's travel; frame t
shows the window of the canvas size at ``Track.camera(t)``. Boxes are (x0, y0, x1, y1), x1 / y1
exclusive (PIL crop convention), as in the image set.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..scene import Scene, SceneObject
from ..vocabulary import Box, Size

RGB = tuple[int, int, int]


@dataclass(frozen=True)
class Recolor:
    frame: int  # first frame in the new colour
    color: str
    rgb: RGB


@dataclass(frozen=True)
class Actor:
    """One filled shape over time; present in frames appear <= t < vanish of its shot."""

    shape: str
    color: str  # colour name before any recolor
    rgb: RGB
    box: Box  # world box at frame 0
    shot: int = 0
    velocity: tuple[int, int] = (0, 0)  # px per frame, world coordinates
    appear: int = 0  # first frame present (clamped to its shot's first frame)
    vanish: int | None = None  # first frame absent again; None: present to its shot's end
    recolor: Recolor | None = None
    letter: str | None = None
    letter_size: int | None = None

    @property
    def moving(self) -> bool:
        return self.velocity != (0, 0)

    def world_box(self, t: int) -> Box:
        x0, y0, x1, y1 = self.box
        vx, vy = self.velocity
        return (x0 + t * vx, y0 + t * vy, x1 + t * vx, y1 + t * vy)

    def color_at(self, t: int) -> tuple[str, RGB]:
        if self.recolor is not None and t >= self.recolor.frame:
            return self.recolor.color, self.recolor.rgb
        return self.color, self.rgb


@dataclass(frozen=True)
class Shot:
    """The background of one shot (same fields as the image ``Scene``'s), in world size."""

    background: RGB
    texture: str = "flat"
    texture_amp: int = 0
    texture_seed: int = 0


@dataclass(frozen=True)
class Track:
    width: int  # canvas (one frame)
    height: int
    n_frames: int
    shots: tuple[Shot, ...]  # one, or two when there is a cut
    actors: tuple[Actor, ...]
    pan: tuple[int, int] | None = None  # camera px per frame
    cut: int | None = None  # first frame of the second shot

    @property
    def size(self) -> Size:
        return (self.width, self.height)

    @property
    def travel(self) -> tuple[int, int]:
        """The camera's whole travel (px along x, y): the world is this much larger than the canvas."""
        dx, dy = self.pan or (0, 0)
        return (abs(dx) * (self.n_frames - 1), abs(dy) * (self.n_frames - 1))

    @property
    def world_size(self) -> Size:
        tx, ty = self.travel
        return (self.width + tx, self.height + ty)

    @property
    def safe_region(self) -> Box:
        """World pixels inside every frame's window: objects stay in here, so they are always in view."""
        tx, ty = self.travel
        return (tx, ty, self.width, self.height)

    def camera(self, t: int) -> tuple[int, int]:
        """World (x, y) of frame t's top-left pixel."""
        dx, dy = self.pan or (0, 0)
        tx, ty = self.travel
        return ((tx if dx < 0 else 0) + t * dx, (ty if dy < 0 else 0) + t * dy)

    def shot_at(self, t: int) -> int:
        return 1 if self.cut is not None and t >= self.cut else 0

    def shot_frames(self, shot: int) -> range:
        if self.cut is None:
            return range(self.n_frames)
        return range(0, self.cut) if shot == 0 else range(self.cut, self.n_frames)

    def present(self, i: int, t: int) -> bool:
        a = self.actors[i]
        return (self.shot_at(t) == a.shot and t >= a.appear and (a.vanish is None or t < a.vanish))

    def frames_of(self, i: int) -> list[int]:
        return [t for t in range(self.n_frames) if self.present(i, t)]

    def box_at(self, i: int, t: int) -> Box:
        """Actor i's box on frame t's canvas (whether or not it is present)."""
        (x0, y0, x1, y1), (cx, cy) = self.actors[i].world_box(t), self.camera(t)
        return (x0 - cx, y0 - cy, x1 - cx, y1 - cy)

    def objects_at(self, t: int) -> list[tuple[int, SceneObject]]:
        """(actor index, object in canvas coordinates, as drawn) for the actors present in frame t."""
        out = []
        for i, a in enumerate(self.actors):
            if self.present(i, t):
                color, rgb = a.color_at(t)
                out.append((i, SceneObject(a.shape, color, rgb, self.box_at(i, t), a.letter, a.letter_size)))
        return out

    def frame_scene(self, t: int) -> Scene:
        """Frame t as an image ``Scene``; ``render_scene`` of it gives the frame exactly when there is no pan
        (with a pan the background is a window on the world's texture, which a canvas Scene cannot say)."""
        shot = self.shots[self.shot_at(t)]
        objects = tuple(obj for _, obj in self.objects_at(t))
        return Scene(self.width, self.height, shot.background, objects, shot.texture, shot.texture_amp,
                     shot.texture_seed)

    def world_scene(self, shot: int) -> Scene:
        """The shot's world background (no objects) as an image ``Scene``: what the camera pans over."""
        s = self.shots[shot]
        w, h = self.world_size
        return Scene(w, h, s.background, (), s.texture, s.texture_amp, s.texture_seed)
