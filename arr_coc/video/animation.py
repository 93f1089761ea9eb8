"""Animated GIF and APNG files as clips: read by the time each frame is shown, not by the frames stored.

An animation stores a frame once however long it is shown (an encoder merges identical consecutive frames into one
with a longer duration: a ShapesVQA-video clip of 16 half-second frames can be 2 stored frames of 4 s each).
Decoding the stored frames, as a video decoder does, reads such a clip as 2 frames; its frames in memory, its
generator and the embedded model's training read it as 16. So an animation is a constant-rate source at the rate
it is sampled at (`fps`, 2 by default; finer when a frame is shown for less than a sampling step): the frame shown
at each time step, t_k = k / rate, over its duration, then the family's stock rule on that source
(`decode.sample_indices`), as for a video of that rate. `num_frames`
spreads that many sample times evenly over the duration; `fps=None` keeps the stored frames, each once. Frames with
transparency are flattened onto white, as frames in memory and pictures are. Pillow reads them (its GIF and APNG
readers give each frame's duration; FFmpeg's give the stored frames).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np

from ..cancel import checkpoint
from .clip import Clip
from .decode import VideoError, _pil_rgb, load_clip, sample_indices

ANIMATION_EXTENSIONS = frozenset({".gif", ".png", ".apng"})
DEFAULT_FRAME_MS = 100.0      # what browsers show a GIF frame whose duration is 0


def animation_frames(path: str | os.PathLike) -> int:
    """How many frames the file stores if it is an animated GIF / APNG (at least 2); 0 for anything else (a still
    picture, another format, a file that cannot be read). What decides whether a path is a picture or a clip."""
    frames, _ = _stored(path)
    return frames if frames > 1 else 0


def is_animation(path: str | os.PathLike) -> bool:
    """A GIF / APNG to read as a clip when a clip is asked for: stored frames, or one stored frame shown for a
    time (an encoder keeps a clip whose frames are all alike as one frame with the clip's duration)."""
    frames, seconds = _stored(path)
    return frames > 1 or (frames == 1 and seconds > 0)


def _stored(path: str | os.PathLike) -> tuple[int, float]:
    """(stored frames, the first frame's duration in seconds) of a GIF / APNG; (0, 0.0) for anything else. One
    request asks this of the same file several times (is it a clip, check it, read it, say so): the header is read
    once per file version (path, modification time, size)."""
    path = os.fspath(path)
    if os.path.splitext(path)[1].lower() not in ANIMATION_EXTENSIONS or not os.path.isfile(path):
        return 0, 0.0
    stat = os.stat(path)
    return _read_header(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _read_header(path: str, mtime_ns: int, size: int) -> tuple[int, float]:
    try:
        from PIL import Image

        with Image.open(path) as im:
            if im.format not in ("GIF", "PNG"):
                return 0, 0.0
            return int(getattr(im, "n_frames", 1)), float(im.info.get("duration") or 0.0) / 1000.0
    except Exception:  # noqa: BLE001 - not an animation we can read: the caller reads it as what it is
        return 0, 0.0


def read_animation(path: str, shown: str) -> tuple[np.ndarray, np.ndarray]:
    """(stored frames uint8 [S, H, W, 3] flattened onto white, each frame's duration in seconds [S])."""
    from PIL import Image

    frames, durations = [], []
    try:
        with Image.open(path) as im:
            for i in range(int(getattr(im, "n_frames", 1))):
                checkpoint("decoding")
                im.seek(i)
                frames.append(_pil_rgb(im.convert("RGBA"), f"frame {i}"))
                ms = float(im.info.get("duration") or 0.0)
                durations.append((ms if ms > 0 else DEFAULT_FRAME_MS) / 1000.0)
    except VideoError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for damaged data
        raise VideoError(f"{shown} is truncated or damaged ({type(exc).__name__}): re-save it and try again.",
                         "video_damaged") from None
    if len({f.shape for f in frames}) > 1:
        raise VideoError(f"{shown} changes frame size mid-animation: re-save it at one size.", "video_frames_mismatch")
    return np.stack(frames), np.asarray(durations, dtype=np.float64)


def load_animation(path: str, shown: str, frame_rate: float | None, sampling: dict[str, Any]) -> Clip:
    """An animated GIF / APNG -> Clip (module docstring). frame_rate: read the stored frames as a constant-rate
    source at that rate instead (their durations ignored), as frames in memory are."""
    stored, durations = read_animation(path, shown)
    if frame_rate is not None:
        clip = load_clip(stored, frame_rate=frame_rate, **sampling)
        return Clip(frames=clip.frames, timestamps=clip.timestamps, fps=clip.fps, source=path, indices=clip.indices,
                    total_frames=clip.total_frames)
    fps, num_frames = sampling.get("fps"), sampling.get("num_frames")
    starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    length = float(durations.sum())
    if num_frames is None and fps is None:                  # every stored frame, once, at its own time
        return Clip(frames=stored, timestamps=starts, fps=len(stored) / length, source=path,
                    indices=np.arange(len(stored)), total_frames=len(stored))
    # the timeline's rate: the sampling rate, or finer when a stored frame is shown for less than one sampling step
    # (then the stock rule samples it as it samples a video of that rate)
    rate = max(float(fps) if fps is not None else 2.0, 1.0 / float(durations.min()))
    times = np.arange(max(1, int(round(length * rate)))) / rate
    shown_at = np.clip(np.searchsorted(starts, times + 1e-9, side="right") - 1, 0, len(stored) - 1)
    picked = sample_indices(len(times), rate, **sampling)    # the family's stock rule on that constant-rate source
    return Clip(frames=np.ascontiguousarray(stored[shown_at[picked]]), timestamps=times[picked], fps=rate,
                source=path, indices=picked, total_frames=len(times))


def animated_notes(path: str | os.PathLike) -> list[str]:
    """What is said when a path given as a picture is a clip, read as one (by the model for clips, as if given as
    a video): one note for an animated GIF / APNG and for a video file (issue 55: an mp4 too), none otherwise."""
    from .decode import VIDEO_EXTENSIONS

    frames = animation_frames(path)
    if frames:
        return [f"The animated image ({frames} frames) is read as a clip, its frames over time; save one frame as "
                "a picture to ask about it alone."]
    if os.path.splitext(os.fspath(path))[1].lower() in VIDEO_EXTENSIONS:
        return ["The video file given as a picture is read as a clip, its frames over time (as a video is); "
                "save one frame as a picture to ask about it alone."]
    return []


__all__ = ["ANIMATION_EXTENSIONS", "animated_notes", "animation_frames", "is_animation", "load_animation", "read_animation"]
