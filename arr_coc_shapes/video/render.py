"""Rendering a clip from its track with the image set's own drawing (``draw_shape``, ``draw_letter``,
``render_background``), so every frame's shapes are pixel for pixel what ``render_scene`` draws.

Each shot's world background is rendered once; frame t is that background with the present actors
drawn at their world boxes, cropped to the camera's window. Without a pan the world is the canvas and
frame t equals ``render_scene(track.frame_scene(t))`` exactly.
"""

from __future__ import annotations

import numpy as np
from PIL import ImageDraw

from ..drawing import draw_letter, draw_shape, render_background
from ..scene import SceneObject
from .track import Track


def render_clip(track: Track) -> np.ndarray:
    """The clip as uint8 [N, H, W, 3]; deterministic in ``track``."""
    backgrounds = [render_background(track.world_scene(s)) for s in range(len(track.shots))]
    frames = np.empty((track.n_frames, track.height, track.width, 3), dtype=np.uint8)
    for t in range(track.n_frames):
        image = backgrounds[track.shot_at(t)].copy()
        draw = ImageDraw.Draw(image)
        for i, obj in track.objects_at(t):
            # objects_at gives canvas boxes; draw at world boxes, then crop the window
            world = SceneObject(obj.shape, obj.color, obj.rgb, track.actors[i].world_box(t), obj.letter,
                                obj.letter_size)
            draw_shape(draw, world.shape, world.box, world.rgb)
            draw_letter(draw, world)
        cx, cy = track.camera(t)
        frames[t] = np.asarray(image.crop((cx, cy, cx + track.width, cy + track.height)))
    return frames
