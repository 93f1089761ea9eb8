"""The one validator of what a user sends: images, videos and questions (budgets, methods and the encoding are
read beside the method registry, in `arr_coc.pipeline.request`: `read_budget`, `check_method`, `check_encode`).

`ARRCOCQwen.generate`, `python -m arr_coc ask` and the microscope app all check their inputs here, so the
same input gets the same verdict and the same words everywhere. A problem is an `InputError` whose
message says what is wrong and what to do, and never names a server's file paths; `InputError.code`
names the case for programs and tests. What can be made valid safely is made valid, with a note:

| input | verdict |
|---|---|
| animated image | the first frame, with a note |
| 16-bit / 32-bit, CMYK, palette, transparency | 8-bit RGB (alpha flattened onto white), with a note |
| EXIF orientation | applied once (`upright`); the picture keeps no orientation tag, so checking it again changes nothing |
| more than `max_image_pixels` | downscaled keeping its aspect ratio inside the model's limit, with a note |
| aspect ratio beyond `max_aspect` (200:1, what Qwen-VL takes) up to `max_pad_aspect` | padded with white to 200:1, with a note |
| fewer than `min_image_pixels` (1 x 1, 20 x 20), thinner than `max_pad_aspect`, more than `max_decode_pixels` (checked before decoding; decompression bombs), a file over `max_file_bytes`, empty, truncated, not an image, a folder, a device or a pipe, missing | refused |
| a video (`check_clip`: a path, frames, an array or an `arr_coc.video.Clip`): a path with a video extension where an image could be (`generate("clip.mp4", q)`; not .gif, which stays an animated image) | read as a video, sampled as the model's processor samples (`arr_coc.video.load_clip`) |
| a video: one frame (`min_frames`), more frames kept than `max_frames` (asked for, or given whole), sampled frames over `max_clip_pixels` together (checked before decoding), frames under `min_image_pixels`, over `max_decode_pixels` or thinner than `max_aspect` (a video is not padded), a file over `max_video_file_bytes`, empty, truncated (fewer frames than its header declares, a decoder error, or a WebM/MKV ending well before its stated duration), damaged, not a video, no video stream, frames of different sizes, frames that are not RGB, missing | refused |
| a question: empty or blank, over `max_question_chars`, not text (a list, a dict, a number) | refused |
| a question with NUL or other control characters | those removed, with a note |
| a budget: not a share in (0, 1] or a count in [1, `max_budget_count`] (`arr_coc.budget` reads it) | refused |
| an unknown method | refused, naming the known ones |
| an answer length (`max_new_tokens`) below 1 or not a whole number | refused |
| encode settings that contradict each other, or encode before for a method that reads encoded tokens | refused |

Special-token strings in a question (`<|im_end|>`, `<|image_pad|>`, ...) are not an input problem: the
question is tokenized as plain text (`arr_coc.qwen.processing.encode_prompts`), so they are characters.
The limits are `LIMITS` (an `InputLimits`); `limits_for(processor)` raises the downscale cap to a model's
own input size when that is larger. Nothing heavy is imported until an image is read.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from .budget import MAX_COUNT
from .cancel import Cancelled, checkpoint
from .errors import InputError

if TYPE_CHECKING:
    from PIL.Image import Image

    from .video.clip import Clip

FORMATS = "PNG, JPEG, WebP, BMP or GIF"


@dataclass(frozen=True)
class InputLimits:
    """What the validator accepts. Every refusal message quotes the limit it applied."""

    max_question_chars: int = 1000
    min_image_pixels: int = 28 * 28          # one merged visual token of Qwen2-VL / 2.5-VL; fewer: nothing to see
    max_aspect: float = 200.0                # Qwen-VL's smart_resize refuses anything thinner
    max_pad_aspect: float = 10_000.0         # thinner than this is refused rather than padded to max_aspect
    max_decode_pixels: int = 80_000_000      # refused before decoding (PIL itself warns at 89 MP)
    max_image_pixels: int = 2048 * 2048      # larger images are downscaled to this before the processor
    max_file_bytes: int = 25 * 2**20         # 25 MiB: also the app's upload limit
    max_budget_count: int = MAX_COUNT        # token counts above this are refused (shares are in (0, 1])
    max_frames: int = 64                     # a video keeps at most this many frames (sampling stops there)
    min_frames: int = 2                      # fewer is a picture: a one-frame clip is refused (pass it as an image)
    max_clip_pixels: int = 64 * 1920 * 1088  # a video's kept frames together (64 frames of 1080p), before decoding
    max_video_file_bytes: int = 200 * 2**20  # 200 MiB

    def describe(self) -> dict[str, Any]:
        """The limits as plain values (for documentation, an API description, a log line)."""
        return {**dataclasses.asdict(self), "budget_share_range": "(0, 1]", "budget_count_range": f"[1, {MAX_COUNT}]"}


LIMITS = InputLimits()


def limits_for(processor: Any = None, limits: InputLimits = LIMITS) -> InputLimits:
    """`limits`, with the downscale cap raised to the model's own largest input when that is larger
    (a Qwen2-VL-2B processor resizes up to 12.8 MP; the embedded model's to 0.8 MP)."""
    ip = getattr(processor, "image_processor", processor)
    size = getattr(ip, "size", None) or {}
    most = getattr(ip, "max_pixels", None) or (size.get("longest_edge") if isinstance(size, dict) else None)
    if not most or int(most) <= limits.max_image_pixels:
        return limits
    return dataclasses.replace(limits, max_image_pixels=int(min(int(most), limits.max_decode_pixels)))


# ----------------------------------------------------------------------------- the controls


def check_question(question: Any, limits: InputLimits = LIMITS) -> tuple[str, list[str]]:
    """A question -> (the text to ask, notes). Control characters (NUL, ...) are removed, with a note;
    blank or over-long questions are refused, and so is anything that is not text (a list or a dict an API
    client sent used to be turned into its repr and answered)."""
    if question is not None and not isinstance(question, str):
        raise InputError(f"The question must be text, not a {type(question).__name__}: send one question as a "
                         "string, e.g. \"What color is the circle?\"", "question_not_text")
    text = "" if question is None else question
    kept = "".join(c for c in text if c in "\t\n\r" or unicodedata.category(c) != "Cc")
    notes = []
    if len(kept) != len(text):
        n = len(text) - len(kept)
        notes.append(f"Removed {n} control character{'s' if n > 1 else ''} (such as NUL) from the question.")
    kept = kept.strip()
    if not kept:
        raise InputError("The question is empty: type a question about the image, e.g. \"What color is the circle?\"",
                         "question_empty")
    if len(kept) > limits.max_question_chars:
        raise InputError(f"The question is {len(kept):,} characters long; the limit is {limits.max_question_chars:,}. "
                         "Ask one short question about the image.", "question_too_long")
    return kept, notes


def check_max_new_tokens(value: Any) -> int:
    """The answer's length limit: a whole number of tokens, at least 1. Refused here, in the validator's words,
    rather than by transformers halfway through a request (its ValueError was a traceback on the command line)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"max_new_tokens={value!r} is not an answer length: give a whole number of tokens of at "
                         "least 1 (--max-new-tokens 32)", "max_new_tokens")
    return int(value)


# ----------------------------------------------------------------------------- the image


@dataclass
class ImageInfo:
    """What happened to an image on its way to the model (for the page, the trace and the CLI)."""

    original_size: tuple[int, int] | None = None
    used_size: tuple[int, int] | None = None
    mode: str | None = None
    format: str | None = None
    frames: int = 1
    notes: list[str] = field(default_factory=list)


@dataclass
class OpenedImage:
    """An image whose header passed the size checks, not decoded yet (`finish_image` decodes it).

    `pixels` is what decoding will hold, for callers that admit work by memory (the app)."""

    image: Any                      # a lazily opened PIL image
    info: ImageInfo
    file: Any = None                # the open file, closed by finish_image / close
    name: str = "the image"

    @property
    def pixels(self) -> int:
        w, h = self.info.original_size or (0, 0)
        return w * h

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class _CheckedFile:
    """A file whose every read is a step boundary (`arr_coc.cancel.checkpoint`): a cancelled request stops
    decoding a huge image between two reads instead of decoding all of it first."""

    def __init__(self, f: Any):
        self._f = f

    def read(self, n: int = -1) -> bytes:
        checkpoint("decoding")
        return self._f.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _silence_pil_bomb_warning() -> None:
    """PIL warns above 89 MP; the validator refuses at `max_decode_pixels` (80 MP) before decoding, so the
    warning says nothing the verdict does not. Filtered once, for this warning class only."""
    import warnings

    from PIL import Image

    warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


def _reason(exc: BaseException, path: str | None = None) -> str:
    """'Type: first line', with any file path taken out (messages never show a server's paths)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image format this reader knows"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    for p in filter(None, {path, getattr(exc, "filename", None)}):
        text = text.replace(str(p), "the file").replace(repr(str(p)), "the file")
    if os.sep in text:  # still a path in there: say less rather than leak it
        text = ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_header(w: int, h: int, limits: InputLimits) -> None:
    if w * h > limits.max_decode_pixels:
        raise InputError(f"The image is {w}x{h} px ({w * h / 1e6:.0f} megapixels): too large to decode here "
                         f"(limit {limits.max_decode_pixels / 1e6:.0f} MP). Downscale it and try again.", "image_too_large")
    if w * h < limits.min_image_pixels:
        side = math.isqrt(limits.min_image_pixels)
        raise InputError(f"The image is {w}x{h} px: too small to show anything. Give an image of at least "
                         f"{side}x{side} px (one visual token covers {side}x{side} px).", "image_too_small")
    ratio = max(w, h) / min(w, h)
    if ratio > limits.max_pad_aspect:
        raise InputError(f"The image is {w}x{h} px, an aspect ratio of {ratio:,.0f}:1: too thin to use (Qwen-VL takes "
                         f"up to {limits.max_aspect:.0f}:1; thinner images are padded up to "
                         f"{limits.max_pad_aspect:,.0f}:1). Crop it closer to the region of interest.", "image_too_thin")


def open_image(value: Any, limits: InputLimits = LIMITS, name: str | None = None) -> OpenedImage:
    """Open an image (a path, bytes, a PIL image or an HxW[xC] uint8 array) and check its header.

    `name` is how messages call a file (the CLI passes the path the user typed; the app nothing, so its
    temporary paths never show). Raises InputError; nothing is decoded yet.
    """
    import numpy as np
    from PIL import Image

    _silence_pil_bomb_warning()
    if value is None or (isinstance(value, str) and not value.strip()):
        raise InputError(f"No image: give an image ({FORMATS}).", "image_missing")
    if isinstance(value, Image.Image):
        return _opened(value, None, limits, name or "the image")
    if isinstance(value, np.ndarray):
        try:
            im = Image.fromarray(value)
        except (TypeError, ValueError) as exc:
            raise InputError(f"Could not use the array as an image ({_reason(exc)}); pass HxW or HxWx3 uint8 values.",
                             "image_unreadable") from None
        return _opened(im, None, limits, name or "the array")
    if isinstance(value, (bytes, bytearray, memoryview)):
        import io

        return _open_file(_CheckedFile(io.BytesIO(bytes(value))), len(value), None, limits, name or "the image")
    if not isinstance(value, (str, os.PathLike)):
        raise InputError(f"Could not use a {type(value).__name__} as an image; give a file path or a PIL image.",
                         "image_unreadable")
    path = os.fspath(value)
    shown = repr(name) if name else "the uploaded file"
    if os.path.isdir(path):
        raise InputError(f"{repr(name) if name else 'The upload'} is a folder, not an image file: give one image "
                         f"file ({FORMATS}).", "image_missing")
    if os.path.exists(path) and not os.path.isfile(path):   # a device (/dev/zero), a pipe, a socket: never opened
        raise InputError(f"{repr(name) if name else 'The upload'} is not a regular image file (it is a device, a pipe "
                         f"or a socket): give one image file ({FORMATS}).", "image_not_a_file")
    if not os.path.isfile(path):
        raise InputError(f"Could not find the image file {name!r}: check the path and try again." if name else
                         "Could not find the uploaded image file: upload it again.", "image_missing")
    try:
        size = os.path.getsize(path)
        f = _CheckedFile(open(path, "rb"))
    except OSError as exc:
        raise InputError(f"Could not open {shown} ({_reason(exc, path)}). Check that it can be read.",
                         "image_unreadable") from None
    return _open_file(f, size, path, limits, shown)


def _open_file(f: Any, size: int, path: str | None, limits: InputLimits, shown: str) -> OpenedImage:
    from PIL import Image

    try:
        if size == 0:
            raise InputError(f"Could not read the file as an image (it is empty). Give a {FORMATS} file.", "image_empty")
        if size > limits.max_file_bytes:
            raise InputError(f"The file is {size:,} bytes, over the {limits.max_file_bytes / 2**20:.0f} MB limit. "
                             "Save the image smaller (JPEG, or fewer pixels) and try again.", "file_too_large")
        try:
            im = Image.open(f)
        except Image.DecompressionBombError as exc:
            declared = re.search(r"\((\d+) pixels\)", str(exc))   # PIL's message holds the header's own size
            says = f"{int(declared.group(1)) / 1e6:,.0f} MP" if declared else \
                f"more than {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} MP"
            raise InputError(f"The image is too large to decode safely (its header declares {says}; the limit is "
                             f"{limits.max_decode_pixels / 1e6:.0f} MP). Downscale it and try again.",
                             "image_too_large") from None
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for non-images
            raise InputError(f"Could not read the file as an image ({_reason(exc, path)}). Give a {FORMATS} file.",
                             "image_unreadable") from None
        return _opened(im, f, limits, shown)
    except BaseException:
        f.close()
        raise


def _opened(im: Any, f: Any, limits: InputLimits, shown: str) -> OpenedImage:
    w, h = im.size
    info = ImageInfo(original_size=(w, h), mode=im.mode, format=getattr(im, "format", None))
    try:
        _check_header(w, h, limits)
    except InputError:
        if f is not None:
            f.close()
        raise
    return OpenedImage(image=im, info=info, file=f, name=shown)


def check_image(value: Any, limits: InputLimits = LIMITS, name: str | None = None) -> tuple[Image, ImageInfo]:
    """Any image a caller passes -> (8-bit RGB PIL image the model can take, ImageInfo). Raises InputError."""
    return finish_image(open_image(value, limits, name), limits)


# Modes resized as they are; the others are converted first (palette and bilevel images resize poorly).
_RESIZABLE = {"RGB", "RGBA", "L", "LA", "CMYK", "YCbCr", "I", "F", "I;16", "I;16L", "I;16B", "I;16N"}


def plan_size(w: int, h: int, limits: InputLimits = LIMITS) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> ((width, height) to resize to, (width, height) of the canvas it is padded onto).

    The canvas stays within `max_aspect` (padding a thinner image) and about `max_image_pixels`
    (downscaling keeps the aspect ratio, rounded so it never crosses `max_aspect`)."""
    long, short = max(w, h), min(w, h)
    canvas_short = max(short, math.ceil(long / limits.max_aspect))
    scale = min(1.0, math.sqrt(limits.max_image_pixels / (long * canvas_short)))
    if scale < 1.0:
        long1 = max(1, math.floor(long * scale))
        short1 = max(1, math.floor(short * scale))
        if short * limits.max_aspect >= long:       # not padded: round the short side up if the limit needs it
            short1 = max(short1, math.ceil(long1 / limits.max_aspect))
    else:
        long1, short1 = long, short
    canvas1 = max(short1, math.ceil(long1 / limits.max_aspect))
    if w >= h:
        return (long1, short1), (long1, canvas1)
    return (short1, long1), (canvas1, long1)


def finish_image(opened: OpenedImage, limits: InputLimits = LIMITS) -> tuple[Image, ImageInfo]:
    """Decode and normalise: first frame, 8 bits, RGB (alpha flattened onto white), downscaled and padded as
    `plan_size` says, EXIF orientation applied. Raises InputError (truncated or damaged data, exotic modes)."""
    from PIL import Image

    im, info = opened.image, opened.info
    try:
        frames = int(getattr(im, "n_frames", 1) or 1)
        if frames > 1:
            info.frames = frames
            info.notes.append(f"Animated image ({frames} frames): only the first frame is used.")
            im.seek(0)
        w, h = im.size
        size, canvas = plan_size(w, h, limits)
        deep = im.mode.startswith("I;16") or im.mode in ("I", "F") or any(
            ";16" in str(getattr(t, "args", "")) for t in (getattr(im, "tile", None) or []))
        if size != (w, h) and getattr(im, "format", None) == "JPEG":
            im.draft(None, size)  # decode at a reduced scale, at least `size`: far less memory for huge JPEGs
        try:
            im.load()
        except Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt data
            raise InputError(f"The image file is truncated or damaged ({_reason(exc)}). Re-save it and try again.",
                             "image_damaged") from None
        orientation = _orientation(im)
    finally:
        opened.close()
    mode = im.mode
    try:
        if mode not in _RESIZABLE:
            im = im.convert("RGBA" if _has_alpha(im) else "RGB")
        if im.size != size:
            im = im.resize(size, Image.LANCZOS, reducing_gap=3.0)
        im = _to_8_bits(im)
        if _has_alpha(im):
            rgba = im.convert("RGBA")
            im = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
            info.notes.append(f"Image with transparency ({info.mode}): flattened onto a white background.")
        if im.mode != "RGB":
            im = im.convert("RGB")
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - exotic modes (LAB, HSV, ...)
        raise InputError(f"Could not convert the {mode} image to RGB ({_reason(exc)}). Save it as an RGB PNG or JPEG.",
                         "image_unreadable") from None
    if deep:
        info.notes.append(f"{'32' if mode in ('F', 'I') else '16'}-bit image ({info.mode}): converted to 8 bits "
                          "per channel.")
    if mode == "CMYK":
        info.notes.append("CMYK image: converted to RGB (colours may shift a little without its colour profile).")
    if size != (w, h):
        info.notes.append(f"Large image ({w}x{h} px, {w * h / 1e6:.1f} MP): downscaled to {size[0]}x{size[1]} "
                          f"(cap {limits.max_image_pixels / 1e6:.1f} MP); the model resizes to its own input size "
                          "anyway.")
    if canvas != size:
        padded = Image.new("RGB", canvas, (255, 255, 255))
        padded.paste(im, ((canvas[0] - size[0]) // 2, (canvas[1] - size[1]) // 2))
        im = padded
        info.notes.append(f"Very thin image ({w}x{h} px, {max(w, h) / min(w, h):,.0f}:1): padded with white to "
                          f"{canvas[0]}x{canvas[1]} px, because Qwen-VL takes aspect ratios up to "
                          f"{limits.max_aspect:.0f}:1.")
    im = upright(im, orientation)
    info.used_size = im.size
    return im, info


def _transpose_for(orientation: int | None) -> Any:
    """The PIL transpose that shows a picture stored with EXIF `orientation` upright (None for 1 or unknown)."""
    from PIL import Image

    t = Image.Transpose
    return {2: t.FLIP_LEFT_RIGHT, 3: t.ROTATE_180, 4: t.FLIP_TOP_BOTTOM, 5: t.TRANSPOSE, 6: t.ROTATE_270,
            7: t.TRANSVERSE, 8: t.ROTATE_90}.get(orientation or 1)


# What can tell a viewer to turn a picture: EXIF (as JPEG, WebP and PNG keep it) and XMP's tiff:Orientation.
_ORIENTATION_KEYS = ("exif", "Raw profile type exif", "xmp", "XML:com.adobe.xmp")


def upright(im: Image, orientation: int | None = None) -> Image:
    """The picture as it is meant to be seen: its EXIF orientation (2-8: mirrored and/or rotated) applied.

    The one place a picture is turned upright (`finish_image` calls it, so the CLI, the app and `generate`
    all do). The turned picture keeps no orientation metadata, so a second call, e.g. `generate` checking a
    picture the CLI or the app already checked, changes nothing: a portrait phone photo once reached the
    model on its side because the tag survived the first turn. `orientation` is the tag as read before
    decoding and converting (which may drop the metadata); None reads it from `im`. A picture with no turn
    to make is returned as it is (never mutated: it may be the caller's own).
    """
    if orientation is None:
        orientation = _orientation(im)
    op = _transpose_for(orientation)
    if op is None:
        return im
    im = im.transpose(op)               # a new image: the caller's is untouched
    for key in _ORIENTATION_KEYS:
        im.info.pop(key, None)
    return im


def _orientation(im: Any) -> int | None:
    try:
        return int(im.getexif().get(0x0112) or 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is no reason to refuse the picture
        return None


def _has_alpha(im: Any) -> bool:
    return im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info)


def _to_8_bits(im: Any) -> Any:
    """16-bit and 32-bit grey images -> 8-bit "L" (16-bit scaled by 1/257, 32-bit stretched to its range)."""
    import numpy as np
    from PIL import Image

    mode = im.mode
    if not (mode.startswith("I;16") or mode in ("I", "F")):
        return im
    arr = np.asarray(im, dtype=np.float32)
    if mode.startswith("I;16"):
        arr = arr / 257.0
    else:
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    return Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")


# ----------------------------------------------------------------------------- a whole request


def check_items(images: list[list[Any]], questions: list[Any], limits: InputLimits = LIMITS,
                sampling: Mapping[str, Any] | None = None) -> tuple[list[list[Any]], list[str], list[list[str]]]:
    """The library's entry check (`ARRCOCQwen.generate`): per question its visuals, checked and normalised,
    and the question text -> (visuals, questions, notes per question). Images are PIL images, file paths or
    bytes; arrays and tensors pass through unchanged (the processor reads them as it always did). Videos are
    `arr_coc.video.Clip`s or paths with a video extension (`generate("clip.mp4", q)`), checked by `check_clip`
    with `sampling` (`arr_coc.qwen.processing.video_sampling(processor)`: the model's own rule) and returned
    as Clips, in place."""
    from .video.clip import Clip
    from .video.animation import animated_notes
    from .video.reading import is_clip_path

    out_images, out_questions, notes = [], [], []
    for ims, q in zip(images, questions):
        text, q_notes = check_question(q, limits)
        checked = []
        for im in ims:
            if isinstance(im, Clip) or is_clip_path(im):
                checked.append(check_clip(im, limits, name=os.fspath(im) if not isinstance(im, Clip) else None,
                                          sampling=sampling))
                if not isinstance(im, Clip):
                    q_notes.extend(animated_notes(im))
                continue
            if type(im).__module__.startswith(("torch", "numpy")):
                checked.append(im)   # an array: the processor's business
                continue
            picture, info = check_image(im, limits, name=os.fspath(im) if isinstance(im, (str, os.PathLike)) else None)
            checked.append(picture)
            q_notes += info.notes
        out_images.append(checked)
        out_questions.append(text)
        notes.append(q_notes)
    return out_images, out_questions, notes


# ----------------------------------------------------------------------------- the video


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
    from .video.clip import Clip
    from .video.reading import load_clip

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

    from .video.clip import Clip

    keep = max(2, most - most % 2)
    at = np.linspace(0, clip.num_frames - 1, keep).round().astype(np.int64)
    return Clip(frames=np.ascontiguousarray(clip.frames[at]), timestamps=clip.timestamps[at], fps=clip.fps,
                source=clip.source, indices=clip.indices[at], total_frames=clip.total_frames)


def check_video_file(path: str | os.PathLike, limits: InputLimits = LIMITS, name: str | None = None,
                     sampling: Mapping[str, Any] | None = None, frame_rate: float | None = None) -> None:
    """A video file's checks that need no decoding (its path, size and header: frame size, the pixels the sampling
    will keep), so a command can refuse a bad clip before it loads a model. InputError."""
    from .video.animation import is_animation
    from .video.decode import check_path, probe_video, sample_indices

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
