"""argparse types and options shared by the commands: each wraps the library's one owner of the concept."""

from __future__ import annotations

import argparse


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
