"""ARR-COC configuration: one nested dataclass holds every number.

`ARRCOCConfig` is the single factory input of `ARRCOCLayer` (nanoGPT's
GPTConfig pattern): each stage reads its own sub-config, every field is
validated in `__post_init__`, and the whole tree round-trips through JSON
so a trained layer is a `config.json` next to `model.safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..budget import DEFAULT_BUDGET, Budget, check_budget

TEXTURE_GROUPS = ("rgb", "position", "sobel", "saliency", "clusters", "highpass")   # the default array
# Groups a layer may add to the default (texture.groups in its config.json): shape cues for a layer that reads
# no visual token (encode="before"), where colour and position alone cannot tell a triangle from a square.
# SHAPE_GROUPS describe what each cell holds; OBJECT_GROUPS the whole object a cell is part of.
SHAPE_GROUPS = ("silhouette", "orientation")
OBJECT_GROUPS = ("object",)
EXTRA_GROUPS = SHAPE_GROUPS + OBJECT_GROUPS
# What a question-following budget counts as the cells a question needs (AttendingConfig.spread_source).
SPREAD_SOURCES = ("perplexity", "extent")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class TextureConfig:
    """Texture array: which channel groups to compute and their constants."""

    groups: tuple[str, ...] = TEXTURE_GROUPS
    work_px: int = 16            # pixels per cell side the channels are computed at (area-resampled)
    n_clusters: int = 6          # k-means clusters over cell colours
    kmeans_iters: int = 8
    edge_scale: float = 0.025    # squash constant: cell edge energy e -> e / (e + scale)
    highpass_scale: float = 0.02
    contrast_scale: float = 0.08
    saliency_size: int = 64      # spectral residual runs on a thumbnail of this long side (Hou & Zhang 2007)

    def __post_init__(self) -> None:
        self.groups = tuple(self.groups)
        known = TEXTURE_GROUPS + EXTRA_GROUPS
        unknown = [g for g in self.groups if g not in known]
        _check(not unknown, f"unknown texture groups {unknown}; choose from {known}")
        _check(len(set(self.groups)) == len(self.groups), f"texture.groups {self.groups} names a group twice")
        _check(len(self.groups) > 0, "texture.groups must name at least one channel group")
        _check(self.work_px >= 4, "texture.work_px must be >= 4")
        _check(self.n_clusters >= 2, "texture.n_clusters must be >= 2")
        _check(self.kmeans_iters >= 1, "texture.kmeans_iters must be >= 1")
        for name in ("edge_scale", "highpass_scale", "contrast_scale"):
            _check(getattr(self, name) > 0, f"texture.{name} must be > 0")
        _check(self.saliency_size >= 16, "texture.saliency_size must be >= 16")


@dataclass
class KnowingConfig:
    """The three scorers (information, perspectival, participatory)."""

    query_dim: int = 64          # the VLM's text hidden size (question-token embedding width)
    entropy_bins: int = 8        # soft histogram bins for the local channel entropy
    entropy_window: int = 3      # neighbourhood (cells) over which entropy is measured
    cnn_width: int = 16          # perspectival CNN channels
    attn_dim: int = 32           # participatory cross-attention width
    embed_weight: float = 1.0    # initial weight of the training-free (VLM-token) participatory path
    learned_weight: float = 0.1  # initial weight of the learned cross-attention path
    embed_tau: float = 0.05      # soft-max temperature over question tokens (cosine units)

    def __post_init__(self) -> None:
        _check(self.query_dim >= 1, "knowing.query_dim must be >= 1 (the VLM's text hidden size)")
        _check(self.entropy_bins >= 2, "knowing.entropy_bins must be >= 2")
        _check(self.entropy_window in (1, 3, 5, 7), "knowing.entropy_window must be 1, 3, 5 or 7")
        _check(self.cnn_width >= 1 and self.attn_dim >= 1, "knowing.cnn_width and attn_dim must be >= 1")
        _check(self.embed_tau > 0, "knowing.embed_tau must be > 0")


@dataclass
class BalancingConfig:
    """Adaptive tension balancer: question + map statistics -> three sigmoid weights."""

    hidden: int = 32
    # Initial weights (information, perspectival, participatory), each in (0, 1).
    # Question coupling leads; bottom-up salience fills in where the question says little.
    init_weights: tuple[float, float, float] = (0.15, 0.3, 0.9)

    def __post_init__(self) -> None:
        self.init_weights = tuple(float(w) for w in self.init_weights)
        _check(self.hidden >= 1, "balancing.hidden must be >= 1")
        _check(len(self.init_weights) == 3, "balancing.init_weights needs three values")
        _check(all(0.0 < w < 1.0 for w in self.init_weights), "balancing.init_weights must lie in (0, 1)")


@dataclass
class AttendingConfig:
    """Token allocation: how many tokens each image keeps and which."""

    budget: Budget = DEFAULT_BUDGET  # fixed mode: share in (0, 1] or token count (arr_coc.budget)
    mode: str = "fixed"            # "fixed" | "adaptive"
    min_ratio: float = 0.05        # adaptive bounds, as shares of the image's tokens
    max_ratio: float = 0.5
    void_threshold: float = 0.06   # relevance spread (max - median) below this -> grid fallback
    # Budget that follows the question (spread_tau 0: off, every image keeps exactly its budget).
    # An image's budget is scaled by the number of cells the layer finds relevant, the perplexity
    # of softmax(relevance / spread_tau), over spread_reference (training sets it so the scale
    # averages 1 over its items), clipped to [spread_min, spread_max]; it is raised to at most
    # spread_per_cell tokens per relevant cell (more only adds distractors), so the tokens kept
    # average at most the budget. spread_source "extent": the relevant cells are the layer's
    # `ExtentHead` prediction of the answer's cells instead of that perplexity (arr_coc.core.extent).
    spread_tau: float = 0.0
    spread_source: str = "perplexity"
    spread_reference: float = 1.0
    spread_min: float = 0.6
    spread_max: float = 2.0
    spread_per_cell: float = 2.0

    def __post_init__(self) -> None:
        check_budget(self.budget, "attending.budget")
        _check(self.spread_tau >= 0.0, "attending.spread_tau must be >= 0 (0 keeps every image's budget exact)")
        _check(self.spread_reference > 0.0, "attending.spread_reference must be > 0")
        _check(0.0 < self.spread_min <= 1.0 <= self.spread_max,
               "need 0 < attending.spread_min <= 1 <= spread_max (the scale of an image's budget)")
        _check(self.spread_per_cell > 0.0, "attending.spread_per_cell must be > 0")
        _check(self.spread_source in SPREAD_SOURCES,
               f"attending.spread_source must be 'perplexity' or 'extent', got {self.spread_source!r}")
        _check(self.mode in ("fixed", "adaptive"), f"attending.mode must be 'fixed' or 'adaptive', got {self.mode!r}")
        _check(0.0 < self.min_ratio <= self.max_ratio <= 1.0, "need 0 < attending.min_ratio <= max_ratio <= 1")
        _check(self.void_threshold >= 0.0, "attending.void_threshold must be >= 0 (0 disables the grid fallback)")


@dataclass
class TemporalConfig:
    """How a video clip's budget is spread over its temporal groups (`arr_coc.core.temporal`)."""

    decay: float = 0.8             # share of the carried relevance kept from group to group (0: none)
    carry: str = "max"             # "max": decayed maximum; "motion": smoothing where a cell did not change, the
                                   # decayed maximum where it did; "mean": smoothing everywhere (temporal.carry)
    cut_threshold: float = 0.6     # histogram L1 distance (0..2) from the previous group that starts a scene
    static_threshold: float = 0.02  # mean |colour change| of a cell under which it did not change
    static_weight: float = 0.25    # score multiplier of an unchanged cell (its earlier token stands in)
    time_cue: float = 2.0          # how far words about the start / end tilt the budget in time
    min_per_group: int = 1         # every group keeps at least this many cells (and one at the least)

    def __post_init__(self) -> None:
        _check(0.0 <= self.decay < 1.0, f"temporal decay={self.decay} must be in [0, 1)")
        _check(self.carry in ("motion", "max", "mean"),
               f"temporal carry={self.carry!r} must be 'motion', 'max' or 'mean'")
        _check(0.0 <= self.static_weight <= 1.0, f"static_weight={self.static_weight} must be in [0, 1]")
        _check(self.min_per_group >= 0, f"min_per_group={self.min_per_group} must be >= 0")


