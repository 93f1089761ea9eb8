"""`VideoProcessor`: Qwen-VL's video processor in torch alone (no torchvision), for Qwen2-VL, Qwen2.5-VL, Qwen3-VL.

transformers' `Qwen2VLVideoProcessor` (Qwen2-VL and Qwen2.5-VL) and `Qwen3VLVideoProcessor` need torchvision,
which cannot be installed here (docs/DESIGN.md, "Environment"). This class does what they do to a sampled
clip, step by step, with the same torch calls:

1. size: every frame of a clip to one (H, W) from the family's `smart_resize` (Qwen3-VL's counts the frames:
   its pixel limits bound t * h * w; Qwen2's bound one frame), optionally with the stock per-frame cap;
2. resize: `torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)`, the call
   torchvision's `resize` makes. On the CPU torchvision hands uint8 frames to torch's native uint8 kernel, and
   so does this class (off the CPU: float32, clamp, round, as torchvision does). Frames already at the target
   size are not touched;
3. rescale + normalise fused as the stock does: mean and std scaled by 1 / rescale_factor in float32, then
   (x - mean) / std in float32;
4. pad the frame count to a multiple of temporal_patch_size T by repeating the last frame;
5. patchify: rows ordered (grid_t, grid_h / m, grid_w / m, m, m), columns (C, T, p, p).

So for frames already at a valid size every number equals the stock video processor's (tests compare with a
plain loop and with the stock patchify). The one place numbers may differ is a resized frame: this is the
kernel torchvision calls on the CPU, but a torchvision that resizes another way, or the stock run on a GPU
(where torchvision goes through float32), can round resized pixels differently. For scale: against PIL's
bicubic (the PIL image processor's resize) this kernel differs by at most 2 levels of 255, on under 1% of
the values. Against the stock PIL *image* processor a still image repeated T times gives the same rows up
to float32 rounding (it rescales and normalises in two steps instead of one; a few 1e-7).

The output is per batch of clips: `pixel_values_videos` [sum t*h*w, C*T*p*p] float32, `video_grid_thw`
LongTensor [V, 3], for qwen2_5_vl `second_per_grid_ts` float32 [V] (= T / clip.sampled_fps, the stock
formula), and `video_timestamps`: per video, per temporal group, the group's time in seconds (the mean of
its first and last frame's timestamps after padding, the stock Qwen3-VL `_calculate_timestamps`); Qwen3-VL's
processor writes them into the prompt as "<{t:.1f} seconds>". `video_timestamps` is a list, not a model input.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..video.clip import Clip
from ..video.decode import DEFAULT_MAX_FRAMES, DEFAULT_MIN_FRAMES, FAMILIES, load_clip

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

# The stock video processors' class defaults (transformers 5.23): Qwen2VLVideoProcessor serves Qwen2-VL and
# Qwen2.5-VL; Qwen3VLVideoProcessor serves Qwen3-VL. min/max pixels: per frame for Qwen2, per clip for Qwen3.
_QWEN2 = dict(patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=OPENAI_CLIP_MEAN,
              image_std=OPENAI_CLIP_STD, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768, max_video_tokens=128000)
_QWEN3 = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=IMAGENET_STANDARD_MEAN,
              image_std=IMAGENET_STANDARD_STD, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, max_video_tokens=768)
STOCK_DEFAULTS: dict[str, dict[str, Any]] = {"qwen2_vl": _QWEN2, "qwen2_5_vl": _QWEN2, "qwen3_vl": _QWEN3}
STOCK_CLASS = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen2_5_vl": "Qwen2VLVideoProcessor",
               "qwen3_vl": "Qwen3VLVideoProcessor"}
_RESAMPLE = {2: "bilinear", 3: "bicubic"}      # PIL codes the configs use -> torch modes (2: BILINEAR, 3: BICUBIC)
CONFIG_NAME = "video_preprocessor_config.json"


def smart_resize_qwen2(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: sides multiples of `factor`, area within [min, max] pixels."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_qwen3(num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL `smart_resize`: as Qwen2's, but the pixel limits bound frames x height x width."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_frames(frames: torch.Tensor, height: int, width: int, resample: int = 3) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> uint8 [N, 3, height, width], as torchvision's `resize(..., antialias=True)` does it."""
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    mode = _RESAMPLE.get(int(resample))
    if mode is None:
        raise ValueError(f"resample={resample} is not supported here; use 3 (bicubic, Qwen's) or 2 (bilinear)")
    native = frames.device.type == "cpu" and (
        mode == "bicubic" or "AVX2" in torch.backends.cpu.get_cpu_capability())   # torchvision's own test
    if native:
        return torch.nn.functional.interpolate(frames, size=[height, width], mode=mode, align_corners=False,
                                               antialias=True)
    out = torch.nn.functional.interpolate(frames.to(torch.float32), size=[height, width], mode=mode,
                                          align_corners=False, antialias=True)
    if mode == "bicubic":
        out = out.clamp_(min=0, max=255)
    return out.round_().to(torch.uint8)


