"""ShapesVQA-video's vocabulary and constants (spec: docs/SHAPESVQA.md, "ShapesVQA-video"): question
types and templates, directions, clip lengths, frame rate, event rates and the generation presets.

Standard library only (like ``arr_coc_shapes.vocabulary``), so the command line reads the defaults
without loading numpy or PIL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..vocabulary import COLOR_NAMES, SHAPES

FPS = 2  # frames per second: frame i is at i / FPS seconds
FRAME_MS = 1000 // FPS  # one frame's duration in the clip file (GIF stores centiseconds: 50 exactly)
MIN_FRAMES, MAX_FRAMES = 4, 16
DEFAULT_LENGTHS: tuple[int, ...] = (4, 6, 8, 12, 16)  # even: Qwen-VL groups frames in pairs
HOLDOUT_LENGTHS: tuple[int, ...] = (10, 14)
MIN_SHOT_OBJECTS, MAX_SHOT_OBJECTS = 3, 8  # objects per shot (a cut starts a second shot)
PAN_RATE = 0.2  # share of all clips with a panning camera
CUT_RATE = 0.15  # share of all clips with a scene cut
MAX_PAN_FRACTION = 0.2  # the camera travels at most this share of the canvas side over a clip

# Question type -> template. The answer is one word: a shape, a colour, a direction or yes / no.
VIDEO_TEMPLATES: dict[str, str] = {
    "moving_shape": "Which shape moves?",
    "moving_color": "What color is the shape that moves?",
    "direction": "Which way does the {shape} move?",
    "appears_last": "Which shape appears last?",
    "color_start": "What color is the {shape} at the start?",
    "color_end": "What color is the {shape} at the end?",
    "exists_first": "Is there a {color} {shape} in the first frame?",
    "exists_last": "Is there a {color} {shape} in the last frame?",
}
VIDEO_QUESTION_TYPES: tuple[str, ...] = tuple(VIDEO_TEMPLATES)
# Motion questions are about an object moving in the scene: their clips have no pan (everything would
# move on screen) and no cut. "appears_last" has no cut (a cut makes everything appear at once).
MOTION_TYPES: tuple[str, ...] = ("moving_shape", "moving_color", "direction")
PAN_TYPES: tuple[str, ...] = ("appears_last", "color_start", "color_end", "exists_first", "exists_last")
CUT_TYPES: tuple[str, ...] = ("color_start", "color_end", "exists_first", "exists_last")

# Screen directions: image x grows to the right, y grows downwards.
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
DIAGONALS: tuple[tuple[int, int], ...] = ((-1, -1), (1, -1), (-1, 1), (1, 1))


@dataclass(frozen=True)
class VideoOptions:
    """What a split varies: clip lengths, how far a mover travels, event rates, letters.

    ``travel`` is the range of a moving object's whole-clip displacement in px; its speed in px per
    frame is drawn so that speed * (n_frames - 1) falls in that range (at least 2 px per frame).
    """

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    travel: tuple[int, int] = (28, 112)
    pan_rate: float = PAN_RATE
    cut_rate: float = CUT_RATE
    letter_rate: float = 0.35  # P_LETTER: lettered distractors, as in the image set

    def checked(self) -> "VideoOptions":
        """Self, or ValueError saying what to change."""
        if not self.lengths or not all(MIN_FRAMES <= n <= MAX_FRAMES for n in self.lengths):
            raise ValueError(f"clip lengths must be {MIN_FRAMES}..{MAX_FRAMES} frames, got {self.lengths}")
        lo, hi = self.travel
        if not 8 <= lo <= hi <= 224:
            raise ValueError(f"travel must be (lo, hi) px with 8 <= lo <= hi <= 224, got {self.travel}")
        # Pan and cut clips are drawn only among the types that allow them: the rates scale up there.
        for name, rate, types in (("pan_rate", self.pan_rate, PAN_TYPES), ("cut_rate", self.cut_rate, CUT_TYPES)):
            top = len(types) / len(VIDEO_QUESTION_TYPES)
            if not 0 <= rate <= top:
                raise ValueError(f"{name} must be in [0, {top}] (only {len(types)} of the 8 question types allow it), "
                                 f"got {rate}")
        if not 0 <= self.letter_rate <= 1:
            raise ValueError(f"letter_rate must be in [0, 1], got {self.letter_rate}")
        return self


PRESETS: dict[str, VideoOptions] = {
    "standard": VideoOptions(),
    # Hold-out: clip lengths the standard split never has and faster, longer motions.
    "holdout": VideoOptions(lengths=HOLDOUT_LENGTHS, travel=(84, 196)),
}


def options(preset: str = "standard", **overrides) -> VideoOptions:
    """A preset's options with some fields replaced (None leaves a field as the preset has it)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}).checked()


def parse_lengths(text: str) -> tuple[int, ...]:
    """'4,6,8' -> (4, 6, 8); ValueError saying what is allowed."""
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"frames must be a comma list of clip lengths like 4,6,8, got {text!r}") from None
    return VideoOptions(lengths=lengths).checked().lengths


def video_words() -> list[str]:
    """Every word of the video questions and answers (lowercase), for a word-level tokenizer."""
    words: set[str] = set(COLOR_NAMES) | set(SHAPES) | set(DIRECTIONS) | {"yes", "no", "?"}
    for template in VIDEO_TEMPLATES.values():
        words.update(re.findall(r"[a-z]+|\?", template.replace("{shape}", "").replace("{color}", "").lower()))
    return sorted(words)
