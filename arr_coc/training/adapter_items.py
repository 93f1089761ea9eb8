"""What train-adapter learns from: (image, question, answer, type) items, deterministic in their index.

- `ShapesItems`: ShapesVQA items drawn on the fly (the embedded model's default);
- `JsonlItems`: the records of JSONL splits in docs/DATA.md's format (GQA, TextVQA, VQAv2, ... converted by
  `python -m arr_coc convert`), for a real checkpoint: shuffled once by a seed, some held out for validation.

Both oversample question types by weight (stage 3, `--hard`) the same way: a seeded coin per index rejects a draw
with probability 1 - weight / max weight, and the next draw is taken.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np
import torch

Item = tuple[Any, str, str, str]          # (RGB image, question, the answer to learn, question type)
ATTEMPTS = 64                             # draws per index before a rejected type is taken anyway


def _accept(weights: dict[str, float], kind: str, seed: int, index: int, attempt: int) -> bool:
    top = max(weights.values(), default=1.0)
    keep = weights.get(kind, 1.0) / top
    return keep >= 1 or np.random.default_rng((seed, index, attempt)).random() < keep


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
        from ..shapes import make_item
        from ..shapes.vocabulary import DEFAULT_HARD_RATE

        rate = DEFAULT_HARD_RATE if self.hard_rate is None else self.hard_rate
        for attempt in range(ATTEMPTS):
            image, record, _ = make_item(self.seed, self.split, index * ATTEMPTS + attempt, hard_rate=rate)
            if _accept(self.weights, record["type"], self.seed, index, attempt):
                break
        return image, record["question"], record["answers"][0], record["type"]


def answer_to_learn(answers: Sequence[str]) -> str:
    """The most frequent of a record's answers (VQAv2 and TextVQA give ten annotators'), the first on a tie."""
    counts = Counter(answers)
    return max(answers, key=lambda a: counts[a])


class JsonlItems(torch.utils.data.Dataset):
    """`n` training items cycling through `records` (a fresh seeded order each pass), index -> Item; images are
    read when drawn (so DataLoader workers read them)."""

    def __init__(self, records: Sequence, n: int, seed: int, weights: dict[str, float] | None = None):
        if not records:
            raise ValueError("no training records left (fewer records than --val-items?)")
        self.records, self.n, self.seed, self.weights = list(records), n, seed, weights or {}
        self._order: tuple[int, Any] = (-1, None)         # (pass, its permutation of the records)
        self.held_ids: tuple[str, ...] = ()                # the records held out for validation (split)

    @classmethod
    def split(cls, paths: Sequence[str], n: int, val_items: int, seed: int,
              weights: dict[str, float] | None = None) -> tuple[JsonlItems, list[Item]]:
        """(training items, validation items): the records of `paths`, shuffled by `seed`, the first `val_items`
        held out for validation and never trained on. A hard type that no record has is refused."""
        from ..data import read_jsonl

        records = [r for p in paths for r in read_jsonl(p)]
        order = np.random.default_rng(seed).permutation(len(records))
        records = [records[i] for i in order]
        types = {r.type or "other" for r in records}
        missing = sorted(set(weights or {}) - types)
        if missing:
            raise ValueError(f"--hard-types {','.join(missing)}: no record of {', '.join(paths)} has that type "
                             f"(its types: {', '.join(sorted(types))})")
        held = records[:val_items]
        data = cls(records[val_items:], n, seed, weights)
        data.held_ids = tuple(r.id for r in held)
        return data, [cls._item(r) for r in held]

    def __len__(self) -> int:
        return self.n

    @staticmethod
    def _item(record: Any) -> Item:
        return record.load_image(), record.question, answer_to_learn(record.answers), record.type or "other"

    def _record(self, index: int, attempt: int) -> Any:
        """Attempt 0: the index's place in its pass's order; a redraw (a rejected type): a seeded random record."""
        size = len(self.records)
        if attempt:
            return self.records[int(np.random.default_rng((self.seed, index, attempt)).integers(size))]
        turn, place = divmod(index, size)
        if self._order[0] != turn:
            self._order = (turn, np.random.default_rng((self.seed, turn)).permutation(size))
        return self.records[int(self._order[1][place])]

    def __getitem__(self, index: int) -> Item:
        for attempt in range(ATTEMPTS):
            record = self._record(index, attempt)
            if _accept(self.weights, record.type or "other", self.seed, index, attempt):
                break
        return self._item(record)


__all__ = ["Item", "JsonlItems", "ShapesItems", "answer_to_learn"]
