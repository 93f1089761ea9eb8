"""What a microscope request works with: the server's shared state (`Microscope`) and one request's runs (`Run`,
`Pruned`). The handler, the configurations and the readout all read these; none of them imports another for them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arr_coc.validation.limits import LIMITS, InputLimits
from arr_coc_microscope.admission import Admission

if TYPE_CHECKING:
    from arr_coc import ARRCOC, Trace
    from arr_coc.evaluation.cost import Flops
    from arr_coc.encode import EncodeConfig
    from arr_coc.pipeline import Answered

MEMO_LIMIT = 4096           # FLOP counts memoised per server (grids x cell counts x prompt lengths)


@dataclass(frozen=True)
class RunConfig:
    """One pruned run: which vlm (layer), which method, which encoding."""

    label: str                    # "A" or "B"
    layer: str                    # a key of Microscope.layers
    method: str                   # a selector name (B: always arr_coc)
    encode: EncodeConfig

    def encode_text(self) -> str:
        return encode_text(self.encode)

    def describe(self) -> str:
        return f"{self.label}: {self.method}, encode {self.encode_text()}, layer {self.layer}"


def encode_text(encode: EncodeConfig) -> str:
    """'after', or 'before' with what it adds: 'before (gist 0.25, margin 1, periphery, 2 looks, threshold 0.27)'."""
    if encode.mode == "after":
        return "after"
    looks = encode.saccade
    extras = ([f"gist {encode.gist:g}"] if encode.gist > 0 else []) + (
        [f"margin {encode.margin}"] if encode.margin else []) + (["periphery"] if encode.periphery else []) + (
        [f"{looks.passes} looks", f"threshold {round(looks.threshold, 2):g}"] if looks.passes > 1 else [])
    return "before" + (f" ({', '.join(extras)})" if extras else "")


@dataclass
class Microscope:
    """What the handlers share: read-only after `server.load()` (the lock only serialises model calls)."""

    vlm: ARRCOC
    model_name: str
    methods: list[str]               # the registry's methods a request can run, at start-up, "arr_coc" first
    max_new_tokens: int = 32
    layer_name: str = "untrained"    # which ARR-COC scorer weights: "trained (<folder>)" or "untrained"
    lock: threading.Lock = field(default_factory=threading.Lock)
    limits: InputLimits = LIMITS     # arr_coc.validation.limits.limits_for(this model's processor)
    admission: Admission = field(default_factory=Admission)
    more_layers: dict[str, ARRCOC] = field(default_factory=dict)   # --compare-arr-coc, by name (configs.py)
    count_flops: bool = True         # count each run's FLOPs off the clock (arr_coc.evaluation.cost); --no-flops: off
    flops_memo: dict = field(default_factory=dict)                      # shape-only counts, shared by requests
    before_layer: str | None = None  # the layer trained for encode="before" (embedded model), by name, if offered
    clip_vlms: dict[str, ARRCOC] = field(default_factory=dict)   # per layer name, on the clip model (if any)
    clip_model_name: str = ""        # the model that answers clips, when it is not `model_name`'s

    @property
    def cell_px(self) -> int:
        """Pixels per merged visual token side (28 for Qwen2/2.5-VL, 32 for Qwen3-VL): the backend's
        `LaysOutVisuals.image_scale`."""
        from arr_coc.pipeline.backend import LaysOutVisuals, require

        return require(self.vlm.backend, LaysOutVisuals, "show its cells on the image").image_scale().cell_px

    @property
    def layers(self) -> dict[str, ARRCOC]:
        """Every ARR-COC layer the server offers, by name, the --arr-coc one first (one VLM under all)."""
        return {self.layer_name: self.vlm, **self.more_layers}

    @property
    def default_compare(self) -> tuple[str, str]:
        """Config B when a request does not say: the shipped layer trained for encode="before" with its own adapter
        where it ships one (the library's default for that layer: `ARRCOC.from_pretrained`), encoding before (the
        embedded model's default: after vs. before, each with its own layer); else the first --compare-arr-coc
        layer, encoding after like A's default (compare checkpoints); without one, the same layer encoding before
        (compare the modes)."""
        if f"{self.before_layer} + adapter" in self.more_layers:
            return f"{self.before_layer} + adapter", "before"
        if self.before_layer in self.more_layers:
            return self.before_layer, "before"
        return (next(iter(self.more_layers)), "after") if self.more_layers else (self.layer_name, "before")

    def vlm_for(self, layer: str | None, kind: str) -> ARRCOC:
        """The vlm (model + layer) a run uses: the layer's (None: the server's own, for the baseline), on the
        model made for the input: a clip is answered by the clip model when the server has one (`clip_vlms`,
        the embedded model's video fine-tune by default), an image by the image model."""
        name = self.layer_name if layer is None else layer
        if kind == "clip" and self.clip_vlms:
            return self.clip_vlms[name]
        return self.layers[name]

    def model_for(self, kind: str) -> str:
        """How the page names the model that answers this kind of input."""
        return self.clip_model_name if kind == "clip" and self.clip_vlms else self.model_name


@dataclass
class Run:
    """One instrumented pipeline call."""

    answer: str
    trace: Trace
    counted: Any = None              # the CountedSelector it ran (FLOPs), or None
    vlm: Any = None              # the ARRCOC that ran it (its model answered; its backend counts the FLOPs)
    flops: Flops | None = None       # filled off the clock by `_count_flops`
    answered: Answered | None = None  # the pipeline's record of the run (its prompt, every look), for the FLOPs


@dataclass
class Pruned:
    """A configuration's run: its answer and trace, or (run None) why it failed and fell back to the baseline."""

    config: RunConfig
    run: Run | None
    failed: str | None = None


__all__ = ["MEMO_LIMIT", "Microscope", "Pruned", "Run", "RunConfig", "encode_text"]
