"""How the vision tower is spent on a request: `EncodeConfig` ("after": every patch, then select; "before":
select, then only the chosen cells), and the saccade settings that ride on it (`arr_coc.saccade`).

A setting, not a computation: the pipeline (`arr_coc.pipeline`) reads it, a backend says which settings its
model can run (`VLMBackend.check_encode`: whole windows need a tower with window attention), and the one
validator (`arr_coc.pipeline.request.check_encode`, beside the method registry) turns what a user typed into one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .saccade import SaccadeConfig

EncodeMode = Literal["after", "before"]
ENCODE_MODES: tuple[str, ...] = ("after", "before")


@dataclass(frozen=True)
class EncodeConfig:
    """How the vision tower is spent.

    mode       "after": encode every patch, then select (the stock encoding); "before": select, then
               encode only the chosen cells (+ context: margin, whole windows).
    gist       "before" only: share of the full grid's merged tokens the gist has (the tower on a
               downscaled copy of the image; its tokens are the selector's coarse view). 0 (the
               default): no gist, the selector reads the texture array and the question only.
               Measured on the validation split with the shipped layer (docs/RESULTS.md): a quarter-
               size gist costs 11% of the full tower, and at ~15% of the full prefill texture-only
               selection answered 7.7 points better [+3.9, +11.4] at the same cost.
    margin     "before" only: rings of context cells encoded around every chosen cell and dropped
               before the language model (a chosen cell's token depends on its neighbours).
    periphery  "before" only: the language model also reads the gist tokens of the regions not
               encoded at full resolution, each at the full-grid cell under its centre.
    windows    "before" only, Qwen2.5-VL only: every attention window of the tower that holds a
               chosen cell is encoded whole (its window layers then see exactly their stock inputs);
               the window's other cells are context, encoded and dropped like the margin (union
               with it). Windows are the full grid's, as the tower assigns them (`cell_windows`).
    saccade    "before" only: how many looks (`SaccadeConfig.passes`, 1 = one look) and how each further
               one is decided and aimed (`arr_coc.saccade`); a mapping of its fields is accepted.
    """

    mode: EncodeMode = "after"
    gist: float = 0.0
    margin: int = 0
    periphery: bool = False
    windows: bool = False
    saccade: SaccadeConfig = SaccadeConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "saccade", SaccadeConfig.of(self.saccade))
        if self.mode not in ENCODE_MODES:
            raise ValueError(f"encode mode {self.mode!r} is not one of {list(ENCODE_MODES)}")
        if not 0.0 <= self.gist < 1.0:
            raise ValueError(f"gist={self.gist} must be a share of the tokens in [0, 1) (0: no gist)")
        if self.margin < 0:
            raise ValueError(f"margin={self.margin} must be >= 0 cells")
        before_only = [s for s, on in ((f"gist={self.gist}", self.gist > 0), (f"margin={self.margin}", self.margin > 0),
                                       ("windows=True (--whole-windows)", self.windows),
                                       (f"passes={self.passes} (--passes)", self.passes > 1)) if on]
        if self.mode == "after" and before_only:
            raise ValueError(f"mode='before' (--encode before) is needed for {', '.join(before_only)}, which choose "
                             "what the tower encodes before selection; with 'after' every patch is encoded anyway")
        if self.periphery and self.gist <= 0:
            raise ValueError("periphery=True shows the language model the gist: it needs gist > 0")

    @property
    def passes(self) -> int:
        return self.saccade.passes


def as_encode_config(encode: EncodeConfig | str | None) -> EncodeConfig:
    """None / "after" / "before" / an EncodeConfig -> an EncodeConfig."""
    if encode is None:
        return EncodeConfig()
    if isinstance(encode, EncodeConfig):
        return encode
    if isinstance(encode, str):
        return EncodeConfig(mode=encode)  # type: ignore[arg-type]
    raise TypeError(f"encode must be 'after', 'before' or an EncodeConfig, got {type(encode).__name__}")


__all__ = ["ENCODE_MODES", "EncodeConfig", "EncodeMode", "as_encode_config"]
