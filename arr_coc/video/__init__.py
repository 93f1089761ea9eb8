"""Video input: decode and sample a video into a `Clip` (PyAV), whatever the model. Turning clips into a model's
video inputs is its backend's (Qwen-VL's, without torchvision: `arr_coc.qwen.video_processor.VideoProcessor`).

    from arr_coc.video import load_clip
    clip = load_clip("walk.mp4", fps=2.0)               # Clip: frames [N, H, W, 3] uint8, timestamps, fps

Names are imported on first use: `import arr_coc.video` loads neither PyAV nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Clip": "arr_coc.video.clip",
    "load_clip": "arr_coc.video.reading",
    "is_clip_path": "arr_coc.video.reading",
    "sample_indices": "arr_coc.video.decode",
    "probe_video": "arr_coc.video.decode",
    "is_video_path": "arr_coc.video.decode",
    "VideoError": "arr_coc.video.decode",
    "VideoInfo": "arr_coc.video.decode",
    "VIDEO_EXTENSIONS": "arr_coc.video.decode",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .clip import Clip
    from .decode import VIDEO_EXTENSIONS, VideoError, VideoInfo, is_video_path, probe_video, sample_indices
    from .reading import is_clip_path, load_clip


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'arr_coc.video' has no attribute {name!r}")