def group_timestamps(timestamps: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Per temporal group, (first + last) / 2 of its frames' times, the last frame repeated to fill the last group
    (Qwen3-VL's `_calculate_timestamps`; for T = 2 the mean of the group's two frames)."""
    t = [float(x) for x in timestamps]
    t += [t[-1]] * (-len(t) % temporal_patch_size)
    return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


class VideoProcessor:
    """A Qwen-VL family's video processor without torchvision (module doc: what it does, what equals the stock).

    Settings: the family's stock defaults, overridden by an image processor's patch / merge / temporal patch
    sizes and normalisation (`from_image_processor`), overridden in turn by a video config
    (`video_preprocessor_config.json`'s keys: size / min_pixels / max_pixels, patch_size, ..., fps, min_frames,
    max_frames, cap_pixels_per_frame, max_video_tokens). `fps`, `min_frames` and `max_frames` are how clips are
    sampled (`load`, `sampling`), the stock processor's own defaults unless the config says otherwise.
    """

    is_arr_coc = True   # how processing.encode_prompts tells this class from a stock video processor

    def __init__(self, family: str = "qwen2_vl", **settings: Any):
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
        self.family = family
        s: dict[str, Any] = {**STOCK_DEFAULTS[family], "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                             "do_normalize": True, "resample": 3, "cap_pixels_per_frame": False, "fps": 2.0,
                             "min_frames": DEFAULT_MIN_FRAMES, "max_frames": DEFAULT_MAX_FRAMES}
        size = settings.pop("size", None)
        if isinstance(size, Mapping):
            for key, name in (("shortest_edge", "min_pixels"), ("min_pixels", "min_pixels"),
                              ("longest_edge", "max_pixels"), ("max_pixels", "max_pixels")):
                if size.get(key) is not None:
                    s[name] = size[key]
        s.update({k: v for k, v in settings.items() if v is not None and k in s})
        self.patch_size = int(s["patch_size"])
        self.temporal_patch_size = int(s["temporal_patch_size"])
        self.merge_size = int(s["merge_size"])
        self.image_mean = tuple(float(x) for x in s["image_mean"])
        self.image_std = tuple(float(x) for x in s["image_std"])
        self.min_pixels = int(s["min_pixels"])
        self.max_pixels = int(s["max_pixels"])
        self.do_resize = bool(s["do_resize"])
        self.do_rescale = bool(s["do_rescale"])
        self.rescale_factor = float(s["rescale_factor"])
        self.do_normalize = bool(s["do_normalize"])
        self.resample = int(s["resample"])
        self.cap_pixels_per_frame = bool(s["cap_pixels_per_frame"])
        self.max_video_tokens = int(s["max_video_tokens"])
        self.fps = None if s["fps"] is None else float(s["fps"])
        self.min_frames = int(s["min_frames"])
        self.max_frames = int(s["max_frames"])

    # ------------------------------------------------------------------ building

    @classmethod
    def from_image_processor(cls, family: str, image_processor: Any, config: Mapping[str, Any] | None = None
                             ) -> VideoProcessor:
        """The family's stock video settings with the image processor's patch geometry and normalisation, then
        `config` (a video_preprocessor_config.json's dict) on top."""
        keep = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "do_rescale",
                "rescale_factor", "do_normalize")
        settings = {k: getattr(image_processor, k) for k in keep if getattr(image_processor, k, None) is not None}
        settings.update(dict(config or {}))
        return cls(family, **settings)

    @property
    def size(self) -> dict[str, int]:
        return {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}

    def to_dict(self) -> dict[str, Any]:
        """The settings under the stock config's keys (a stock processor loading the folder samples the same way:
        `do_sample_frames` is written True with this `fps`)."""
        return {"video_processor_type": STOCK_CLASS[self.family], "size": self.size, "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std), "do_resize": self.do_resize,
                "resample": self.resample, "do_rescale": self.do_rescale, "rescale_factor": self.rescale_factor,
                "do_normalize": self.do_normalize, "do_convert_rgb": True, "do_sample_frames": self.fps is not None,
                "fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames,
                "cap_pixels_per_frame": self.cap_pixels_per_frame, "max_video_tokens": self.max_video_tokens}

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def __repr__(self) -> str:
        return f"VideoProcessor({self.family!r}, {self.to_dict()})"

    # ------------------------------------------------------------------ sampling

    def sampling(self) -> dict[str, Any]:
        """`load_clip` keywords that sample as this family's stock processor does (family, fps, min/max frames)."""
        return {"family": self.family, "fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames}

    def load(self, video: Any, **overrides: Any) -> Clip:
        """`load_clip(video, ...)` with this processor's sampling; `overrides` win."""
        return load_clip(video, **{**self.sampling(), **overrides})

    # ------------------------------------------------------------------ processing

    def target_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(H, W) every frame of a clip of `num_frames` frames of height x width is resized to."""
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.family == "qwen3_vl":
            if self.cap_pixels_per_frame:
                frame_cap = self.max_video_tokens * factor * factor
                per_frame = max(min(frame_cap, max_pixels // num_frames), int(self.min_pixels * 1.05))
                max_pixels = per_frame * num_frames
            # A one-frame clip: sized as the T-frame clip it is padded to (the stock refuses it).
            return smart_resize_qwen3(max(num_frames, self.temporal_patch_size), height, width,
                                      self.temporal_patch_size, factor, self.min_pixels, max_pixels)
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // num_frames), int(self.min_pixels * 1.05))
        return smart_resize_qwen2(height, width, factor, self.min_pixels, max_pixels)

    def normalize(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [N, C, H, W] -> float32, rescaled and normalised with the stock's fused arithmetic."""
        if self.do_rescale and self.do_normalize:
            mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
            std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        elif self.do_normalize:
            mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
        elif self.do_rescale:
            return frames * self.rescale_factor
        else:
            return frames.to(torch.float32)
        x = frames.to(torch.float32)
        return x.sub(mean.to(x).view(-1, 1, 1)).div_(std.to(x).view(-1, 1, 1))

    def patchify(self, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """float [N, C, H, W] -> (rows [t*h*w, C*T*p*p], (t, h, w)); the last frame repeated to a multiple of T."""
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        n, c, height, width = frames.shape
        if pad := -n % tp:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
            n += pad
        gt, gh, gw = n // tp, height // p, width // p
        if height % (p * m) or width % (p * m):
            raise ValueError(f"frames of {width}x{height} px do not divide into {p * m}-px merged patches; "
                             "leave do_resize on or resize the frames first")
        x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)

    def preprocess_clip(self, clip: Clip) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One clip -> its patch rows and (t, h, w)."""
        x = torch.from_numpy(np.ascontiguousarray(clip.frames)).permute(0, 3, 1, 2).contiguous()
        if self.do_resize:
            x = resize_frames(x, *self.target_size(clip.num_frames, clip.height, clip.width), resample=self.resample)
        return self.patchify(self.normalize(x))

    def __call__(self, videos: Sequence[Any], return_tensors: str | None = "pt", **kwargs: Any) -> dict[str, Any]:
        """Clips (or anything `load` reads) in prompt order -> the model's video inputs (module doc)."""
        clips = [v if isinstance(v, Clip) else self.load(v) for v in videos]
        if not clips:
            raise ValueError("no videos to process")
        rows, grids, seconds, stamps = [], [], [], []
        for clip in clips:
            r, grid = self.preprocess_clip(clip)
            rows.append(r)
            grids.append(list(grid))
            seconds.append(self.temporal_patch_size / clip.sampled_fps)
            stamps.append(group_timestamps(clip.timestamps, self.temporal_patch_size))
        out: dict[str, Any] = {"pixel_values_videos": torch.cat(rows),
                               "video_grid_thw": torch.tensor(grids, dtype=torch.long)}
        if self.family == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        out["video_timestamps"] = stamps
        return out

    def num_video_tokens(self, clip: Clip) -> int:
        """Merged tokens the clip becomes: t * h * w / merge**2."""
        h, w = self.target_size(clip.num_frames, clip.height, clip.width) if self.do_resize else (clip.height, clip.width)
        t = -(-clip.num_frames // self.temporal_patch_size)
        return t * (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2


def read_video_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The video processor settings a model folder (or hub id) gives, found where transformers looks:
    processor_config.json's "video_processor", else video_preprocessor_config.json, else the image
    preprocessor_config.json (the stock video processor then takes its pixel limits too). None: none found."""
    data = read_json(path, "processor_config.json")
    if isinstance(data, dict) and isinstance(data.get("video_processor"), dict):
        return data["video_processor"]
    for name in (CONFIG_NAME, "preprocessor_config.json"):
        data = read_json(path, name)
        if isinstance(data, dict):
            return data
    return None


def read_json(path: str | os.PathLike, name: str) -> Any:
    """The JSON file `name` of a model folder, or of a hub id (the cached copy, or a download when online); None
    when it is not there or does not parse."""
    path = os.fspath(path)
    if os.path.isdir(path):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return None
    else:
        try:
            from huggingface_hub import hf_hub_download

            file = hf_hub_download(path, name)
        except Exception:  # noqa: BLE001 - missing on the hub, offline, not a repo id: not found
            return None
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
