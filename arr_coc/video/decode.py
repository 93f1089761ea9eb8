"""Decoding and sampling a video into a `Clip`, the way the stock Qwen-VL video processors sample.

    clip = load_clip("walk.mp4")                        # 2 frames per second, Qwen2-VL's rule
    clip = load_clip("walk.mp4", num_frames=8, family="qwen3_vl")
    clip = load_clip([frame0, frame1, frame2, frame3])  # frames in memory: every frame, 2 frames per second

Files are decoded with PyAV (`av`, FFmpeg bundled in its wheel) to RGB24, the call transformers' own PyAV
reader makes (`frame.to_ndarray(format="rgb24")`), so the pixels are the stock ones. The source's frame
rate is the stream's `average_rate` (also transformers' choice; a header that states none, or 0 fps, leaves it
unknown: derived from the duration when there is one, else sampling by fps is refused with what to pass);
`frame_rate=` overrides it. A frame with transparency is flattened onto white, as frames in memory are. Timestamps are
the frames' presentation times, from the first frame: for a constant-rate video exactly `index / fps`,
the value the stock processors compute; for a variable-rate one the times the frames are really shown.

Sampling (`sample_indices`) is the stock `sample_frames` of the family's video processor
(transformers 5.23), chosen by `family`:

- "qwen2_vl" / "qwen2_5_vl" (also `family=None`), `Qwen2VLVideoProcessor.sample_frames`:
  with `num_frames`: n = round(num_frames / T) * T (T = temporal_patch_size = 2; Python's round, so 3 -> 4 and
  5 -> 4); with `fps`: n = total / source_fps * fps, clamped to [min_frames, floor(min(max_frames, total) / T)
  * T] and to total, then floored to a multiple of T. Indices: `torch.arange(0, total, total / n).int()`.
- "qwen3_vl", `Qwen3VLVideoProcessor.sample_frames`: with `num_frames`: n = num_frames; with `fps`:
  n = int(total / source_fps * fps) clamped to [min_frames, max_frames] and to total; no rounding to T (the
  processor repeats the last frame to fill the last temporal group). Indices:
  `np.linspace(0, total - 1, n).round()`.

min_frames / max_frames default to the stock 4 / 768. Where this module departs from the stock code, it is
to refuse or keep rather than crash or repeat: a one-frame source is kept whole (the stock Qwen2-VL rule
divides by zero), a rounded count of 0 becomes T, `num_frames` larger than the source is refused (the
stock Qwen3-VL rule would repeat frames), `num_frames` above `max_frames` is refused, and `fps=None`
keeps every frame (refused when that is more than `max_frames`).

Frames given in memory (a list of PIL images / HxWx3 uint8 arrays / 3xHxW float tensors in [0, 1], or one
[N, H, W, 3] / [N, 3, H, W] array or tensor) are a source at `frame_rate` (default 2.0) and are used whole
unless `num_frames` is given or `fps` is below `frame_rate` (then sampled by the same rule), or they are more than
`max_frames` (then kept to max_frames, evenly, as a file sampled at its own rate is; `fps=None` still asks for
every frame, and is refused above max_frames). Errors are
`VideoError`, an `arr_coc.errors.InputError` (a ValueError) whose message says what to do and whose `code`
names the case.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cancel import Cancelled, checkpoint
from ..errors import InputError
from .clip import Clip

# Video containers' extensions: a path with one is a clip where an image could be (`reading.is_clip_path`, which
# adds animated GIF / APNG files, read by `animation.py`).
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi", ".mpg", ".mpeg", ".ts",
                              ".wmv", ".flv", ".ogv", ".3gp"})
FORMATS = "MP4, WebM, MKV, MOV, AVI or GIF"
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
DEFAULT_MIN_FRAMES = 4      # the stock video processors' min_frames
DEFAULT_MAX_FRAMES = 768    # ... and max_frames
TEMPORAL_PATCH = 2          # every Qwen-VL family's temporal_patch_size


class VideoError(InputError):
    """A video that cannot be used; the message says what to do, `code` names the case."""


def is_video_path(value: Any) -> bool:
    """A str / PathLike whose extension is a video container's (`VIDEO_EXTENSIONS`; not .gif)."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    return os.path.splitext(os.fspath(value))[1].lower() in VIDEO_EXTENSIONS


