"""Notes for an answer a user may not expect (an empty one) and why it may be empty: what the CLI and the app say
after the model answered. The inputs themselves are checked by `arr_coc.validation`."""

from __future__ import annotations

import unicodedata
from typing import Any


def _foreign(question: str) -> bool:
    """True when the question leans on characters outside Latin scripts: emoji, symbols, CJK, Cyrillic, ..."""
    letters = [c for c in question if c.isalpha() or unicodedata.category(c) in ("So", "Sk")]
    if not letters:
        return bool(question.strip()) and any(unicodedata.category(c) in ("So", "Sk", "Cs") for c in question)
    foreign = [c for c in letters if ord(c) > 0x24F]
    return len(foreign) * 2 >= len(letters)


def answer_notes(answer: Any, question: str, tokenizer: Any = None) -> list[str]:
    """Notes for an answer the user may not expect: an empty one, and why it may be empty."""
    return empty_answer_notes({"": answer}, question, tokenizer)


def empty_answer_notes(answers: dict[str, Any], question: str, tokenizer: Any = None) -> list[str]:
    """One note when any of `answers` (run name -> answer; "" for a caller with one run) is empty, naming the
    empty ones ("for the baseline and config B"), and why it may be: characters this model does not read only
    when the question really has them (emoji, a non-Latin script); words its tokenizer does not know (a small
    vocabulary, as the embedded model's) otherwise; else nothing known."""
    empty = [name for name, answer in answers.items() if not _text(answer).strip()]
    if not empty:
        return []
    named = [n for n in empty if n]
    where = f" for {' and '.join([', '.join(named[:-1]), named[-1]] if len(named) > 2 else named)}" if named else ""
    if _foreign(question):
        return [f"The model gave an empty answer{where}. Most of the question is in characters this model does not "
                "read (emoji or a non-Latin script): ask in English words."]
    if _unknown_share(question, tokenizer) >= 0.5:
        return [f"The model gave an empty answer{where}. Most of the question is words this model does not know "
                "(its vocabulary is small): ask with plain words, e.g. \"What color is the circle?\""]
    return [f"The model gave an empty answer{where}. Try asking the question another way."]


def _text(answer: Any) -> str:
    return answer if isinstance(answer, str) else " ".join(map(str, answer)) if isinstance(answer, list) else str(answer)


def _unknown_share(question: str, tokenizer: Any) -> float:
    """The share of the question's tokens the tokenizer reads as unknown (0 when it has no unknown token)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return 0.0
    try:
        ids = tokenizer(question, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    except Exception:  # noqa: BLE001 - a note is never worth a failure
        return 0.0
    return sum(1 for t in ids if t == unk) / max(1, len(ids))


__all__ = ["answer_notes", "empty_answer_notes"]
