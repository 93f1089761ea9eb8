"""Helpers shared by the anchor methods (not part of the public surface)."""

from __future__ import annotations


def check_count(k: int, n: int) -> int:
    """k clamped to [1, n]: every image keeps at least one token and at most all of them."""
    return max(1, min(int(k), int(n)))
