"""Command line: `python -m arr_coc <command> ...`. argparse only; the library never imports this package.
The ShapesVQA test bed's commands (`gen-data`, `train-vlm`, `train-adapter` on items drawn on the fly) are
`python -m arr_coc_shapes <command>`, in the checkout beside the library: `main` serves its table too.

Each command is a module here with `add_arguments(parser)` and `run(args) -> int`; only the module
of the command being run is imported (so `gen-data --help` loads neither torch nor transformers),
and each module imports the library inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "ask": ("arr_coc.cli.ask", "answer one question about one image, baseline or pruned"),
    "convert": ("arr_coc.cli.convert", "convert GQA, TextVQA, VQAv2, POPE, RefCOCO or COCO files to JSONL"),
    "train": ("arr_coc.cli.train", "train ARR-COC's scorers against a frozen VLM (stage 1 or 2)"),
    "train-saccade": ("arr_coc.cli.train_saccade", "train the saccade gate (when to look again) against the frozen VLM"),
    "train-adapter": ("arr_coc.cli.train_adapter", "train LoRA adapters so the frozen VLM reads what ARR-COC keeps"),
    "eval": ("arr_coc.cli.eval", "accuracy vs. visual-token budget: ARR-COC beside the anchor methods"),
    "bench": ("arr_coc.cli.bench", "whole-prefill cost (vision tower, ARR-COC, LM) per encode mode and budget at real widths"),
}


def _command_of(argv: list[str]) -> str | None:
    """The first argument that is not an option: the command (argparse validates it)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None, commands: dict[str, tuple[str, str]] | None = None,
         prog: str = "python -m arr_coc", description: str | None = None) -> int:
    """Run one command of `commands` (default: the library's COMMANDS) -> its exit status."""
    # Quiet defaults that change no result. HF_HUB_OFFLINE is not among them: a hub id given to
    # --model is downloaded as usual, and the embedded model is a local folder that never asks.
    for key, value in (("HF_HUB_DISABLE_TELEMETRY", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="command")
    chosen = _command_of(argv)
    module = None
    for name, (module_name, help_text) in (COMMANDS if commands is None else commands).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None or module is None:
        parser.print_help()
        return 2
    if args.command not in ("gen-data", "convert"):   # the commands that run models
        from arr_coc.runtime import keep_large_buffers

        keep_large_buffers()
    return int(module.run(args) or 0)
