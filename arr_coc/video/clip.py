"""`Clip`: a decoded, sampled video, ready for a Qwen-VL video processor.

A clip is what the stock Qwen-VL processors hold after decoding and sampling: the kept frames (RGB,
uint8), which source frames they are, and the source's frame rate, from which the processors derive
everything time-related (Qwen2.5-VL's `second_per_grid_ts`, Qwen3-VL's "<t seconds>" text). Only numpy is
imported here, so `from arr_coc import Clip` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False, repr=False)
class Clip:
    """A decoded, sampled video.

    frames        uint8 [N, H, W, 3], RGB, in time order (N >= 1; every frame one size)
    timestamps    float64 [N], seconds of each kept frame in the source, from its first frame (0.0)
    fps           the source's frame rate in frames per second (a file's own rate; for frames given
                  in memory the caller's `frame_rate`, 2.0 by default)
    source        the file it was decoded from, or None
    indices       int64 [N], which source frames were kept (default: 0..N-1, every frame)
    total_frames  how many frames the source has (default: N)

    `sampled_fps` is the kept frames' rate, `len(indices) / total_frames * fps`: exactly what transformers'
    `VideoMetadata.sampled_fps` computes, so Qwen2.5-VL's `second_per_grid_ts = temporal_patch_size /
    sampled_fps` is the stock value.
    """

    frames: np.ndarray
    timestamps: np.ndarray
    fps: float = 2.0
    source: str | None = None
    indices: np.ndarray | None = None
    total_frames: int | None = None

    def __post_init__(self) -> None:
        frames = self.frames
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            shape = getattr(frames, "shape", None)
            raise ValueError(f"Clip.frames must be a uint8 array [N, H, W, 3], not {type(frames).__name__} "
                             f"{getattr(frames, 'dtype', '')} {tuple(shape) if shape is not None else ''}; "
                             "build clips with arr_coc.video.load_clip")
        n = len(frames)
        if n == 0 or frames.shape[1] == 0 or frames.shape[2] == 0:
            raise ValueError("a Clip needs at least one frame of at least 1x1 pixels")
        stamps = np.asarray(self.timestamps, dtype=np.float64).reshape(-1)
        if len(stamps) != n:
            raise ValueError(f"Clip has {n} frames but {len(stamps)} timestamps")
        fps = float(self.fps)
        if not np.isfinite(fps) or fps <= 0:
            raise ValueError(f"Clip.fps must be a positive frame rate, not {self.fps!r}")
        idx = np.arange(n, dtype=np.int64) if self.indices is None else np.asarray(self.indices, dtype=np.int64)
        if idx.shape != (n,):
            raise ValueError(f"Clip has {n} frames but {idx.size} source indices")
        total = int(self.total_frames) if self.total_frames is not None else max(n, int(idx.max()) + 1)
        if total < 1 or idx.min() < 0 or idx.max() >= total:
            raise ValueError(f"Clip indices must lie in [0, total_frames={total})")
        object.__setattr__(self, "timestamps", stamps)
        object.__setattr__(self, "fps", fps)
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "total_frames", total)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])

    @property
    def duration(self) -> float:
        """The source's length in seconds (`total_frames / fps`), as transformers' VideoMetadata reads it."""
        return self.total_frames / self.fps

    @property
    def sampled_fps(self) -> float:
        """Frames kept per second of source: `num_frames / total_frames * fps` (transformers' formula)."""
        return self.num_frames / self.total_frames * self.fps

    def metadata(self) -> dict[str, Any]:
        """The clip as transformers' `VideoMetadata` fields, for a stock processor called with
        `videos=[clip.frames], video_metadata=[clip.metadata()], do_sample_frames=False`."""
        return {"total_num_frames": self.total_frames, "fps": self.fps, "width": self.width, "height": self.height,
                "duration": self.duration, "video_backend": "pyav" if self.source else None,
                "frames_indices": self.indices.tolist()}

    def __repr__(self) -> str:
        where = f", source={self.source!r}" if self.source else ""
        return (f"Clip({self.num_frames} frames {self.width}x{self.height}, fps={self.fps:g}, "
                f"sampled_fps={self.sampled_fps:g}, t={self.timestamps[0]:.2f}..{self.timestamps[-1]:.2f}s{where})")
