"""Command line: `python -m arr_coc <command> ...`.

Each command lives in its own module with `add_arguments(parser)` and `run(args)`;
this file only dispatches, and imports a command's module when it is used.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command -> (module, one-line help)
COMMANDS = {
    "ask": ("arr_coc.cli_ask", "answer one question about one image, baseline or pruned"),
    "gen-data": ("arr_coc.data.cli", "generate a ShapesVQA split (PNGs + JSONL)"),
    "train": ("arr_coc.train", "train ARR-COC's scorers against a frozen VLM (stage 1 or 2)"),
    "train-vlm": ("arr_coc.train_vlm", "train the embedded Qwen2-VL-architecture model on ShapesVQA"),
    "eval": ("arr_coc.eval", "accuracy vs. visual-token budget: ARR-COC beside the anchor methods"),
    "bench": ("arr_coc.bench", "prefill cost per budget on a Qwen2-VL-2B-shaped model (random weights)"),
}


def _offline_defaults() -> None:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> int:
    _offline_defaults()
    parser = argparse.ArgumentParser(prog="python -m arr_coc", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="command")
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        modules[name] = importlib.import_module(module)
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
