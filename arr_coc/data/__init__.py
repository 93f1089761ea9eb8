"""Data for ARR-COC: the ShapesVQA generator and the VQA JSONL reader.

ShapesVQA (spec: shared/SHAPESVQA.md) is a procedural, seeded VQA set whose
answers depend on one small region of a cluttered image. Typical use::

    from arr_coc.data import make_item, read_jsonl, score, write_split
    image, record, scene = make_item(seed=0, split="train", index=7)   # in memory
    write_split("data/shapes", split="test", n=2000, seed=0)            # to disk
    for rec in read_jsonl("data/shapes/test.jsonl"):
        score(prediction, rec.answers)
"""

from .jsonl import (
    JSONLFormatError,
    VQARecord,
    iter_jsonl,
    normalize_answer,
    read_jsonl,
    score,
    write_jsonl,
)
from .shapesvqa import (
    CELL_PX,
    COLOR_NAMES,
    COLORS,
    HARD_KINDS,
    LETTERS,
    QUESTION_TYPES,
    SHAPES,
    TEMPLATES,
    CellLabels,
    Item,
    Question,
    Scene,
    SceneObject,
    ask,
    boxes_to_cell_mask,
    boxes_to_cell_shares,
    cell_labels,
    generate_scene,
    generate_split,
    item_rng,
    make_item,
    make_record,
    parse_canvas,
    questions_for_scene,
    render_scene,
    write_split,
)

__all__ = [
    "CELL_PX",
    "COLOR_NAMES",
    "COLORS",
    "HARD_KINDS",
    "LETTERS",
    "QUESTION_TYPES",
    "SHAPES",
    "TEMPLATES",
    "CellLabels",
    "Item",
    "JSONLFormatError",
    "Question",
    "Scene",
    "SceneObject",
    "VQARecord",
    "ask",
    "boxes_to_cell_mask",
    "boxes_to_cell_shares",
    "cell_labels",
    "generate_scene",
    "generate_split",
    "item_rng",
    "iter_jsonl",
    "make_item",
    "make_record",
    "normalize_answer",
    "parse_canvas",
    "questions_for_scene",
    "read_jsonl",
    "render_scene",
    "score",
    "write_jsonl",
    "write_split",
]
