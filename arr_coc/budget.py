"""The visual-token budget: one type, one parser, one default, one rule for counting.

How a budget is written, everywhere (Python API, `ask`, `eval`, `train`, `bench`, the app):

- a **share** of an image's visual tokens in (0, 1]: a Python float (`0.1`, `1.0`), or a string
  with a decimal point or a percent sign (`"0.1"`, `"1.0"`, `"10%"`);
- a **count** of visual tokens in [1, MAX_COUNT]: a Python int (`64`), or a whole number in a string
  (`"64"`), optionally followed by `tok` (`"64tok"`).

The string `"1"` is refused as ambiguous (every token, or one token?): write `1.0` / `100%` for
every token, `1tok` for one. A count larger than an image's tokens keeps them all; a share keeps
round-half-up(share * n) tokens, at least one. Strings are plain ASCII numbers: `"1_0"`, `"١٠"` or
`"６４"` (which Python's own float() and int() read) are refused.

Over JSON (the app's API, `wire=True`) 1 and 1.0 are the same number, and a browser sends 1.0 as 1:
a whole number there is read as the text it was written as, like a command-line argument (`64` a
count, `1` ambiguous); the page's slider sends its maximum as `"1.0"`.

How a budget is met (`BudgetMode`), chosen per call:

- `"exact"`: every image keeps exactly its budget;
- `"mean"`: a trained layer scales each image's budget by how many cells its relevance points
  at (calibrated on its training data to average 1 and capped), so the budget holds **at most,
  on average** over data like its training data, not per image. Only a layer whose config has a
  calibrated spread (`attending.spread_tau > 0`) can do this;
- `"adaptive"`: the ARR-COC layer ignores the budget and picks each image's count from how spread
  out its relevance is, between `attending.min_ratio` and `max_ratio` of the tokens;
- `None`: the layer's own default (`"mean"` for such a trained layer, `"exact"` otherwise; an
  image given no budget at all gets the layer's configured budget, or adaptive when the layer's
  config says `mode="adaptive"`).

Selectors other than ARR-COC always keep exact budgets.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Literal, Sequence, Union

Budget = Union[int, float]
# One budget for all images; or one entry per question: a budget, or a list with one per image.
BudgetSpec = Union[Budget, Sequence[Union[Budget, Sequence[Budget], None]], None]
BudgetMode = Literal["exact", "mean", "adaptive"]

BUDGET_MODES: tuple[str, ...] = ("exact", "mean", "adaptive")
DEFAULT_BUDGET: float = 0.25
MAX_COUNT: int = 1_000_000           # more visual tokens than any image has (Qwen-VL: 16,384 at most)
HOW_TO_WRITE = "write a share like 0.1, 1.0 or 10%, or a token count like 64 (or 64tok)"

_COUNT = re.compile(r"^(\d+)\s*(tok|tokens?)?$", re.ASCII)
_SHARE = re.compile(r"^(\d+\.?\d*|\.\d+)(e[-+]?\d+)?%?$", re.ASCII)   # 0.1, .5, 1., 10%, 1e-1


class BudgetError(ValueError):
    """A budget that is not a share in (0, 1] or a token count >= 1; the message says how to write one."""


def check_budget(budget: object, name: str = "budget") -> Budget:
    """A Python budget as given (int count >= 1 or float share in (0, 1]), checked; else BudgetError."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise BudgetError(f"{name}={budget!r} is not a budget; {HOW_TO_WRITE}")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise BudgetError(f"{name}={budget} as a token count must be >= 1; {HOW_TO_WRITE}")
        if budget > MAX_COUNT:
            raise BudgetError(f"{name}={budget:.3g} as a token count is more than any image has (the limit is "
                              f"{MAX_COUNT:,}); {HOW_TO_WRITE}")
        return int(budget)
    value = float(budget)
    if not math.isfinite(value) or not 0.0 < value <= 1.0:
        raise BudgetError(f"{name}={budget} as a share must lie in (0, 1] (pass an int for a token count); "
                          f"{HOW_TO_WRITE}")
    return value


def parse_budget(value: object, name: str = "budget", wire: bool = False) -> Budget:
    """The one parser: a string as written on a command line or in a form, or a Python number.

    "0.1" / "10%" / "1.0" -> share; "64" / "64tok" -> count; "1" -> BudgetError (ambiguous).
    wire=True: `value` came over JSON, where 1 and 1.0 are one number, so a whole number is read as the
    text it was (1 -> ambiguous, as "1" on the command line; 64 -> a count).
    """
    if wire and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = str(int(value))
    if not isinstance(value, str):
        return check_budget(value, name)
    text = value.strip().lower()
    if len(text) > 32:
        raise BudgetError(f"{name} {value[:20]!r}... ({len(value):,} characters) is not a budget; {HOW_TO_WRITE}")
    if text.startswith("-"):
        raise BudgetError(f"{name} {value!r} is negative; {HOW_TO_WRITE}")
    match = _COUNT.match(text)
    if match:
        if match.group(1) == "1" and not match.group(2):
            raise BudgetError(f"{name} '1' is ambiguous: write 1.0 or 100% to keep every token, "
                              "or 1tok to keep one token")
        return check_budget(int(match.group(1)), name)
    if not _SHARE.match(text):   # float() alone would take "1_0" as 10 and "nan"; say how to write one
        if text in ("nan", "inf", "infinity", "nan%", "inf%"):
            return check_budget(float(text.rstrip("%")), name)
        raise BudgetError(f"{name} {value!r} is not a budget; {HOW_TO_WRITE}")
    share = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    return check_budget(share, name)


def parse_budgets(text: str, name: str = "budgets") -> list[Budget]:
    """'0.05,0.1,64' -> [0.05, 0.1, 64], each through `parse_budget`."""
    out = [parse_budget(part, name) for part in str(text).split(",") if part.strip()]
    if not out:
        raise BudgetError(f"give at least one budget, e.g. 0.1,0.25; {HOW_TO_WRITE}")
    return out


def check_mode(mode: object) -> BudgetMode | None:
    """None (the layer's default), "exact", "mean" or "adaptive"; anything else is a BudgetError."""
    if mode is None or mode in BUDGET_MODES:
        return mode  # type: ignore[return-value]
    raise BudgetError(f"budget mode {mode!r} is not one of {list(BUDGET_MODES)} "
                      "(or None for the layer's default)")


def resolve_count(budget: Budget | None, n_tokens: int) -> int:
    """Tokens to keep out of n_tokens for a budget from anywhere (checked first): shares round half up, counts
    are capped at n_tokens, at least 1. None means DEFAULT_BUDGET."""
    return count_of(check_budget(DEFAULT_BUDGET if budget is None else budget), n_tokens)


def count_of(budget: Budget, n_tokens: int) -> int:
    """`resolve_count` of a budget already read (`parse_budget` / `check_budget`): the pipeline's, the selectors'
    and the allocator's count, with no second check of what the edge read."""
    k = int(math.floor(budget * n_tokens + 0.5)) if isinstance(budget, float) else int(budget)
    return max(1, min(n_tokens, k))


def budget_label(budget: Budget | None) -> str:
    """How a budget is printed in tables and file names: 0.1 -> '0.1', 64 -> '64tok'."""
    if budget is None:
        return "default"
    return f"{budget}tok" if isinstance(budget, int) else f"{budget:g}"
