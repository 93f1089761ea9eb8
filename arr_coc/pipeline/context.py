"""One request's context: built once by the front door, read where a stage needs it.

    backend   the VLM (`VLMBackend`, with whatever capabilities it has)
    pruning   what to prune and how (`Pruning`: method, budgets, encode, buckets, adapter on or off)
    layer     the ARR-COC layer, built on first call (so methods that never read it never build it)
    seed      what seeded choices (random, a clip's tie-breaks) draw from
    clock     where each stage's wall time goes (`Stopwatch`; a fresh one unless the caller times stages itself)

Nothing in the pipeline threads these one by one: `answer`, `prepare`, the looks and the choice read them here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..stopwatch import Stopwatch

from .backend import VLMBackend
from .request import Pruning

if TYPE_CHECKING:
    from ..core.layer import ARRCOCLayer


@dataclass(frozen=True)
class RequestContext:
    """What one request runs with (module docstring)."""

    backend: VLMBackend
    pruning: Pruning
    layer: Callable[[], ARRCOCLayer]
    seed: int = 0
    clock: Stopwatch = field(default_factory=Stopwatch)

    def with_pruning(self, pruning: Pruning) -> RequestContext:
        return dataclasses.replace(self, pruning=pruning)


__all__ = ["RequestContext"]
