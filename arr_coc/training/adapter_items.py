"""What train-adapter learns from: (image, question, answer, type) items, deterministic in their index.

- an `ItemSource`: items drawn on the fly by a test bed (the checkout's ShapesVQA: `arr_coc_shapes.adapter_items`,
  `python -m arr_coc_shapes train-adapter`, the embedded model's adapters);
- `JsonlItems`: the records of JSONL splits in docs/DATA.md's format (GQA, TextVQA, VQAv2, ... converted by
  `python -m arr_coc convert`), for a real checkpoint: shuffled once by a seed, some held out for validation.

Both oversample question types by weight (stage 3, `--hard`) the same way: a seeded coin per index rejects a draw
with probability 1 - weight / max weight, and the next draw is taken.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, Sequence

import numpy as np
import torch

Item = tuple[Any, str, str, str]          # (RGB image, question, the answer to learn, question type)
ATTEMPTS = 64                             # draws per index before a rejected type is taken anyway


def accept(weights: dict[str, float], kind: str, seed: int, index: int, attempt: int) -> bool:
    top = max(weights.values(), default=1.0)
    keep = weights.get(kind, 1.0) / top
    return keep >= 1 or np.random.default_rng((seed, index, attempt)).random() < keep


class ItemSource(Protocol):
    """Items drawn on the fly, what train-adapter learns from without --data: a test bed's generator (the
    checkout's ShapesVQA, `arr_coc_shapes.adapter_items.ShapesSource`). Given to `train_adapter(items=...)`."""

    def check(self, cfg: Any) -> None:
        """Refuse what the source cannot draw (ValueError, one line), before any model loads."""

    def draw(self, cfg: Any, n: int, weights: dict[str, float]) -> tuple[torch.utils.data.Dataset, list[Item]]:
        """(n training items, cfg.val_items fixed validation items), deterministic in cfg.data_seed."""


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
            if accept(self.weights, record.type or "other", self.seed, index, attempt):
                break
        return self._item(record)


__all__ = ["ATTEMPTS", "Item", "ItemSource", "JsonlItems", "accept", "answer_to_learn"]
