"""ARR-COC inside Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the wrapper and the pieces it is made of.

wrapper.py    ARRCOCQwen: vision tower once, select, rewrite, prefill / generate
rewrite.py    the pure input rewrite (spans, per-image budgets, kept-index checks, PrunedInputs)
selecting.py  running a selector with per-item fallback
trace.py      Trace (what happened to one item), PrefillOutput
loading.py    checkpoints (hub id or folder) and the ARR-COC layer that goes with them
processing.py chat prompts (questions tokenized as plain text), the image-only processor, un-patchify
tiny.py       tiny random models of the three families, for tests
"""

from .loading import MODEL_CLASSES, HubUnreachable
from .rewrite import PrunedInputs
from .selecting import SelectorFailed
from .trace import PrefillOutput, Trace
from .wrapper import ARRCOCQwen

__all__ = ["ARRCOCQwen", "HubUnreachable", "MODEL_CLASSES", "PrefillOutput", "PrunedInputs", "SelectorFailed",
           "Trace"]
