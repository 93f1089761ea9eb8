"""Helpers shared by the anchor methods (not part of the public surface)."""

from __future__ import annotations

import contextlib
from typing import Iterator


def check_count(k: int, n: int) -> int:
    """k clamped to [1, n]: every image keeps at least one token and at most all of them."""
    return max(1, min(int(k), int(n)))


@contextlib.contextmanager
def eager_attention(module) -> Iterator[None]:
    """Run `module` (a transformers PreTrainedModel) with eager attention, then restore its implementation.

    Eager attention is the only implementation that returns attention weights. The switch touches this
    one instance's config and is undone on exit, also when the body raises (patch one instance, reversibly: docs/DESIGN.md).
    """
    previous = module.config._attn_implementation
    if previous == "eager":
        yield
        return
    module.set_attn_implementation("eager")
    try:
        yield
    finally:
        module.set_attn_implementation(previous)


def rows_of(item_of_image: list[int]) -> list[int]:
    """The batch rows an image list covers, ascending (a selection context may be a per-item subset)."""
    return sorted(set(int(b) for b in item_of_image))
