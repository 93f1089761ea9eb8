"""ShapesVQA items drawn on the fly for train-adapter (`python -m arr_coc_shapes train-adapter`): the embedded
model's adapters learn from these; the library's train-adapter takes them as an `ItemSource`.

--hard (stage 3) draws the hard question types `--hard-weight` times as often and the generator's hard scenes
(small, faint, crowded) as often again: its rate 0.3 x the weight, at most MAX_HARD_RATE.
"""

from __future__ import annotations

from typing import Any

import torch

from arr_coc.training.adapter_items import ATTEMPTS, Item, accept

from .items import make_item
from .vocabulary import DEFAULT_HARD_RATE, QUESTION_TYPES

MAX_HARD_RATE = 0.42                   # the generator's ceiling (layout.draw_hard: letters absorb low contrast)


class ShapesItems(torch.utils.data.Dataset):
    """ShapesVQA items generated on the fly: index -> Item, deterministic in the index. With `weights` (type ->
    weight >= 1) a type is drawn in proportion to its weight, and with `hard_rate` the generator's hard scenes come
    that often."""

    def __init__(self, seed: int, split: str, n: int, weights: dict[str, float] | None = None,
                 hard_rate: float | None = None):
        self.seed, self.split, self.n, self.weights, self.hard_rate = seed, split, n, weights or {}, hard_rate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Item:
        rate = DEFAULT_HARD_RATE if self.hard_rate is None else self.hard_rate
        for attempt in range(ATTEMPTS):
            image, record, _ = make_item(self.seed, self.split, index * ATTEMPTS + attempt, hard_rate=rate)
            if accept(self.weights, record["type"], self.seed, index, attempt):
                break
        return image, record["question"], record["answers"][0], record["type"]


class ShapesSource:
    """The `ItemSource` of ShapesVQA: training items of split "adapter" at cfg.data_seed, validation items of
    "adapter-val" at cfg.data_seed + 1."""

    def check(self, cfg: Any) -> None:
        unknown = [t for t in cfg.hard_types if t not in QUESTION_TYPES]
        if unknown:
            raise ValueError(f"hard types {unknown}: choose from {', '.join(QUESTION_TYPES)}")

    def draw(self, cfg: Any, n: int, weights: dict[str, float]) -> tuple[torch.utils.data.Dataset, list[Item]]:
        rate = min(MAX_HARD_RATE, DEFAULT_HARD_RATE * cfg.hard_weight) if cfg.hard else None
        val = ShapesItems(cfg.data_seed + 1, "adapter-val", cfg.val_items)
        return ShapesItems(cfg.data_seed, "adapter", n, weights, rate), [val[i] for i in range(cfg.val_items)]


__all__ = ["MAX_HARD_RATE", "ShapesItems", "ShapesSource"]
