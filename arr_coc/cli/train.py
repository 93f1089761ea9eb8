"""Placeholder: dispatches to the module not yet split."""
from arr_coc.train import add_arguments, run  # noqa: F401
