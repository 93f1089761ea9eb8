"""The scorers' training recipe: one dataclass, saved into the training log."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import SPREAD_SOURCES
from ..paths import SHIPPED_LAYER

VAL_BUDGETS = (0.05, 0.1, 0.25)   # validation: answer-cell coverage at these budgets


@dataclass
class TrainConfig:
    stage: int = 1
    out: str = SHIPPED_LAYER
    seed: int = 0
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3               # stage 2 uses --lr 1e-3 (the answer's gradient is small and noisy)
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    tau: float = 0.05              # stage 1: softmax temperature over relevance (relevance units)
    mask_temperature: tuple[float, float] = (0.5, 0.1)  # stage 2: soft-mask T (in relevance std units), start -> end
    budget_weight: float = 1.0     # stage 2: (soft kept share - budget share)^2 penalty
    budgets: tuple[float, ...] = (0.05, 0.1, 0.25)  # stage 2: budget drawn per step
    rank_weight: float = 0.0       # stage 2: + this x stage 1's ranking loss (keeps the answer's cells covered)
    attn_dim: int | None = None    # participatory width of a fresh layer (None: the config's default); not with `init`
    encode: str = "after"          # "before": train for encode="before" (gist 0: texture + question only)
    gist: float = 0.0              # > 0: the layer reads the gist's tokens, as with encode="before" (that share)
    add_texture: tuple[str, ...] = ()  # texture groups added to the layer (widen_texture), e.g. SHAPE_GROUPS
    spread_tau: float = 0.02       # saved layer: budget scaled by the relevant cells at this softmax T (0: exact)
    budget_follows: str = "perplexity"  # what counts the relevant cells: "perplexity" of the map or "extent" (a fitted head)
    spread_bounds: tuple[float, float] | None = None  # the budget's scale is clipped to these (None: the layer's own)
    spread_per_cell: float | None = None  # raise a budget to at most this many tokens per needed cell (None: the layer's)
    val_fraction: float = 0.1
    eval_every: int = 50

    def __post_init__(self) -> None:
        if self.encode not in ("after", "before"):
            raise ValueError(f"encode={self.encode!r} must be 'after' or 'before'")
        if self.gist > 0:
            self.encode = "before"  # a gist exists only in before mode
        self.add_texture = tuple(self.add_texture)
        if self.budget_follows not in SPREAD_SOURCES:
            raise ValueError(f"budget_follows={self.budget_follows!r} must be 'perplexity' or 'extent'")
        if self.spread_bounds is not None:
            self.spread_bounds = (float(self.spread_bounds[0]), float(self.spread_bounds[1]))

    @property
    def reads_tokens(self) -> bool:
        """Whether the layer reads visual tokens (the full encoding, or the gist's): not in before mode without a gist."""
        return self.encode == "after" or self.gist > 0
