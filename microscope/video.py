"""Deprecated (one release): a clip is a request like any other; `microscope.handler.ask(..., video=clip)` answers
it. `ask_video` is that call with the previous release's argument order."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from microscope.handler import Microscope, Result


def ask_video(scope: Microscope, video: Any, question: Any, arr_on: Any = True, budget: Any = None,
              method: Any = "arr_coc", choices: tuple = ()) -> Result:
    """`handler.ask(scope, None, question, arr_on, budget, False, method, *choices, video=video)`."""
    from microscope import handler

    warnings.warn("microscope.video.ask_video is deprecated: call microscope.handler.ask(..., video=clip)",
                  DeprecationWarning, stacklevel=2)
    names = ("encode", "layer", "compare_layer", "compare_encode", "gist", "margin", "periphery", "looks", "threshold")
    return handler.ask(scope, None, question, arr_on, budget, False, method, video=video,
                       **dict(zip(names, choices)))


__all__ = ["ask_video"]