# ----------------------------------------------------------------------------- sampling


def sample_indices(total: int, source_fps: float | None, *, fps: float | None = 2.0, num_frames: int | None = None,
                   min_frames: int | None = None, max_frames: int | None = None, family: str | None = None,
                   temporal_patch_size: int = TEMPORAL_PATCH) -> np.ndarray:
    """Which of `total` source frames to keep (int64, increasing), by the stock rule of `family` (module doc)."""
    family = _family(family)
    t = int(temporal_patch_size)
    lo = DEFAULT_MIN_FRAMES if min_frames is None else int(min_frames)
    hi = DEFAULT_MAX_FRAMES if max_frames is None else int(max_frames)
    if total < 1:
        raise VideoError("The video has no frames: give a video with at least one frame.", "video_empty")
    if hi < 1:
        raise VideoError(f"max_frames={max_frames} keeps no frame: give at least 1.", "video_sampling")
    if num_frames is not None:
        if isinstance(num_frames, bool) or int(num_frames) != num_frames or num_frames < 1:
            raise VideoError(f"num_frames={num_frames!r} is not a frame count: give a whole number of at least 1.",
                             "video_sampling")
        if num_frames > hi:
            raise VideoError(f"Asked for num_frames={num_frames}, more than max_frames={hi}: ask for at most {hi} "
                             "frames (or sample by fps).", "video_too_long")
        n = int(num_frames)
        if family != "qwen3_vl":
            n = round(n / t) * t or t      # the stock rounds to the temporal patch; 0 becomes one patch
        if n > total:
            hint = f" (num_frames={num_frames} rounds to {n}, a multiple of the temporal patch {t})" \
                if n != num_frames else ""
            most = total if family == "qwen3_vl" else total - total % t
            todo = f"ask for at most {most} frames" if most else "pass fps= instead, which keeps its frames"
            raise VideoError(f"The video has {total} frame{'s' if total != 1 else ''}, fewer than the {n} asked for"
                             f"{hint}: {todo}.", "video_sampling")
    elif fps is not None:
        if not fps > 0 or not math.isfinite(fps):
            raise VideoError(f"fps={fps!r} is not a sampling rate: give frames per second above 0 (e.g. 2.0), or "
                             "fps=None to keep every frame.", "video_sampling")
        if not source_fps or source_fps <= 0:
            raise VideoError("The video's frame rate is unknown, so it cannot be sampled by fps: pass frame_rate= "
                             "(its frames per second) or num_frames=.", "video_sampling")
        if family == "qwen3_vl":
            n = int(total / source_fps * fps)
            n = min(max(n, lo), hi, total)
        else:
            top = math.floor(min(hi, total) / t) * t
            n = min(max(total / source_fps * fps, lo), top, total)
            n = math.floor(n / t) * t
            if n == 0:          # fewer source frames than one temporal patch: keep them (the stock divides by 0)
                n = min(total, hi)
    else:
        if total > hi:
            raise VideoError(f"The video has {total} frames, more than max_frames={hi}: sample it (fps=2.0, or "
                             f"num_frames={hi} or fewer).", "video_too_long")
        n = total
    if n == total:
        return np.arange(total, dtype=np.int64)
    if family == "qwen3_vl":
        return np.linspace(0, total - 1, n).round().astype(np.int64)
    import torch

    # The stock expression, float step and all (its length can exceed n by float error: keep n).
    return torch.arange(0, total, total / n).int().numpy().astype(np.int64)[:n]


def _family(family: str | None) -> str:
    if family is None:
        return "qwen2_vl"
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    return family


# ----------------------------------------------------------------------------- the public entry


