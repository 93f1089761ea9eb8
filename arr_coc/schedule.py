"""The one learning-rate schedule: linear warm-up, then cosine decay to `floor` x peak."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.0) -> float:
    """Learning rate at `step` (0-based) of `total`: warm-up over `warmup` steps, then cosine to floor * peak.

    The scorers' training decays to 0 (floor 0); the embedded VLM's to a tenth (floor 0.1).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
