"""The ShapesVQA test bed's commands: `python -m arr_coc_shapes <command> ...`, run from the checkout.

The library's command line (`arr_coc.cli.main`) serves this table; each command is a module with
`add_arguments(parser)` and `run(args) -> int`, imported only when it runs.
"""

from __future__ import annotations

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "gen-data": ("arr_coc_shapes.cli.gen_data", "generate a ShapesVQA split (PNGs + JSONL)"),
    "train-vlm": ("arr_coc_shapes.cli.train_vlm", "train the embedded Qwen2-VL-architecture model on ShapesVQA"),
    "train-adapter": ("arr_coc_shapes.cli.train_adapter",
                      "train-adapter on ShapesVQA items drawn on the fly (the embedded model's adapters)"),
}


def main(argv: list[str] | None = None) -> int:
    from arr_coc.cli import main as serve

    return serve(argv, COMMANDS, prog="python -m arr_coc_shapes", description=__doc__.splitlines()[0])
