"""Keeping the server's resident memory flat over many requests (glibc malloc tuning).

Gradio runs handlers on a pool of worker threads and glibc gives each thread its own malloc arena,
so resident memory creeps up request after request. Measured on the embedded model, RSS after 105
requests vs. after the first: +19% by default, +10% with 2 arenas, +6% with 2 arenas and
`release_memory()` after each request. Other C libraries have neither call; both are then no-ops.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    """glibc through ctypes, or None (other C libraries have no mallopt/malloc_trim)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_malloc_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas for this process (what MALLOC_ARENA_MAX=n does, set at run time)."""
    libc = _glibc()
    return bool(libc.mallopt(-8, int(n))) if libc is not None else False  # -8: M_ARENA_MAX


def release_memory() -> None:
    """Give the heap's free pages back to the OS (glibc malloc_trim) after a request."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
