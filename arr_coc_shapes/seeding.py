"""Per-item random generators: every item draws from its own PCG64 seeded by (seed, split, index)."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def item_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The generator for one item: PCG64 seeded by (seed, split, index).

    The split name enters through a stable hash (not Python's salted ``hash``),
    so "train" and "test" with the same seed share no items.
    """
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
    split_key = int.from_bytes(hashlib.sha256(split.encode("utf-8")).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, split_key, index])))


def choice(rng: np.random.Generator, options: Sequence):
    """One of ``options``, uniformly (one ``rng.integers`` draw)."""
    return options[int(rng.integers(len(options)))]