def load_clip(video: Any, fps: float | None = 2.0, num_frames: int | None = None, max_frames: int | None = None,
              min_frames: int | None = None, frame_rate: float | None = None, *, family: str | None = None,
              name: str | None = None) -> Clip:
    """A video -> `Clip` (module doc: what is accepted, how frames are sampled, what is refused).

    video       a file path (str / PathLike: mp4, webm, avi, mkv, mov, gif, ...), a list / tuple of frames,
                an array / tensor [N, H, W, 3] uint8 or [N, 3, H, W], or a Clip (returned as it is)
    fps         frames per second to keep; None keeps every frame
    num_frames  how many frames to keep, evenly spread (instead of fps)
    max_frames / min_frames   bounds of the sampled count (stock defaults 768 / 4); num_frames above
                max_frames, or more than max_frames frames kept whole, is refused
    frame_rate  the source's frames per second: for frames in memory (default 2.0); for a file it overrides
                the rate its header states
    family      whose stock sampling rule to follow ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"; None: Qwen2-VL's)
    name        how messages call a file (default: its path as given)
    """
    if isinstance(video, Clip):
        return video
    if frame_rate is not None and (not frame_rate > 0 or not math.isfinite(frame_rate)):
        raise VideoError(f"frame_rate={frame_rate!r} is not a frame rate: give frames per second above 0.",
                         "video_sampling")
    sampling = dict(fps=fps, num_frames=num_frames, min_frames=min_frames, max_frames=max_frames, family=family)
    if isinstance(video, (str, os.PathLike)):
        path = os.fspath(video)
        return _load_file(path, repr(path) if name is None else name, frame_rate, sampling)
    frames = frames_array(video)
    rate = 2.0 if frame_rate is None else float(frame_rate)
    total = len(frames)
    most = DEFAULT_MAX_FRAMES if max_frames is None else int(max_frames)
    if num_frames is None and fps is not None and fps >= rate and total > most:
        # more frames than a clip may keep, at their own rate: kept to max_frames, evenly, as a file's are
        indices = np.linspace(0, total - 1, max(1, most - most % TEMPORAL_PATCH)).round().astype(np.int64)
    elif num_frames is None and (fps is None or fps >= rate):
        # Frames given in memory are used whole (never up-sampled).
        indices = sample_indices(total, rate, **{**sampling, "fps": None, "num_frames": None})
    else:
        indices = sample_indices(total, rate, **sampling)
    return Clip(frames=np.ascontiguousarray(frames[indices]), timestamps=indices / rate, fps=rate, source=None,
                indices=indices, total_frames=total)


# ----------------------------------------------------------------------------- frames in memory


def frames_array(video: Any) -> np.ndarray:
    """Frames in memory -> uint8 [N, H, W, 3] (RGB). Refused: no frames, frames of different sizes, frames that
    are not RGB-like (one channel, four channels, values outside [0, 1] for floats or [0, 255] for integers)."""
    if _is_array(video):
        arr = _as_numpy(video)
        if arr.ndim == 4:
            if arr.shape[0] == 0:
                raise VideoError("The video has no frames: give at least one frame.", "video_empty")
            return _to_uint8(_channels_last(arr, "the frames"), "the frames")
        if arr.ndim == 3 and _channels_last_or_none(arr) is not None:
            raise VideoError(f"Got one frame {tuple(arr.shape)}, not a video: pass a list of frames or an array "
                             "[N, H, W, 3] (a single picture is an image: pass it as an image).", "video_not_rgb")
        raise VideoError(f"Could not use an array of shape {tuple(arr.shape)} as a video: give [N, H, W, 3] uint8 "
                         "or [N, 3, H, W] frames.", "video_not_rgb")
    if not isinstance(video, (list, tuple)):
        raise VideoError(f"Could not use a {type(video).__name__} as a video: give a video file path, a list of "
                         "frames (PIL images or HxWx3 uint8 arrays), or an array [N, H, W, 3].", "video_unreadable")
    if len(video) == 0:
        raise VideoError("The video has no frames: give at least one frame.", "video_empty")
    frames = [_frame(f, i) for i, f in enumerate(video)]
    h0, w0 = frames[0].shape[:2]
    for i, f in enumerate(frames):
        if f.shape[:2] != (h0, w0):
            raise VideoError(f"Frame {i} is {f.shape[1]}x{f.shape[0]} px but frame 0 is {w0}x{h0}: every frame of a "
                             "video must have one size; resize them to one size first.", "video_frames_mismatch")
    return np.stack(frames)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("torch")


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    try:
        return x.detach().cpu().numpy()
    except Exception as exc:  # noqa: BLE001 - any tensor-like that will not convert
        raise VideoError(f"Could not read the {type(x).__name__} as frames ({type(exc).__name__}): give a numpy "
                         "array or a CPU tensor.", "video_unreadable") from None


