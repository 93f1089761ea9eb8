"""Wall time per stage of one pass through the pruning path, measured where the work runs.

The pruning path calls `clock.lap("texture")` after each stage (the layer's pass in sub-stages, "texture.sobel",
"scorers.information", ...: `folded` adds them up per stage); with a plain `Stopwatch()` a lap
only reads the host clock (a few hundred nanoseconds, no synchronisation: the stages' device work may
still be queued, so a lap on a GPU then times the launches, not the kernels). `Stopwatch(device,
sync=True)` waits for the device at every lap, so each stage gets the time its kernels took: what
`bench --stages` reports, and what it costs (one synchronisation per lap), so never on the fast path.

`counter` (an `arr_coc.evaluation.opcount.OpCounter` that is active around the pass) splits its op counts
by stage the same way.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

import torch


class Stopwatch:
    """Seconds (and, with a counter, aten ops and host synchronisations) per named stage."""

    def __init__(self, device: torch.device | str | None = None, sync: bool = False, counter: Any = None,
                 timer: Callable[[], float] = time.perf_counter):
        self.timer = timer   # time.perf_counter (wall) or time.process_time (this process's CPU time)
        self.device = None if device is None else torch.device(device)
        self.sync = sync and self.device is not None and self.device.type == "cuda"
        self.counter = counter
        self.seconds: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self.syncs: dict[str, int] = defaultdict(int)
        self.uploads: dict[str, int] = defaultdict(int)
        self.kernels: dict[str, int] = defaultdict(int)
        self._t = self.timer()
        self._marks = (0, 0, 0, 0)

    def start(self) -> Stopwatch:
        """Begin the first stage now."""
        if self.sync:
            torch.cuda.synchronize(self.device)
        self._t = self.timer()
        self._marks = self._read()
        return self

    def _read(self) -> tuple[int, int, int, int]:
        c = self.counter
        return (0, 0, 0, 0) if c is None else (c.total, c.syncs, c.uploads, c.kernels)

    def lap(self, stage: str) -> None:
        """The work since the last lap was `stage` (stages repeat: their times add up)."""
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = self.timer()
        self.seconds[stage] += now - self._t
        self._t = now
        if self.counter is not None:
            marks = self._read()
            self.ops[stage] += marks[0] - self._marks[0]
            self.syncs[stage] += marks[1] - self._marks[1]
            self.uploads[stage] += marks[2] - self._marks[2]
            self.kernels[stage] += marks[3] - self._marks[3]
            self._marks = marks

    def total(self, *stages: str) -> float:
        return sum(self.seconds.get(s, 0.0) for s in stages)

    def folded(self, field: str = "seconds") -> dict[str, float]:
        """`seconds` (or `ops`, `kernels`, `syncs`, `uploads`) with sub-stages folded into their stage: the layer
        laps "texture.rgb", "texture.sobel", ..., "scorers.information", ...; folded they are "texture", "scorers"."""
        out: dict[str, float] = {}
        for stage, value in getattr(self, field).items():
            top = stage.split(".", 1)[0]
            out[top] = out.get(top, 0) + value
        return out


def lap(clock: Stopwatch | None, stage: str) -> None:
    """`clock.lap(stage)` when there is a clock."""
    if clock is not None:
        clock.lap(stage)


__all__ = ["Stopwatch", "lap"]
