"""A video, checked: a file's path, size and header before any frame is decoded (`check_video_file`), then read
and sampled as the model's processor samples (`check_clip`). Refusals are `InputError`s (`VideoError`s are)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import InputError
from .limits import LIMITS, InputLimits

if TYPE_CHECKING:
    from ..video.clip import Clip


def check_clip(value: Any, limits: InputLimits = LIMITS, name: str | None = None,
               sampling: Mapping[str, Any] | None = None) -> Clip:
    """Any video a caller passes -> a checked `arr_coc.video.Clip`. Raises InputError (`VideoError`s are).

    value     a video file path, a list of frames, an array [N, H, W, 3] / [N, 3, H, W], or a Clip
    name      how messages call a file (the CLI passes the path the user typed; None: "the uploaded video",
              so a server's temporary path never shows)
    sampling  `load_clip` keywords (family, fps, num_frames, min_frames, max_frames, frame_rate); max_frames
              is capped at `limits.max_frames`

    A file's header is checked before any frame is decoded: its frame size, and the size of the frames the
    sampling will keep (`max_clip_pixels`). A one-frame clip is refused: it is a picture, pass it as an image.
    """
    from ..video.clip import Clip
    from ..video.reading import load_clip

    sampling = dict(sampling or {})
    rate = sampling.pop("frame_rate", None)
    asked = sampling.get("max_frames")
    sampling["max_frames"] = limits.max_frames if asked is None else min(int(asked), limits.max_frames)
    if isinstance(value, Clip):
        clip = value
    elif isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        shown = repr(name) if name else "the uploaded video"
        check_video_file(path, limits, name, sampling, rate)
        clip = load_clip(path, frame_rate=rate, name=shown, **sampling)
    elif value is None:
        raise InputError("No video: give a video file, a list of frames or an arr_coc.video.Clip.", "video_missing")
    else:
        clip = load_clip(value, frame_rate=rate, **sampling)
    _check_frame(clip.width, clip.height, limits)
    n = clip.num_frames
    if n < limits.min_frames:
        raise InputError(f"The video has {n} frame{'s' if n != 1 else ''}: a one-frame clip is an image, pass it as an "
                         f"image (a video needs at least {limits.min_frames} frames).", "video_too_short")
    if n > limits.max_frames:        # a clip sampled already, as a file is: kept to the cap, evenly, as a file is
        clip = cap_frames(clip, limits.max_frames)
    _check_clip_pixels(clip.num_frames, clip.width, clip.height, limits)
    return clip


def cap_frames(clip: Clip, most: int) -> Clip:
    """`clip` with at most `most` frames (an even count: whole temporal groups), evenly spread over its frames, as
    sampling a file with max_frames keeps them."""
    import numpy as np

    from ..video.clip import Clip

    keep = max(2, most - most % 2)
    at = np.linspace(0, clip.num_frames - 1, keep).round().astype(np.int64)
    return Clip(frames=np.ascontiguousarray(clip.frames[at]), timestamps=clip.timestamps[at], fps=clip.fps,
                source=clip.source, indices=clip.indices[at], total_frames=clip.total_frames)


def check_video_file(path: str | os.PathLike, limits: InputLimits = LIMITS, name: str | None = None,
                     sampling: Mapping[str, Any] | None = None, frame_rate: float | None = None) -> None:
    """A video file's checks that need no decoding (its path, size and header: frame size, the pixels the sampling
    will keep), so a command can refuse a bad clip before it loads a model. InputError."""
    from ..video.animation import is_animation
    from ..video.decode import check_path, probe_video, sample_indices

    path = os.fspath(path)
    shown = repr(name) if name else "the uploaded video"
    size = check_path(path, shown)
    if size > limits.max_video_file_bytes:
        raise InputError(f"The video file is {size:,} bytes, over the {limits.max_video_file_bytes / 2**20:.0f} MB "
                         "limit. Cut it shorter or save it smaller and try again.", "file_too_large")
    if is_animation(path):      # an animation: its frames' size from its header; its length once read
        from PIL import Image

        with Image.open(path) as im:
            _check_frame(im.width, im.height, limits)
        return
    info = probe_video(path, name=shown, frame_rate=frame_rate)
    _check_frame(info.width, info.height, limits)
    sampling = dict(sampling or {})
    sampling.setdefault("max_frames", limits.max_frames)
    if info.frames:
        kept = len(sample_indices(info.frames, info.fps, **sampling))
        _check_clip_pixels(kept, info.width, info.height, limits)


def _check_frame(w: int, h: int, limits: InputLimits) -> None:
    if w * h > limits.max_decode_pixels:
        raise InputError(f"The video's frames are {w}x{h} px ({w * h / 1e6:.0f} megapixels): too large to decode here "
                         f"(limit {limits.max_decode_pixels / 1e6:.0f} MP). Downscale it and try again.",
                         "video_too_large")
    if w * h < limits.min_image_pixels:
        side = math.isqrt(limits.min_image_pixels)
        raise InputError(f"The video's frames are {w}x{h} px: too small to show anything. Give frames of at least "
                         f"{side}x{side} px (one visual token covers {side}x{side} px).", "video_too_small")
    if max(w, h) / min(w, h) > limits.max_aspect:
        raise InputError(f"The video's frames are {w}x{h} px, an aspect ratio of {max(w, h) / min(w, h):,.0f}:1: too "
                         f"thin (Qwen-VL takes up to {limits.max_aspect:.0f}:1). Crop it closer to the region of "
                         "interest.", "video_too_thin")


def _check_clip_pixels(n: int, w: int, h: int, limits: InputLimits) -> None:
    if n * w * h > limits.max_clip_pixels:
        raise InputError(f"The video's {n} sampled frames of {w}x{h} px hold {n * w * h / 1e6:.0f} megapixels, over the "
                         f"{limits.max_clip_pixels / 1e6:.0f} MP a video may hold: sample fewer frames (a lower fps or "
                         "num_frames) or downscale it.", "video_too_large")
