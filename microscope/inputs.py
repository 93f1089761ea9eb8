"""What the user sends, checked: the upload read and normalised to an 8-bit RGB picture, the question,
the budget (through `arr_coc.budget.parse_budget`, the one parser the CLI and the library use) and the
method. Every refusal is an `InputError` whose message the page shows as it is and says what to do.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc.budget import Budget

MAX_QUESTION_CHARS = 1000
MIN_SIDE_PX = 28                     # one merged visual token of Qwen2-VL / 2.5-VL
MAX_ASPECT = 200                     # Qwen-VL's smart_resize refuses more extreme aspect ratios
MAX_DECODE_PIXELS = 80_000_000       # refused before decoding (PIL warns of decompression bombs at 89 MP)
MAX_INPUT_PIXELS = 2048 * 2048       # larger images are downscaled to this before anything else

NO_IMAGE = "No image: upload an image (PNG, JPEG, WebP, BMP, GIF) or click one of the examples."


class InputError(ValueError):
    """A problem with the user's input; its message is shown in the page as it is."""


class Unreadable(str):
    """Marker for an upload the Image component itself could not decode (the message is the reason)."""


def reason(exc: BaseException) -> str:
    """'Type: first line of the message' (or the type alone): short enough for the page."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ----------------------------------------------------------------------------- the controls


def check_question(question: Any) -> str:
    text = "" if question is None else str(question).replace("\x00", "").strip()
    if not text:
        raise InputError("The question is empty: type a question about the image, e.g. \"What color is the circle?\"")
    if len(text) > MAX_QUESTION_CHARS:
        raise InputError(f"The question is {len(text):,} characters long; the limit is {MAX_QUESTION_CHARS:,}. "
                         "Ask one short question about the image.")
    return text


def read_budget(value: Any) -> Budget:
    """The budget as the slider or an API client sent it -> a share (float) or a token count (int).

    Read by `arr_coc.budget.parse_budget`, so "64", "64tok", "10%" and "0.1" mean what they mean on the
    command line; nothing (None or "") is the library's default. A refusal carries the parser's message.
    """
    from arr_coc.budget import DEFAULT_BUDGET, BudgetError, parse_budget

    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_BUDGET
    try:
        return parse_budget(value)
    except BudgetError as exc:
        raise InputError(str(exc)) from None


def check_method(method: Any) -> str:
    from arr_coc.selection import available_methods

    name = "arr_coc" if method in (None, "") else str(method)
    known = available_methods()
    if name not in known:
        raise InputError(f"Unknown method {name!r}; choose one of {', '.join(known)}.")
    return name


# ----------------------------------------------------------------------------- the image


@dataclass
class ImageInfo:
    """What happened to the upload on its way to the model (for the page and the trace)."""

    original_size: tuple[int, int] | None = None
    used_size: tuple[int, int] | None = None
    mode: str | None = None
    format: str | None = None
    frames: int = 1
    notes: list[str] = field(default_factory=list)


def read_image(value: Any) -> tuple[Image, ImageInfo]:
    """An upload (path, PIL image or array) -> (8-bit RGB PIL image within the pixel cap, ImageInfo).

    Raises InputError with a message for the page when the image cannot be used.
    """
    import numpy as np
    from PIL import Image

    if value is None or (isinstance(value, str) and not value.strip()):
        raise InputError(NO_IMAGE)
    if isinstance(value, Unreadable):
        raise InputError(f"Could not read the file as an image ({value}). Upload a PNG, JPEG, WebP, BMP or GIF file.")
    if isinstance(value, Image.Image):
        return _normalise_image(value)
    if isinstance(value, np.ndarray):
        try:
            return _normalise_image(Image.fromarray(value))
        except (TypeError, ValueError) as exc:
            raise InputError(f"Could not use the array as an image ({exc}); pass HxW or HxWx3 uint8 values.")
    path = os.fspath(value)
    if not os.path.isfile(path):
        raise InputError(NO_IMAGE)
    try:
        with open(path, "rb") as f:
            try:
                im = Image.open(f)
            except Image.DecompressionBombError as exc:
                raise InputError(f"The image is far too large to decode safely ({exc}). Downscale it and upload again.")
            except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for non-images
                raise InputError(f"Could not read the file as an image ({reason(exc)}). "
                                 "Upload a PNG, JPEG, WebP, BMP or GIF file.")
            return _normalise_image(im)  # fully decoded before the file closes
    except OSError as exc:
        raise InputError(f"Could not open the uploaded file ({reason(exc)}). Upload it again.")


def _check_size(w: int, h: int) -> None:
    if w * h > MAX_DECODE_PIXELS:
        raise InputError(f"The image is {w}x{h} px ({w * h / 1e6:.0f} megapixels): too large to decode here "
                         f"(limit {MAX_DECODE_PIXELS / 1e6:.0f} MP). Downscale it and upload again.")
    if min(w, h) < MIN_SIDE_PX:
        raise InputError(f"The image is {w}x{h} px: too small to show anything. Upload an image at least "
                         f"{MIN_SIDE_PX}x{MIN_SIDE_PX} px (one visual token covers {MIN_SIDE_PX}x{MIN_SIDE_PX} px).")
    if max(w, h) / min(w, h) > MAX_ASPECT:
        raise InputError(f"The image is {w}x{h} px: an aspect ratio beyond {MAX_ASPECT}:1, which Qwen-VL cannot "
                         "take. Crop it closer to the region of interest.")


def _normalise_image(im: Image) -> tuple[Image, ImageInfo]:
    """Checked and decoded: first frame, EXIF orientation, 8 bits, alpha flattened on white, RGB, pixel cap."""
    from PIL import ImageOps

    w, h = im.size
    info = ImageInfo(original_size=(w, h), mode=im.mode, format=im.format)
    _check_size(w, h)
    frames = int(getattr(im, "n_frames", 1) or 1)
    if frames > 1:
        info.frames = frames
        info.notes.append(f"Animated image ({frames} frames): only the first frame is used.")
        im.seek(0)
    deep = im.mode.startswith("I;16") or im.mode in ("I", "F") or any(
        ";16" in str(getattr(t, "args", "")) for t in (getattr(im, "tile", None) or []))
    if w * h > MAX_INPUT_PIXELS and getattr(im, "format", None) == "JPEG":
        im.draft("RGB", (max(1, w // 2), max(1, h // 2)))  # decode at reduced scale: less memory for huge JPEGs
    try:
        im.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data
        raise InputError(f"The image file is truncated or damaged ({reason(exc)}). Re-save it and upload again.")
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - a broken EXIF block is no reason to refuse the picture
        pass
    mode = im.mode
    im = _to_8_bits(im)
    if deep:
        info.notes.append(f"{'16' if mode != 'F' else '32'}-bit image ({info.mode}): converted to 8 bits per channel.")
    if mode == "CMYK":
        info.notes.append("CMYK image: converted to RGB (colours may shift a little without its colour profile).")
    im = _to_rgb(im, mode, info)
    im = _within_pixel_cap(im, info)
    info.used_size = im.size
    return im, info


def _to_8_bits(im: Image) -> Image:
    """16-bit and 32-bit grey images -> 8-bit "L" (16-bit scaled by 1/257, 32-bit stretched to its range)."""
    import numpy as np
    from PIL import Image

    mode = im.mode
    if not (mode.startswith("I;16") or mode in ("I", "F")):
        return im
    arr = np.asarray(im, dtype=np.float64)
    if mode.startswith("I;16"):
        arr = arr / 257.0
    else:
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    return Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")


def _to_rgb(im: Image, mode: str, info: ImageInfo) -> Image:
    from PIL import Image

    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in im.info)
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
        info.notes.append(f"Image with transparency ({info.mode}): flattened onto a white background.")
    try:
        return im.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - exotic modes (LAB, HSV, ...)
        raise InputError(f"Could not convert the {mode} image to RGB ({reason(exc)}). Save it as an RGB PNG or JPEG.")


def _within_pixel_cap(im: Image, info: ImageInfo) -> Image:
    from PIL import Image

    w2, h2 = im.size
    if w2 * h2 <= MAX_INPUT_PIXELS:
        return im
    w, h = info.original_size or (w2, h2)
    scale = math.sqrt(MAX_INPUT_PIXELS / (w2 * h2))
    size = (max(MIN_SIDE_PX, int(w2 * scale)), max(MIN_SIDE_PX, int(h2 * scale)))
    info.notes.append(f"Large image ({w}x{h} px, {w * h / 1e6:.1f} MP): downscaled to {size[0]}x{size[1]} "
                      f"(cap {MAX_INPUT_PIXELS / 1e6:.1f} MP); the model resizes to its own input size anyway.")
    return im.resize(size, Image.LANCZOS)
