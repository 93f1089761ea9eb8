"""Planning an item's question first: its type's attributes and a uniformly drawn answer, and the
objects the scene then needs (``Req``) and may not contain (``Plan.forbid_*``) for the answer to hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .seeding import choice
from .vocabulary import (
    BRIGHT_COLORS, COLOR_NAMES, LETTERED_SHAPES, LETTERS, LOW_CONTRAST_COLORS, MAX_SIDE, MIN_LETTER_SIDE,
    MIN_OBJECTS, MIN_SIDE, QUESTION_TYPES, SHAPES,
)


@dataclass(frozen=True)
class Req:
    """An object the planned question needs in the scene."""

    shape: str
    color: str
    letter: str | None = None
    auto_letter: bool = True  # draw a random letter (P_LETTER) when eligible
    side: tuple[int, int] = (MIN_SIDE, MAX_SIDE)  # inclusive range, longer side
    at_border: bool = False
    beside: int | None = None  # index of an earlier Req to touch (or nearly)


@dataclass(frozen=True)
class Plan:
    qtype: str
    color: str | None
    shape: str | None
    answer: str
    required: tuple[Req, ...]
    # Distractors may not have this shape / colour / (colour, shape) pair, which
    # is what keeps the referred object unique and the answer true.
    forbid_shape: str | None = None
    forbid_color: str | None = None
    forbid_pair: tuple[str, str] | None = None
    min_objects: int = MIN_OBJECTS


def plan_question(rng: np.random.Generator, qtype: str, hard: str | None) -> Plan:
    """Pick the question's attributes and answer uniformly; list what the scene needs."""
    # Void scenes are sparse and small so that most of the canvas is empty.
    side = (MIN_SIDE, 32) if hard == "void" else (MIN_SIDE, MAX_SIDE)
    letter_side = (MIN_LETTER_SIDE, max(MIN_LETTER_SIDE, side[1]))
    border = hard == "border"
    if qtype == "color":
        shape, color = choice(rng, SHAPES), choice(rng, COLOR_NAMES)
        return Plan(qtype, None, shape, color, (Req(shape, color, side=side, at_border=border),), forbid_shape=shape)
    if qtype == "shape":
        color, shape = choice(rng, COLOR_NAMES), choice(rng, SHAPES)
        return Plan(qtype, color, None, shape, (Req(shape, color, side=side, at_border=border),), forbid_color=color)
    if qtype == "letter":
        letter = choice(rng, LETTERS)
        shape = choice(rng, LETTERED_SHAPES)
        if hard == "low_contrast":
            color = choice(rng, LOW_CONTRAST_COLORS)
            target = Req(shape, color, letter, auto_letter=False, side=(MIN_LETTER_SIDE, 34))
            bright_shape = choice(rng, SHAPES)
            # The distractor often carries its own, high-contrast letter.
            bright_letter = None
            if bright_shape in LETTERED_SHAPES and rng.random() < 0.7:
                bright_letter = choice(rng, [c for c in LETTERS if c != letter])
            bright = Req(
                bright_shape,
                choice(rng, [c for c in BRIGHT_COLORS if c != color]),
                bright_letter,
                auto_letter=False,
                side=(52, MAX_SIDE),
                beside=0,
            )
            required: tuple[Req, ...] = (target, bright)
        else:
            color = choice(rng, COLOR_NAMES)
            required = (Req(shape, color, letter, auto_letter=False, side=letter_side, at_border=border),)
        return Plan(qtype, color, shape, letter.lower(), required, forbid_pair=(color, shape))
    if qtype == "exists":
        color, shape = choice(rng, COLOR_NAMES), choice(rng, SHAPES)
        present = bool(rng.random() < 0.5)
        reqs: list[Req] = []
        if present:
            reqs += [Req(shape, color, side=side, at_border=border)] * (2 if rng.random() < 0.2 else 1)
        # Near misses (same colour other shape, same shape other colour) so the
        # answer needs both attributes of one object, not either alone.
        if rng.random() < 0.6:
            reqs.append(Req(choice(rng, [s for s in SHAPES if s != shape]), color, side=side))
        if rng.random() < 0.6:
            reqs.append(Req(shape, choice(rng, [c for c in COLOR_NAMES if c != color]), side=side))
        if border and not present:
            reqs = [r if i else Req(r.shape, r.color, side=side, at_border=True) for i, r in enumerate(reqs)]
        return Plan(qtype, color, shape, "yes" if present else "no", tuple(reqs), forbid_pair=(color, shape))
    if qtype == "count":
        shape, k = choice(rng, SHAPES), int(rng.integers(0, 10))
        reqs = [Req(shape, choice(rng, COLOR_NAMES), side=side, at_border=border and i == 0) for i in range(k)]
        return Plan(qtype, None, shape, str(k), tuple(reqs), forbid_shape=shape, min_objects=k + 2)
    raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")


def random_plan(rng: np.random.Generator, hard: str | None) -> Plan:
    """No question: an unconstrained scene (used by ``generate_scene``)."""
    reqs: tuple[Req, ...] = ()
    if hard == "low_contrast":
        return plan_question(rng, "letter", hard)
    if hard == "border":
        reqs = (Req(choice(rng, SHAPES), choice(rng, COLOR_NAMES), at_border=True),)
    return Plan("none", None, None, "", reqs)
