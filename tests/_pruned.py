"""What several test files run on a front door: one look and the language model's forward over it."""

from __future__ import annotations

from typing import Any

import torch

from arr_coc.pipeline import Prepared, Pruning
from arr_coc.pipeline.trace import PrefillOutput


@torch.no_grad()
def prepare_state(vlm: Any, inputs: dict, budget: Any = None, method: Any = "arr_coc", **how: Any) -> Prepared:
    """One look (`ARRCOC.prepare`) with `Pruning.of`'s arguments in its order."""
    return vlm.prepare(inputs, Pruning.of(method, budget, **how))


@torch.no_grad()
def forward_pruned(vlm: Any, budget: Any = None, method: Any = "arr_coc", kept_indices: Any = None,
                   budget_mode: Any = None, encode: Any = None, **inputs: Any) -> PrefillOutput:
    """Prune the processor's tensors and run the prefill: logits [B, S', V] + pruned inputs + traces."""
    state = vlm.prepare(inputs, Pruning.of(method, budget, budget_mode, encode, kept_indices=kept_indices))
    out = vlm.backend.prefill(state.pruned)
    return PrefillOutput(logits=out.logits, pruned=state.pruned, traces=state.traces)
