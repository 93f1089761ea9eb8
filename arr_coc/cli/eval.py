"""Placeholder: dispatches to the module not yet split."""
from arr_coc.eval import add_arguments, run  # noqa: F401
