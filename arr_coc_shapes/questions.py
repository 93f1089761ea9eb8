"""Questions about a scene, with the ground truth always derived from the scene (``ask``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .scene import Scene
from .seeding import choice
from .vocabulary import COLOR_NAMES, QUESTION_TYPES, SHAPES, TEMPLATES, Box


@dataclass(frozen=True)
class Question:
    """A question about a scene with its ground truth derived from the scene."""

    type: str
    text: str
    answers: tuple[str, ...]
    boxes: tuple[Box, ...]  # answer-relevant objects (spec: "boxes")
    color: str | None = None  # attributes named in the question
    shape: str | None = None


def ask(scene: Scene, qtype: str, color: str | None = None, shape: str | None = None) -> Question | None:
    """The question of type ``qtype`` about ``color``/``shape`` with its answer.

    Returns None when the question is not valid for this scene: the referred
    object is missing or not unique (color, shape, letter), it carries no
    letter (letter), or the count exceeds 9 (count).
    """
    objs = scene.objects
    if qtype == "color":
        hits = [o for o in objs if o.shape == shape]
        if len(hits) != 1:
            return None
        return Question(qtype, TEMPLATES[qtype].format(shape=shape), (hits[0].color,), (hits[0].box,), None, shape)
    if qtype == "shape":
        hits = [o for o in objs if o.color == color]
        if len(hits) != 1:
            return None
        return Question(qtype, TEMPLATES[qtype].format(color=color), (hits[0].shape,), (hits[0].box,), color, None)
    if qtype == "letter":
        hits = [o for o in objs if o.color == color and o.shape == shape]
        if len(hits) != 1 or hits[0].letter is None:
            return None
        text = TEMPLATES[qtype].format(color=color, shape=shape)
        return Question(qtype, text, (hits[0].letter.lower(),), (hits[0].box,), color, shape)
    if qtype == "exists":
        hits = [o for o in objs if o.color == color and o.shape == shape]
        text = TEMPLATES[qtype].format(color=color, shape=shape)
        return Question(qtype, text, ("yes" if hits else "no",), tuple(o.box for o in hits), color, shape)
    if qtype == "count":
        hits = [o for o in objs if o.shape == shape]
        if len(hits) > 9:
            return None
        text = TEMPLATES[qtype].format(shape=shape)
        return Question(qtype, text, (str(len(hits)),), tuple(o.box for o in hits), None, shape)
    raise ValueError(f"unknown question type {qtype!r}; expected one of {QUESTION_TYPES}")


def _candidates(scene: Scene) -> dict[str, list[Question]]:
    """Every valid question per type (exists split into yes / no)."""
    out: dict[str, list[Question]] = {t: [] for t in QUESTION_TYPES}
    out["exists_no"] = []
    pairs = {(o.color, o.shape) for o in scene.objects}
    for shape in SHAPES:
        for qtype in ("color", "count"):
            if (q := ask(scene, qtype, shape=shape)) is not None:
                out[qtype].append(q)
    for color in COLOR_NAMES:
        if (q := ask(scene, "shape", color=color)) is not None:
            out["shape"].append(q)
        for shape in SHAPES:
            if (color, shape) in pairs and (q := ask(scene, "letter", color, shape)) is not None:
                out["letter"].append(q)
            q = ask(scene, "exists", color, shape)
            out["exists" if (color, shape) in pairs else "exists_no"].append(q)  # type: ignore[arg-type]
    return out


def questions_for_scene(scene: Scene, rng: np.random.Generator, n: int = 1) -> list[Question]:
    """Up to ``n`` distinct valid questions about ``scene``.

    Each question's type is drawn uniformly among the types that still have
    candidates; exists questions are yes/no 50/50 when both exist; within a
    type the candidate is uniform. Fewer than ``n`` come back only when the
    scene has fewer valid questions.
    """
    pools = _candidates(scene)
    chosen: list[Question] = []
    while len(chosen) < n:
        types = [t for t in QUESTION_TYPES if pools[t] or (t == "exists" and pools["exists_no"])]
        if not types:
            break
        qtype = choice(rng, types)
        key = qtype
        if qtype == "exists":
            options = [k for k in ("exists", "exists_no") if pools[k]]
            key = choice(rng, options)
        chosen.append(pools[key].pop(int(rng.integers(len(pools[key])))))
    return chosen
