"""The one clip reader: every route (`generate`, `ask --video`, the app, `eval`) reads a video file, an animation or
frames in memory through `load_clip` here, so the same clip gives the same frames everywhere.

    a video file (mp4, webm, avi, mkv, mov, ...)   PyAV, the stock pixels and sampling rule   (`decode.py`)
    an animated GIF / APNG                         by the time each frame is shown           (`animation.py`)
    frames in memory, a Clip                       as given                                  (`decode.py`)
"""

from __future__ import annotations

import os
from typing import Any

from .animation import animation_frames, is_animation, load_animation
from .clip import Clip
from .decode import VIDEO_EXTENSIONS, VideoError
from .decode import load_clip as _load_any


def is_clip_path(value: Any) -> bool:
    """A str / PathLike that is a clip: a video container's extension, or an animated GIF / APNG (a still GIF or
    PNG is a picture)."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    path = os.fspath(value)
    return os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS or animation_frames(path) > 1


def load_clip(video: Any, fps: float | None = 2.0, num_frames: int | None = None, max_frames: int | None = None,
              min_frames: int | None = None, frame_rate: float | None = None, *, family: str | None = None,
              name: str | None = None) -> Clip:
    """A video -> `Clip`, by the reader for what it is (module docstring; `decode.load_clip` says what each
    argument does and what is refused)."""
    if isinstance(video, (str, os.PathLike)) and is_animation(video):
        path = os.fspath(video)
        if frame_rate is not None and (not frame_rate > 0 or frame_rate != frame_rate):
            raise VideoError(f"frame_rate={frame_rate!r} is not a frame rate: give frames per second above 0.",
                             "video_sampling")
        sampling = dict(fps=fps, num_frames=num_frames, min_frames=min_frames, max_frames=max_frames, family=family)
        return load_animation(path, repr(path) if name is None else name, frame_rate, sampling)
    return _load_any(video, fps, num_frames, max_frames, min_frames, frame_rate, family=family, name=name)


__all__ = ["is_clip_path", "load_clip"]
