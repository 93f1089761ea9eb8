"""``python -m arr_coc_shapes train-adapter``: the library's train-adapter (`arr_coc.cli.train_adapter`) with
ShapesVQA items drawn on the fly when no --data is given: how the embedded model's adapters are trained.

    python -m arr_coc_shapes train-adapter --out runs/adapter                          # stage 2a: the layer frozen
    python -m arr_coc_shapes train-adapter --stage joint --init-adapter runs/adapter --out runs/joint   # 2b
    python -m arr_coc_shapes train-adapter --stage joint --init-adapter runs/joint --arr-coc runs/joint --hard  # 3
"""

from __future__ import annotations

import argparse

from arr_coc.cli.train_adapter import add_arguments  # noqa: F401  (the same options)


def run(args: argparse.Namespace) -> int:
    from arr_coc.cli.train_adapter import run as train_adapter

    from ..adapter_items import ShapesSource

    return train_adapter(args, items=ShapesSource(), prog="python -m arr_coc_shapes train-adapter")
