"""What comes with the pictures: the question (`check_question`), the answer's length (`check_max_new_tokens`),
the budget as a user typed it (`read_budget`), and a whole request's visuals and questions at once
(`check_items`, the library's entry check). The method and the encoding are checked beside the method registry,
in `arr_coc.pipeline.request`."""

from __future__ import annotations

import numbers
import os
import unicodedata
from typing import Any, Mapping

from ..budget import Budget, BudgetError, parse_budget
from ..errors import InputError
from .clips import check_clip
from .images import check_image
from .limits import LIMITS, InputLimits


def check_question(question: Any, limits: InputLimits = LIMITS) -> tuple[str, list[str]]:
    """A question -> (the text to ask, notes). Control characters (NUL, ...) are removed, with a note;
    blank or over-long questions are refused, and so is anything that is not text (a list or a dict an API
    client sent used to be turned into its repr and answered). A `Conversation` (several turns) is asked as it is:
    its last user turn is checked as a question."""
    from ..conversation import Conversation

    if isinstance(question, Conversation):
        check_question(question.question, limits)
        return question, []
    if question is not None and not isinstance(question, str):
        raise InputError(f"The question must be text, not a {type(question).__name__}: send one question as a "
                         "string, e.g. \"What color is the circle?\"", "question_not_text")
    text = "" if question is None else question
    kept = "".join(c for c in text if c in "\t\n\r" or unicodedata.category(c) != "Cc")
    notes = []
    if len(kept) != len(text):
        n = len(text) - len(kept)
        notes.append(f"Removed {n} control character{'s' if n > 1 else ''} (such as NUL) from the question.")
    kept = kept.strip()
    if not kept:
        raise InputError("The question is empty: type a question about the image, e.g. \"What color is the circle?\"",
                         "question_empty")
    if len(kept) > limits.max_question_chars:
        raise InputError(f"The question is {len(kept):,} characters long; the limit is {limits.max_question_chars:,}. "
                         "Ask one short question about the image.", "question_too_long")
    return kept, notes


def check_max_new_tokens(value: Any) -> int:
    """The answer's length limit: a whole number of tokens, at least 1. Refused here, in the validator's words,
    rather than by transformers halfway through a request (its ValueError was a traceback on the command line)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"max_new_tokens={value!r} is not an answer length: give a whole number of tokens of at "
                         "least 1 (--max-new-tokens 32)", "max_new_tokens")
    return int(value)



def read_budget(value: Any, default: Budget | None = None, limits: InputLimits = LIMITS,
                wire: bool = False) -> Budget | None:
    """A budget as a user typed it (0.25, "10%", 64, "64tok"), read by `arr_coc.budget.parse_budget`;
    None (not given) is `default`. A refusal carries the budget parser's own message ("" is not a budget,
    as on the command line and in `generate`). wire=True: it came over JSON (the app's API), where a whole
    number is read as the text it was, so 1 is as ambiguous as "1" on the command line (`parse_budget`)."""
    if value is None:
        return default
    try:
        budget = parse_budget(value, wire=wire)
    except BudgetError as exc:
        raise InputError(str(exc), "budget") from None
    if isinstance(budget, int) and budget > limits.max_budget_count:
        raise InputError(f"budget={budget} as a token count is more than any image has (limit "
                         f"{limits.max_budget_count:,}); write a share like 0.1, 1.0 or 10%, or a smaller count",
                         "budget")
    return budget


def check_items(images: list[list[Any]], questions: list[Any], limits: InputLimits = LIMITS,
                sampling: Mapping[str, Any] | None = None) -> tuple[list[list[Any]], list[str], list[list[str]]]:
    """The library's entry check (`ARRCOC.generate`): per question its visuals, checked and normalised,
    and the question text -> (visuals, questions, notes per question). Images are PIL images, file paths or
    bytes; arrays and tensors pass through unchanged (the processor reads them as it always did). Videos are
    `arr_coc.video.Clip`s or paths with a video extension (`generate("clip.mp4", q)`), checked by `check_clip`
    with `sampling` (`arr_coc.qwen.processing.video_sampling(processor)`: the model's own rule) and returned
    as Clips, in place."""
    from ..video.clip import Clip
    from ..video.animation import animated_notes
    from ..video.reading import is_clip_path

    out_images, out_questions, notes = [], [], []
    for ims, q in zip(images, questions):
        text, q_notes = check_question(q, limits)
        checked = []
        for im in ims:
            if isinstance(im, Clip) or is_clip_path(im):
                checked.append(check_clip(im, limits, name=os.fspath(im) if not isinstance(im, Clip) else None,
                                          sampling=sampling))
                if not isinstance(im, Clip):
                    q_notes.extend(animated_notes(im))
                continue
            if type(im).__module__.startswith(("torch", "numpy")):
                checked.append(im)   # an array: the processor's business
                continue
            picture, info = check_image(im, limits, name=os.fspath(im) if isinstance(im, (str, os.PathLike)) else None)
            checked.append(picture)
            q_notes += info.notes
        out_images.append(checked)
        out_questions.append(text)
        notes.append(q_notes)
    return out_images, out_questions, notes

