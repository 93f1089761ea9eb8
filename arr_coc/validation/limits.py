"""What the validator accepts (`InputLimits`, `LIMITS`), and a model's own limits (`limits_for`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..budget import MAX_COUNT

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