_SUBCONFIGS = {
    "texture": TextureConfig,
    "knowing": KnowingConfig,
    "balancing": BalancingConfig,
    "attending": AttendingConfig,
    "temporal": TemporalConfig,
}


@dataclass
class ARRCOCConfig:
    """Everything `ARRCOCLayer` needs; JSON round-trips exactly."""

    texture: TextureConfig = field(default_factory=TextureConfig)
    knowing: KnowingConfig = field(default_factory=KnowingConfig)
    balancing: BalancingConfig = field(default_factory=BalancingConfig)
    attending: AttendingConfig = field(default_factory=AttendingConfig)
    temporal: TemporalConfig = field(default_factory=TemporalConfig)
    strict: bool = False  # True: stage errors raise (training); False: keep all tokens and report

    def __post_init__(self) -> None:
        for name, cls in _SUBCONFIGS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _from_dict(cls, value, name))
            elif not isinstance(value, cls):
                raise TypeError(f"ARRCOCConfig.{name} must be a {cls.__name__} or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ARRCOCConfig":
        return _from_dict(cls, data, "ARRCOCConfig")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ARRCOCConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **sections: dict[str, Any]) -> "ARRCOCConfig":
        """Copy with some sub-config fields changed: `cfg.replace(attending={"budget": 0.1})`."""
        data = self.to_dict()
        for section, values in sections.items():
            if section not in data or not isinstance(data[section], dict):
                raise ValueError(f"unknown config section {section!r}; choose from {list(_SUBCONFIGS)}")
            unknown = set(values) - set(data[section])
            _check(not unknown, f"unknown fields {sorted(unknown)} in section {section!r}")
            data[section].update(values)
        return ARRCOCConfig.from_dict(data)

    def with_query_dim(self, query_dim: int) -> "ARRCOCConfig":
        return self.replace(knowing={"query_dim": int(query_dim)})


def _from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    _check(not unknown, f"unknown fields {sorted(unknown)} in {where}; known: {sorted(names)}")
    return cls(**data)