def _channels_last_or_none(arr: np.ndarray) -> np.ndarray | None:
    """HxWx3 or 3xHxW (also with a leading frame axis) -> channels last; None when neither axis has 3."""
    if arr.shape[-1] == 3:
        return arr
    if arr.shape[-3] == 3:
        return np.moveaxis(arr, -3, -1)
    return None


def _channels_last(arr: np.ndarray, what: str) -> np.ndarray:
    out = _channels_last_or_none(arr)
    if out is None:
        raise VideoError(f"{what.capitalize()} are not RGB-like (shape {tuple(arr.shape)}): give 3-channel RGB "
                         "frames, HxWx3 uint8 or 3xHxW floats in [0, 1] (drop an alpha channel, expand grey).",
                         "video_not_rgb")
    return out


def _to_uint8(arr: np.ndarray, what: str) -> np.ndarray:
    if arr.dtype == np.uint8:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        if arr.size and (not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 1):
            raise VideoError(f"{what.capitalize()} are floats outside [0, 1]: give floats in [0, 1] or uint8 values "
                             "in [0, 255].", "video_not_rgb")
        return np.clip(np.rint(arr.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    if np.issubdtype(arr.dtype, np.integer) and not np.issubdtype(arr.dtype, np.bool_):
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise VideoError(f"{what.capitalize()} hold integers outside [0, 255]: give uint8 values.", "video_not_rgb")
        return arr.astype(np.uint8)
    raise VideoError(f"{what.capitalize()} are {arr.dtype}, not pixel values: give uint8 values or floats in [0, 1].",
                     "video_not_rgb")


def _frame(f: Any, i: int) -> np.ndarray:
    from PIL import Image

    what = f"frame {i}"
    if isinstance(f, (str, os.PathLike)):
        try:
            with Image.open(os.fspath(f)) as im:
                im.load()
                f = im.copy()
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for non-images
            raise VideoError(f"Could not read frame {i} as an image ({type(exc).__name__}): give image files, PIL "
                             "images or arrays as frames.", "video_unreadable") from None
    if isinstance(f, Image.Image):
        return _pil_rgb(f, what)
    if _is_array(f):
        arr = _as_numpy(f)
        if arr.ndim != 3:
            raise VideoError(f"Frame {i} has shape {tuple(arr.shape)}, not RGB-like: give HxWx3 uint8 or 3xHxW floats "
                             "in [0, 1].", "video_not_rgb")
        return _to_uint8(_channels_last(arr, what), what)
    raise VideoError(f"Frame {i} is a {type(f).__name__}: give PIL images, HxWx3 uint8 arrays or 3xHxW float tensors "
                     "as frames.", "video_unreadable")


# PIL modes read as RGB (alpha flattened onto white, as the image validator does); others are refused.
_PIL_RGB_LIKE = {"RGB", "RGBA", "RGBa", "RGBX", "L", "LA", "La", "P", "PA", "1", "CMYK", "YCbCr"}


def _pil_rgb(im: Any, what: str) -> np.ndarray:
    from PIL import Image

    if im.mode not in _PIL_RGB_LIKE:
        raise VideoError(f"{what.capitalize()} is a {im.mode} image, not RGB-like: convert it to RGB first.",
                         "video_not_rgb")
    if im.mode in ("RGBA", "RGBa", "LA", "La", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(im.convert("RGB") if im.mode != "RGB" else im, dtype=np.uint8)


# ----------------------------------------------------------------------------- files


@dataclass(frozen=True)
class VideoInfo:
    """What a video file's headers say, before decoding: frame size, frame count (counted from the packets
    when the header has none), frame rate (None: unknown), duration in seconds (None: unknown)."""

    width: int
    height: int
    frames: int
    fps: float | None
    duration: float | None
    header_frames: int
    streams: int


def check_path(path: str, shown: str) -> int:
    """The path's size in bytes, or a VideoError: missing, a folder, not a regular file, empty."""
    if os.path.isdir(path):
        raise VideoError(f"{shown} is a folder, not a video file: give one video file ({FORMATS}).", "video_missing")
    if os.path.exists(path) and not os.path.isfile(path):
        raise VideoError(f"{shown} is not a regular video file (it is a device, a pipe or a socket): give one video "
                         f"file ({FORMATS}).", "video_not_a_file")
    if not os.path.isfile(path):
        raise VideoError(f"Could not find the video file {shown}: check the path and try again.", "video_missing")
    size = os.path.getsize(path)
    if size == 0:
        raise VideoError(f"Could not read {shown} as a video (the file is empty). Give a video file ({FORMATS}).",
                         "video_empty")
    return size


def probe_video(path: str | os.PathLike, name: str | None = None, frame_rate: float | None = None) -> VideoInfo:
    """A video file's size, frame count and rate from its headers (frames counted from packets when the header
    has no count), without decoding a frame. Raises VideoError."""
    path = os.fspath(path)
    shown = repr(path) if name is None else name
    check_path(path, shown)
    with _open(path, shown) as container:
        return _probe(container, path, shown, frame_rate)


def _reason(exc: BaseException, path: str) -> str:
    """'Type: first line' with the file's path taken out (messages never show a server's paths)."""
    text = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [""])[0]
    text = str(text).replace(repr(path), "the file").replace(path, "the file")
    if os.sep in text:
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _open(path: str, shown: str) -> Any:
    import av

    try:
        return av.open(path, metadata_errors="ignore")
    except Cancelled:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg raises many kinds for non-videos
        raise VideoError(f"Could not read {shown} as a video ({_reason(exc, path)}). Give a video file ({FORMATS}); if it "
                         "plays elsewhere it may be damaged or cut short: re-save it and try again.",
                         "video_unreadable") from None


def _probe(container: Any, path: str, shown: str, frame_rate: float | None) -> VideoInfo:
    if not container.streams.video:
        raise VideoError(f"{shown} holds no video stream (audio only?): give a video file ({FORMATS}).",
                         "video_unreadable")
    stream = container.streams.video[0]
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    header = int(stream.frames or 0)
    total = header
    if total == 0:          # WebM / MKV state no count: count the packets (no decoding)
        try:
            total = sum(1 for packet in container.demux(stream) if packet.size)
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001
            raise VideoError(f"{shown} is truncated or damaged ({_reason(exc, path)}): re-save it and try again.",
                             "video_damaged") from None
    duration = None
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000
    # The header's own rate; FFmpeg's guess (25 for a header that says 0 fps) is not the file's: unknown is said
    no_rate = not frame_rate and _states_no_rate(path)
    rate = float(frame_rate) if frame_rate else None if no_rate else float(stream.average_rate or 0) or None
    if rate is None and duration and total and not no_rate:      # (a duration FFmpeg derived from its guess is not)
        rate = total / duration
    return VideoInfo(width, height, total, rate, duration, header, len(container.streams))


def _states_no_rate(path: str) -> bool:
    """An AVI whose video stream header says 0 frames per second (dwRate or dwScale 0): FFmpeg then reports its
    own guess, 25, as the stream's rate, which would sample the clip as if it were 25 fps."""
    if os.path.splitext(path)[1].lower() != ".avi":
        return False
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    at = head.find(b"strh")
    while at >= 0 and head[at + 8: at + 12] != b"vids":        # the first video stream's header
        at = head.find(b"strh", at + 4)
    if at < 0 or at + 36 > len(head):
        return False
    scale, rate = int.from_bytes(head[at + 28: at + 32], "little"), int.from_bytes(head[at + 32: at + 36], "little")
    return scale == 0 or rate == 0


def _load_file(path: str, shown: str, frame_rate: float | None, sampling: dict[str, Any]) -> Clip:
    check_path(path, shown)
    with _open(path, shown) as container:
        info = _probe(container, path, shown, frame_rate)
    if info.frames == 0:
        raise VideoError(f"{shown} holds no frames: give a video with at least one frame.", "video_empty")
    total = info.frames
    for attempt in range(2):
        indices = sample_indices(total, info.fps, **sampling)
        frames, times, count = _decode(path, shown, set(indices.tolist()), info)
        if count == total:
            break
        if count < total and (info.header_frames or attempt):
            raise VideoError(f"{shown} is truncated or damaged: only {count} of the {total} frames its header "
                             "declares could be decoded. Re-save or re-download the whole file and try again.",
                             "video_damaged")
        total = count       # the packet count was not the frame count: sample again from the true count
    if count == 0:
        raise VideoError(f"{shown} holds no frames that decode: give a video with at least one frame.", "video_empty")
    _check_complete(shown, info, times)
    stamps = np.array([times[i] - times[0] for i in indices.tolist()], dtype=np.float64)
    shapes = {frames[i].shape for i in indices.tolist()}
    if len(shapes) > 1:
        raise VideoError(f"{shown} changes frame size mid-video ({', '.join(f'{s[1]}x{s[0]}' for s in shapes)}): "
                         "re-encode it at one size.", "video_frames_mismatch")
    return Clip(frames=np.stack([frames[i] for i in indices.tolist()]), timestamps=stamps, fps=info.fps or 2.0,
                source=path, indices=indices, total_frames=total)


def _decode(path: str, shown: str, wanted: set[int], info: VideoInfo) -> tuple[dict[int, np.ndarray], list[float], int]:
    """Decode the whole stream (a damaged tail is found, never skipped), converting only the wanted frames to RGB.
    -> (wanted index -> HxWx3 uint8, every frame's time in seconds, how many frames decoded)."""
    frames: dict[int, np.ndarray] = {}
    times: list[float] = []
    count = 0
    with _open(path, shown) as container:
        stream = container.streams.video[0]
        try:
            for frame in container.decode(stream):
                checkpoint("decoding")
                times.append(float(frame.time) if frame.time is not None else count / (info.fps or 2.0))
                if count in wanted:
                    frames[count] = _rgb(frame)
                count += 1
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - FFmpeg raises many kinds for damaged data
            of = f" of the {info.frames} its header declares" if info.header_frames else ""
            raise VideoError(f"{shown} is truncated or damaged: decoding stopped after {count} frame"
                             f"{'s' if count != 1 else ''}{of} ({_reason(exc, path)}). Re-save or re-download the "
                             "whole file and try again.", "video_damaged") from None
    return frames, times, count


def _rgb(frame: Any) -> np.ndarray:
    """A decoded frame as HxWx3 uint8 RGB: the stock `to_ndarray(format="rgb24")`, except that a frame with
    transparency (an alpha channel or a palette) is flattened onto white, as the same frames given in memory and
    the image validator are (rgb24 would keep the hidden colours of its transparent pixels)."""
    fmt = frame.format
    if fmt.has_palette or any(c.is_alpha for c in fmt.components):
        from PIL import Image

        return _pil_rgb(Image.fromarray(frame.to_ndarray(format="rgba"), "RGBA"), "a frame")
    return frame.to_ndarray(format="rgb24")


def _check_complete(shown: str, info: VideoInfo, times: list[float]) -> None:
    """A stream with no frame count in its header (WebM, MKV) that ends well before the duration the container
    states was cut short. Only checked when the container holds nothing but this video (audio may run longer)."""
    if info.header_frames or info.streams != 1 or not info.duration or not times or not info.fps:
        return
    shown_span = times[-1] - times[0] + 1.0 / info.fps
    missing = info.duration - shown_span
    if missing > max(1.0, 0.1 * info.duration):
        raise VideoError(f"{shown} is truncated: its frames cover {shown_span:.1f} s of the {info.duration:.1f} s "
                         "the file states. Re-save or re-download the whole file and try again.", "video_damaged")
