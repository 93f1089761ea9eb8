"""What the user sends, checked by the library's one validator (`arr_coc.validation`), so the page, the API,
the command line and `ARRCOC.generate` give the same verdict in the same words. This module only adds
what is the app's own: uploads the Image component could not hand over (`Unreadable`), None meaning the
default budget, and the names the handler uses. Every refusal is an `InputError` whose message the page
shows as it is; it never holds a server path (uploads are named "the uploaded file").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arr_coc.errors import InputError  # noqa: F401 (re-exported)
from arr_coc.validation.images import ImageInfo, OpenedImage  # noqa: F401 (re-exported)
from arr_coc.validation.limits import FORMATS, LIMITS, InputLimits  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from arr_coc.budget import Budget

MAX_QUESTION_CHARS = LIMITS.max_question_chars
MAX_DECODE_PIXELS = LIMITS.max_decode_pixels
MAX_INPUT_PIXELS = LIMITS.max_image_pixels
MAX_ASPECT = LIMITS.max_aspect


class Unreadable(str):
    """Marker for an upload the Image component itself could not hand over: the reason, or (`Refused`) the
    whole message."""


class Refused(Unreadable):
    """An upload the app refuses before reading it (a URL, a path it was not given); the text is the message."""


def reason(exc: BaseException) -> str:
    """'Type: first line of the message' (or the type alone): short enough for the page."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_question(question: Any, limits: InputLimits = LIMITS) -> tuple[str, list[str]]:
    from arr_coc.validation.requests import check_question as check

    return check(question, limits)


def read_budget(value: Any) -> Budget:
    """The budget as the slider or an API client sent it -> a share (float) or a token count (int); None (not
    given) is the library's default. Read by `arr_coc.budget.parse_budget` as sent over JSON (`wire`), so a
    whole number means what it means on the command line: 64 a count, 1 ambiguous (the page's slider sends
    its maximum as "1.0")."""
    from arr_coc.budget import DEFAULT_BUDGET
    from arr_coc.validation.requests import read_budget as read

    return read(value, DEFAULT_BUDGET, wire=True)


def check_method(method: Any) -> str:
    from arr_coc.pipeline.request import check_method as check

    return check(method)


def open_upload(value: Any, limits: InputLimits = LIMITS) -> OpenedImage:
    """The upload opened and its header checked (not decoded: the handler admits it by its pixels first)."""
    from arr_coc.validation.images import open_image

    if isinstance(value, Refused):
        raise InputError(str(value), "image_refused")
    if isinstance(value, Unreadable):
        raise InputError(f"Could not read the file as an image ({value}). Give a {FORMATS} file.", "image_unreadable")
    return open_image(value, limits)


def read_flag(value: Any, name: str, default: bool) -> bool:
    """A checkbox as the page or an API client sent it: a bool, 0/1, "true"/"false"; None is the default."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise InputError(f"{name} must be true or false, not {str(value)[:40]!r}.", "flag")
