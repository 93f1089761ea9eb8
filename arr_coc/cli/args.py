"""argparse types and options shared by the commands: each wraps the library's one owner of the concept."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from arr_coc.runtime import add_arguments as add_runtime  # noqa: F401 - the commands' --device/--dtype
from arr_coc.runtime import add_fast_argument as add_fast  # noqa: F401 - their --fast


def budget_arg(text: str):
    """argparse type for one budget: `arr_coc.budget.parse_budget`, its message as argparse's error."""
    from arr_coc.budget import BudgetError, parse_budget

    try:
        return parse_budget(text)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def budgets_arg(text: str):
    """argparse type for a comma list of budgets: `arr_coc.budget.parse_budgets`."""
    from arr_coc.budget import BudgetError, parse_budgets

    try:
        return parse_budgets(text)
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_budget_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget-mode", choices=("exact", "mean", "adaptive"), default=None,
                        help="how ARR-COC meets the budget: exact (every image keeps it), mean (a trained layer lets "
                             "it follow the question, at most the budget on average), adaptive (the layer picks); "
                             "default: the layer's own")


def add_encode(parser: argparse.ArgumentParser) -> None:
    """--encode after|before and the before mode's gist, margin, periphery and whole windows."""
    parser.add_argument("--encode", choices=("after", "before"), default="after",
                        help="after: the vision tower encodes every patch, then ARR-COC selects (default); before: a "
                             "gist of the image, select, then the tower encodes only the chosen cells")
    parser.add_argument("--gist", type=float, default=0.0,
                        help="--encode before: the gist's share of the image's tokens, e.g. 0.25 (default 0: no gist; "
                             "the selector reads the texture array and the question)")
    parser.add_argument("--margin", type=int, default=0,
                        help="--encode before: rings of context cells encoded around the chosen ones, not passed to "
                             "the language model (default 0)")
    parser.add_argument("--periphery", action="store_true",
                        help="--encode before: the language model also reads the gist tokens of the regions not "
                             "encoded at full resolution")
    parser.add_argument("--whole-windows", action="store_true",
                        help="--encode before, Qwen2.5-VL only: encode every vision attention window that holds a "
                             "chosen cell whole (its window layers are then exact); the window's other cells are "
                             "context, not passed to the language model (with --margin: the union)")
    parser.add_argument("--passes", type=int, default=1,
                        help="--encode before: looks per item (default 1). With 2+, an item whose first answer token "
                             "is uncertain looks again: more cells, encoded and read, and the LM answers again")
    parser.add_argument("--saccade-gate", default=None, metavar="PATH",
                        help="--passes 2+: a trained gate (gate.json from `train-saccade`: threshold, sharpness, "
                             "signal, target, budget); the --saccade-* options below override its fields")
    parser.add_argument("--saccade-budget", type=budget_arg, default=None,
                        help="--passes 2+: cells each saccade adds per image, a share (0.03) or a count (12tok)")
    parser.add_argument("--saccade-target", choices=("next", "ring", "grow"), default=None,
                        help="--passes 2+: next = the most relevant cells not yet encoded; ring = the kept cells' neighbours first; "
                             "grow = the selector's choice at the first budget plus the saccade's")
    parser.add_argument("--saccade-signal", choices=("margin", "entropy"), default=None,
                        help="--passes 2+: the first answer token's uncertainty the gate reads")
    parser.add_argument("--saccade-threshold", type=float, default=None,
                        help="--passes 2+: look again when the uncertainty is above it")


def saccade_options(args: argparse.Namespace) -> dict:
    """The --passes / --saccade-* options as SaccadeConfig's fields (a gate file's first, the options over them)."""
    from arr_coc.saccade import read_gate

    fields = read_gate(args.saccade_gate) if getattr(args, "saccade_gate", None) else {}
    fields["passes"] = getattr(args, "passes", 1)
    for name in ("budget", "target", "signal", "threshold"):
        value = getattr(args, f"saccade_{name}", None)
        if value is not None:
            fields[name] = value
    return fields


def encode_options(args: argparse.Namespace) -> dict:
    """The --encode options as EncodeConfig's fields, for the validator (`arr_coc.pipeline.request.check_encode`)."""
    return {"mode": args.encode, "gist": args.gist, "margin": args.margin, "periphery": args.periphery,
            "windows": args.whole_windows, "saccade": saccade_options(args)}


def encode_config(args: argparse.Namespace, method: str | None = None):
    """The EncodeConfig the --encode options describe, checked by the library's validator for `method`
    (`arr_coc.pipeline.request.check_encode`); a bad combination exits 2 with one line, like argparse's errors."""
    from arr_coc.errors import InputError
    from arr_coc.pipeline.request import check_encode

    try:
        return check_encode(method, encode_options(args))
    except (InputError, ValueError) as exc:     # ValueError: a --saccade-gate file that is not one
        fail(args, str(exc))


def fail(args: argparse.Namespace, message: str) -> NoReturn:
    """An argument the validator refused: one line on stderr, as argparse words its own errors, and exit 2."""
    command = getattr(args, "command", None)
    print(f"python -m arr_coc{' ' + command if command else ''}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def runtime(args: argparse.Namespace):
    """The `Runtime` the --device/--dtype/--attn-implementation options describe (argparse-style exit if wrong)."""
    from arr_coc.runtime import Runtime, RuntimeChoiceError

    try:
        return Runtime.resolve(args.device, args.dtype, args.attn_implementation)
    except RuntimeChoiceError as exc:
        raise SystemExit(f"error: {exc}") from None
