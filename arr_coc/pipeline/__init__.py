"""The one pruning pipeline: every entry point of the project runs a request through it, over a VLM backend.

    request      Pruning.of(method, budget, budget_mode, encode): read once, typed      request.py
      │          the one validator on the visuals and the question               arr_coc.validation
      ▼
    prompt       backend.read_prompt: visual units (images, a clip's temporal groups),  prompt.py, backend.py
      │          their grids and rows; encode="after": the tower on every cell
      ▼
    choose       any selector on a typed context (`SelectionContext`), per-item          selection.py, choose.py
      │          fallback; encode="before": on a gist or the texture alone
      ▼
    encode       encode="before": the tower on the chosen cells (+ context) only           fovea.py
      ▼
    rewrite      backend.rewrite: the kept tokens at their original positions           backend.py
      ▼
    prefill ─ decode   backend.decode (one look), or look again where one was not enough  answer.py, looks.py
      ▼
    trace        what happened to each item                                             trace.py

`look.prepare` is one look (choose, encode, rewrite); `answer` decides how many looks and decodes; `respond`
validates and answers. A backend (`backend.VLMBackend`) is everything model-specific; `arr_coc.qwen.QwenBackend`
is the first one.
"""

from .answer import Answered, Response, answer, respond
from .backend import PrunedPrompt, UnitPixels, VLMBackend
from .choose import SelectorFailed
from .look import Prepared, prepare
from .prompt import IMAGE, VIDEO, Prompt
from .request import Pruning
from .selection import (METHODS, Method, Selection, SelectionContext, Selector, available_methods,
                        choose_before_encoding, get_selector, handles_video, register_selector)
from .trace import Look, Trace

__all__ = ["Answered", "IMAGE", "Look", "METHODS", "Method", "Prepared", "Prompt", "PrunedPrompt", "Pruning",
           "Response", "Selection", "SelectionContext", "Selector", "SelectorFailed", "Trace", "UnitPixels", "VIDEO",
           "VLMBackend", "answer", "available_methods", "choose_before_encoding", "get_selector", "handles_video",
           "prepare", "register_selector", "respond"]
