"""An image, checked: opened and its header checked before anything is decoded (`open_image`), then decoded and
normalised (`finish_image`: first frame, 8-bit RGB, downscaled or padded within the limits, turned upright);
`check_image` does both. Refusals are `InputError`s (the table in `arr_coc.validation`)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..cancel import Cancelled, checkpoint
from ..errors import InputError
from .limits import FORMATS, LIMITS, InputLimits

if TYPE_CHECKING:
    from PIL.Image import Image


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

