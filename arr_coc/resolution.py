"""What a merged cell became on its way to the language model, coarsest first (`Trace.resolution` gives the level
of every cell; `viz.resolution_picture` and the microscope draw them). A cell takes the finest level that applies."""

from __future__ import annotations

NOT_ENCODED, GIST_ONLY, PERIPHERY, UNREAD, FOVEAL = range(5)
RESOLUTION_LEVELS = (
    "not encoded",                       # before mode without a gist: the tower never saw it
    "gist only (selector)",              # before mode: seen coarsely by the selector, not read by the LM
    "periphery (gist token, read)",      # before mode: inside a gist region whose coarse token the LM reads
    "full resolution, not read",         # context (before mode: margin, whole windows); every pruned cell (after)
    "full resolution, read",             # the chosen (foveal) cells: encoded at full resolution, read by the LM
)

__all__ = ["FOVEAL", "GIST_ONLY", "NOT_ENCODED", "PERIPHERY", "RESOLUTION_LEVELS", "UNREAD"]
