"""One ShapesVQA item in memory: plan the question, compose the scene, re-derive the answer, render."""

from __future__ import annotations

from typing import Iterator, NamedTuple

from PIL import Image

from .drawing import render_scene
from .layout import compose, draw_canvas, draw_hard
from .plan import plan_question
from .questions import Question, ask
from .scene import Scene
from .seeding import choice, item_rng
from .vocabulary import DEFAULT_CANVAS, DEFAULT_HARD_RATE, P_LETTER, QUESTION_TYPES, Canvas


class Item(NamedTuple):
    """One generated item: ``image, record, scene = make_item(...)``."""

    image: Image.Image
    record: dict
    scene: Scene


def item_id(split: str, index: int) -> str:
    """'test', 123 -> 'test-000123' (also the PNG's stem)."""
    return f"{split}-{index:06d}"


def make_record(question: Question, split: str, index: int, hard: str | None = None) -> dict:
    """The JSONL record (spec keys in spec order, plus "hard" for hard cases)."""
    rid = item_id(split, index)
    record = {
        "id": rid,
        "image": f"images/{rid}.png",
        "question": question.text,
        "answers": list(question.answers),
        "type": question.type,
        "boxes": [list(b) for b in question.boxes],
    }
    if hard is not None:
        record["hard"] = hard
    return record


def make_item(
    seed: int, split: str = "test", index: int = 0, canvas: Canvas = DEFAULT_CANVAS,
    hard_rate: float = DEFAULT_HARD_RATE, letter_rate: float = P_LETTER,
) -> Item:
    """Generate item ``index`` of ``split`` in memory: (PIL image, record, scene).

    Deterministic in (seed, split, index, canvas, hard_rate, letter_rate); nothing is
    written. The question type is uniform over QUESTION_TYPES and its answer uniform
    over the type's answers (exists: yes/no 50/50, count: 0-9). ``letter_rate`` (the
    chance an eligible distractor carries a letter) is for training only: the
    benchmark uses the default.
    """
    rng = item_rng(seed, split, index)
    size = draw_canvas(rng, canvas)
    qtype = choice(rng, QUESTION_TYPES)
    hard = draw_hard(rng, qtype, hard_rate)
    plan = plan_question(rng, qtype, hard)
    scene = compose(rng, size, plan, hard, letter_rate)
    question = ask(scene, plan.qtype, plan.color, plan.shape)
    if question is None or question.answers != (plan.answer,):
        raise RuntimeError(
            f"bug: planned {plan.qtype} answer {plan.answer!r} but the scene gives {question}; "
            f"report seed={seed} split={split!r} index={index}"
        )
    return Item(render_scene(scene), make_record(question, split, index, hard), scene)


def generate_split(
    n: int, seed: int = 0, split: str = "test", canvas: Canvas = DEFAULT_CANVAS,
    hard_rate: float = DEFAULT_HARD_RATE, start: int = 0,
) -> Iterator[Item]:
    """Items ``start .. start + n - 1`` of a split, lazily, in index order."""
    for index in range(start, start + n):
        yield make_item(seed, split, index, canvas, hard_rate)
