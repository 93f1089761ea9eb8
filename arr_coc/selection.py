"""Deprecated (one release): selection moved to `arr_coc.pipeline.selection` (and `arr_coc.pipeline`).

    from arr_coc.pipeline import register_selector, Selection, SelectionContext
"""

import warnings

from .pipeline.selection import *  # noqa: F401,F403
from .pipeline.selection import __all__  # noqa: F401

warnings.warn("arr_coc.selection moved to arr_coc.pipeline.selection (import from arr_coc.pipeline)",
              DeprecationWarning, stacklevel=2)
