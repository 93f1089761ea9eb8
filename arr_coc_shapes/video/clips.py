"""Clip files: one lossless file per clip, read back with PIL alone (no video decoder).

A clip whose frames use at most 256 colours in all (almost every one: shapes are drawn without
anti-aliasing and textures are a few grey levels deep) is an animated GIF with one global palette
built from the clip's exact colours, so decoding gives the rendered pixels back exactly. A clip with
more colours (anti-aliased letters on several objects, over two shots) is an animated PNG (APNG),
lossless for any RGB. Both store 500 ms per frame (2 fps).

Pillow's writers merge consecutive identical frames into one frame of a longer duration (a still
stretch of a clip); ``load_clip_frames`` expands each decoded frame to duration / 500 ms frames, so
the frame count always comes back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from .spec import FRAME_MS

GIF_COLORS = 256


def clip_suffix(frames: np.ndarray) -> str:
    """'.gif' when the clip's frames use at most 256 colours in all, else '.png' (APNG)."""
    stacked = Image.fromarray(np.ascontiguousarray(frames).reshape(-1, frames.shape[2], 3))
    return ".gif" if stacked.getcolors(GIF_COLORS) is not None else ".png"


def _packed(rgb: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] -> int64 [...] of r << 16 | g << 8 | b."""
    rgb = rgb.astype(np.int64)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _paletted(frames: np.ndarray) -> list[Image.Image]:
    """Frames as P-mode images sharing one exact palette (the clip's colours, <= 256)."""
    n, h, w, _ = frames.shape
    stacked = Image.fromarray(np.ascontiguousarray(frames).reshape(n * h, w, 3))
    counted = stacked.getcolors(GIF_COLORS)  # [(count, (r, g, b))] or None past 256 colours
    if counted is None:
        raise ValueError(f"a GIF holds at most {GIF_COLORS} colours; this clip has more")
    palette = np.array(sorted(rgb for _, rgb in counted), dtype=np.uint8)  # [k, 3]
    lut = np.zeros(1 << 24, dtype=np.uint8)  # packed RGB -> palette index
    lut[_packed(palette)] = np.arange(len(palette), dtype=np.uint8)
    index = lut[_packed(frames)]  # [n, h, w]
    images = []
    for t in range(n):
        im = Image.fromarray(index[t], "P")
        im.putpalette(palette.ravel().tolist())
        images.append(im)
    return images


def save_clip(frames: np.ndarray, path: str | Path) -> Path:
    """Write uint8 [N, H, W, 3] frames to ``path`` (.gif or .png, see ``clip_suffix``), 500 ms a frame."""
    path = Path(path)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {frames.shape}")
    if path.suffix == ".gif":
        images = _paletted(frames)
        # optimize=False keeps the palette as given; disposal 1 leaves each frame under the next
        images[0].save(path, format="GIF", save_all=True, append_images=images[1:], duration=FRAME_MS, loop=0,
                       optimize=False, disposal=1)
    elif path.suffix == ".png":
        images = [Image.fromarray(f, "RGB") for f in frames]
        images[0].save(path, format="PNG", save_all=True, append_images=images[1:], duration=FRAME_MS, loop=0,
                       compress_level=3)
    else:
        raise ValueError(f"clip files are .gif or .png (APNG), got {path.name!r}")
    return path


def load_clip_frames(path: str | Path) -> np.ndarray:
    """A clip file (GIF or APNG) as uint8 [N, H, W, 3], one array per 500 ms of the file."""
    frames: list[np.ndarray] = []
    with Image.open(path) as im:
        for i in range(getattr(im, "n_frames", 1)):
            im.seek(i)
            rgb = np.asarray(im.convert("RGB"))
            repeat = max(1, round(float(im.info.get("duration", FRAME_MS)) / FRAME_MS))
            frames.extend([rgb] * repeat)
    return np.stack(frames)
