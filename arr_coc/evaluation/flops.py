"""FLOP counting: torch's FlopCounterMode, taught the CPU flash-attention kernel it has no formula for.

A counter that misses attention undercounts exactly the part pruning saves most on, so the
kernel is added here and the test suite checks the total against the analytic count.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..pipeline.selection import MARKS, Selection, SelectionContext, Selector

logger = logging.getLogger(__name__)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of an SDPA kernel: QK^T + AV, full matrix, over the query's heads (the CPU flash kernel has no torch
    formula; the CUDA ones have one that refuses grouped-query attention)."""
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def flop_counter():
    """A silent FlopCounterMode that also counts PyTorch's CPU flash-attention kernel."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        mapping[op] = _cpu_sdpa_flops
    # CUDA kernels: torch's own formula asserts the key has the query's heads, which grouped-query attention
    # (Qwen2-VL-2B's LM: 12 query heads, 2 key/value heads) breaks; the count depends on the query's heads only.
    for name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            mapping[op] = _cpu_sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """(fn(*args, **kwargs), FLOPs it ran)."""
    with flop_counter() as counter:
        out = fn(*args, **kwargs)
    return out, int(counter.get_total_flops())


class CountedSelector:
    """Wraps a selector: runs it normally, keeps the context to count its FLOPs afterwards (off the clock)."""

    def __init__(self, fn: Selector, name: str):
        self.fn = fn
        self.__name__ = name
        for mark in MARKS:       # it can run where `fn` can (before the tower, on a clip) and records what it reads
            setattr(self, mark, getattr(fn, mark, False))
        self.contexts: list[SelectionContext] = []

    def __call__(self, ctx: SelectionContext) -> Selection | Any:
        self.contexts.append(ctx)
        return self.fn(ctx)

    def flops(self) -> int | None:
        """The selector's FLOPs over every context it ran on (a saccade may choose again); None (unknown) when
        they cannot be counted."""
        calls = self.flops_per_call()
        return None if calls is None else sum(calls)

    def flops_per_call(self) -> list[int] | None:
        """The selector's FLOPs on each context it ran on, in order; None (unknown) when they cannot be counted."""
        try:
            return [count_flops(self.fn, ctx)[1] for ctx in self.contexts]
        except Exception as exc:  # noqa: BLE001 - an unknown count is reported as unknown, never as 0
            logger.warning("could not count the FLOPs of %s (%s); reporting them as unknown", self.__name__, exc)
            return None
