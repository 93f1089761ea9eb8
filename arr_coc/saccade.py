"""Saccades: after a pass of encode="before", look again where the first look was not enough.

A pass ends with the language model's distribution over the first answer token. Its uncertainty
(`uncertainty`: "margin" = 1 - (p_top1 - p_top2), or "entropy" = H / log V; both in [0, 1]) goes
through a soft, learnable threshold, the design's

    strength = sigmoid((uncertainty - threshold) * sharpness)          (`SaccadeGate`)

trained against the frozen VLM (`arr_coc.training.saccade`) and hardened at inference: an item looks
again when strength > 0.5, i.e. when (uncertainty - threshold) * sharpness > 0 (`SaccadeGate.decide`,
the soft decision's rounding). A saccade encodes further cells, never one already encoded
(`saccade_cells`), and the language model answers again from every kept token at its original M-RoPE
position (`arr_coc.pipeline.looks`).

Which cells a saccade adds (`SaccadeConfig.target`):
  "next"  the most relevant cells the first look did not encode, by the selector's relevance map;
  "ring"  the same ranking, but the 8-neighbours of the kept cells first (a partly seen object is
          completed before anything new is looked at), then the rest;
  "grow"  the selector chooses again at the first budget plus the saccade's (`grown`), in its own budget
          mode (a trained layer's extent head gives a count question more cells), and the saccade adds
          its choice minus what is encoded: the cells a larger first look would have read.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from .budget import Budget, BudgetError, check_budget, resolve_count
from .errors import InputError

Signal = Literal["margin", "entropy"]
Target = Literal["next", "ring", "grow"]
SIGNALS: tuple[str, ...] = ("margin", "entropy")
TARGETS: tuple[str, ...] = ("next", "ring", "grow")
THRESHOLD_INIT = 0.2734          # the design's initial threshold
SHARPNESS_INIT = 20.0


@dataclass(frozen=True)
class SaccadeConfig:
    """How many looks encode="before" may take, and how it decides and aims each further one.

    passes     1: one look (the one-pass before mode, exactly); N: up to N - 1 saccades per item
    budget     the cells each saccade adds per image: a share of the image's cells (0.03) or a count (12)
    target     "next" | "ring" | "grow": which cells (module docstring)
    signal     "margin" | "entropy": the first answer token's uncertainty (`uncertainty`)
    threshold  look again when the uncertainty is above it (the gate's hard decision)
    sharpness  the soft gate's slope (training; > 0)
    memory     a later look's tower pass attends to the keys and values of the cells earlier looks encoded
               (`arr_coc.qwen.tower_memory`; Qwen2-VL and Qwen3-VL); False: its cells form a segment of their own
    """

    passes: int = 1
    budget: Budget = 0.03
    target: Target = "next"
    signal: Signal = "margin"
    threshold: float = THRESHOLD_INIT
    sharpness: float = SHARPNESS_INIT
    memory: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.passes, bool) or not isinstance(self.passes, int) or self.passes < 1:
            raise ValueError(f"passes={self.passes!r} must be an integer >= 1 (1: one look, no saccade)")
        try:
            object.__setattr__(self, "budget", check_budget(self.budget, "saccade budget"))
        except BudgetError as exc:
            raise ValueError(str(exc)) from None
        if self.target not in TARGETS:
            raise ValueError(f"saccade target {self.target!r} is not one of {list(TARGETS)}")
        if self.signal not in SIGNALS:
            raise ValueError(f"saccade signal {self.signal!r} is not one of {list(SIGNALS)}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"saccade threshold={self.threshold} must be a finite number")
        if not (math.isfinite(self.sharpness) and self.sharpness > 0):
            raise ValueError(f"saccade sharpness={self.sharpness} must be > 0")

    @classmethod
    def of(cls, value: SaccadeConfig | dict | None) -> SaccadeConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"saccade must be a SaccadeConfig or a dict of its fields, got {type(value).__name__}")

    def with_gate(self, gate: SaccadeGate) -> SaccadeConfig:
        """This configuration with a (trained) gate's threshold and sharpness."""
        return dataclasses.replace(self, threshold=float(gate.threshold.detach()),
                                   sharpness=float(gate.sharpness.detach()))


def uncertainty(logits: torch.Tensor, signal: Signal = "margin") -> torch.Tensor:
    """logits [B, V] of the first answer token -> [B] in [0, 1], on their device (no host read).

    margin: 1 - (p_1 - p_2), the two likeliest tokens; entropy: H(p) / log V."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if signal == "margin":
        top = logp.topk(2, dim=-1).values.exp()
        return 1.0 - (top[:, 0] - top[:, 1])
    if signal == "entropy":
        return -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
    raise ValueError(f"saccade signal {signal!r} is not one of {list(SIGNALS)}")


class SaccadeGate(nn.Module):
    """strength = sigmoid((u - threshold) * sharpness); both learnable. Soft in training, hard at inference."""

    def __init__(self, threshold: float = THRESHOLD_INIT, sharpness: float = SHARPNESS_INIT):
        super().__init__()
        self.threshold = nn.Parameter(torch.tensor(float(threshold)))
        self.sharpness = nn.Parameter(torch.tensor(float(sharpness)))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u [B] -> the soft decision [B] in (0, 1)."""
        return torch.sigmoid((u - self.threshold) * self.sharpness)

    @torch.no_grad()
    def decide(self, u: torch.Tensor) -> torch.Tensor:
        """u [B] -> BoolTensor[B]: look again. Equals `forward(u).round()` (sigmoid(x) > 0.5 iff x > 0)."""
        return (u - self.threshold) * self.sharpness > 0


def decide(u: torch.Tensor, config: SaccadeConfig) -> torch.Tensor:
    """The hard decision of `config`'s gate: BoolTensor[B]."""
    return (u - config.threshold) * config.sharpness > 0


def strength(u: float, config: SaccadeConfig) -> float:
    """The soft decision of `config`'s gate for one uncertainty (what a trace shows): sigmoid((u - t) * k)."""
    x = max(-60.0, min(60.0, (u - config.threshold) * config.sharpness))
    return 1.0 / (1.0 + math.exp(-x))


def ring(cells: np.ndarray, grid_hw: tuple[int, int]) -> np.ndarray:
    """Bool[h * w]: the 8-neighbours of `cells` (raster), the cells themselves excluded."""
    h, w = grid_hw
    mask = np.zeros((h + 2, w + 2), dtype=bool)
    ys, xs = np.divmod(np.asarray(cells, dtype=np.int64), w)
    for dy in range(3):
        for dx in range(3):
            mask[ys + dy, xs + dx] = True
    out = mask[1:h + 1, 1:w + 1].reshape(-1).copy()
    out[np.asarray(cells, dtype=np.int64)] = False
    return out


def saccade_cells(relevance: np.ndarray, kept: np.ndarray, grid_hw: tuple[int, int], budget: Budget,
                  target: Target = "next") -> np.ndarray:
    """The cells one saccade adds to what the language model reads of an image, ascending raster indices.

    relevance float[h * w] (the selector's map, raster); kept: the cells the LM reads so far. A cell an
    earlier look encoded as context (margin, whole windows) may be chosen: its token exists, so it costs the
    tower nothing (`arr_coc.pipeline.looks` encodes only what no look encoded). Takes
    `resolve_count(budget, h * w)` cells, fewer when fewer are left. Ties in relevance go to the lower raster
    index (a stable sort: the same cells on every machine)."""
    h, w = grid_hw
    free = np.ones(h * w, dtype=bool)
    free[np.asarray(kept, dtype=np.int64)] = False
    k = min(resolve_count(budget, h * w), int(free.sum()))
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    order = np.argsort(-np.asarray(relevance, dtype=np.float64), kind="stable")
    if target == "ring":
        near = ring(kept, grid_hw)
        order = np.concatenate([order[near[order]], order[~near[order]]])   # stable within each part
    order = order[free[order]]
    return np.sort(order[:k]).astype(np.int64)


GATE_FILE = "gate.json"
GATE_FIELDS = ("budget", "target", "signal", "threshold", "sharpness", "memory")


def read_gate(path: str) -> dict:
    """A trained gate (`train-saccade`'s gate.json, or its folder) -> SaccadeConfig's fields it holds."""
    import json
    import os

    file = os.path.join(path, GATE_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise InputError(f"no saccade gate at {path}: pass the gate.json (or its folder) that "
                         "`python -m arr_coc train-saccade` wrote", "saccade_gate")
    with open(file) as f:
        data = json.load(f)
    missing = [k for k in GATE_FIELDS if k not in data and k != "memory"]   # memory: optional (default on)
    if missing:
        raise InputError(f"{file} is not a saccade gate: it lacks {missing}", "saccade_gate")
    return {k: data[k] for k in GATE_FIELDS if k in data}


def write_gate(path: str, config: SaccadeConfig, extra: dict | None = None) -> str:
    """Write `config`'s gate fields (+ `extra`: how it was trained and measured) as `path`/gate.json."""
    import json
    import os

    os.makedirs(path, exist_ok=True)
    file = os.path.join(path, GATE_FILE)
    with open(file, "w") as f:
        json.dump({**{k: getattr(config, k) for k in GATE_FIELDS}, **(extra or {})}, f, indent=1)
    return file


def grown(first: Budget | None, extra: Budget, n_tokens: int) -> Budget:
    """The budget of a look that adds `extra` to `first` (None: the default budget): shares add (at most 1.0),
    otherwise the two counts on this image do."""
    if isinstance(first, float) and isinstance(extra, float):
        return min(1.0, first + extra)
    return min(n_tokens, resolve_count(first, n_tokens) + resolve_count(extra, n_tokens))
