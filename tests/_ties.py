"""Cells kept by two engines, compared up to float32 ties.

The layer runs in float32 in both vLLM and the Hugging Face path. Its sums come out in another order when the
engine runs another number of threads (vLLM's CPU worker binds its own; the references run the machine's,
`conftest.engine_threads`, one thread before 2026-12-02) or another machine's kernels. Two cells whose relevances
differ by less than that rounding can then change places at the budget's edge. Seen on an AMD EPYC (AVX-512) in
bf16 serving: test-000095 at 25 %, cells 91 and 121, relevances 3e-8 apart with one thread and equal with two.
Every other difference is a real one.
"""

from __future__ import annotations

TIE = 1e-5   # relevance is in [0, 1]; a thread count's rounding moved it by 3e-8 where seen


def relevance_rows(trace) -> list[list[float]]:
    """Per image of a Hugging Face trace: its cells' relevance in raster order (the order of `kept_indices`)."""
    out = []
    for i, (h, w) in enumerate(trace.grid_hw):
        out.append(trace.arr_coc.relevance[i, :h, :w].flatten().float().tolist())
    return out


def beyond_ties(ours: list[int], theirs: list[int], relevance: list[float], tol: float = TIE) -> bool:
    """True when `ours` differs from `theirs` (the reference's kept cells, ranked by its `relevance`) by more than
    swapping cells whose relevance lies within `tol` of the reference's weakest kept cell."""
    if ours == theirs:
        return False
    if len(ours) != len(theirs):
        return True
    edge = min(relevance[c] for c in theirs)
    swapped = set(ours) ^ set(theirs)
    return any(abs(relevance[c] - edge) > tol for c in swapped)
