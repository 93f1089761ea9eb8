"""ShapesVQA, the project's test bed: a procedural, seeded VQA set (spec: docs/SHAPESVQA.md), and
the embedded Qwen2-VL-architecture model trained on it.

It lives in the checkout beside the library (`arr_coc/`), not in the wheel: it uses the library, and
nothing in the library imports it (tests/test_structure.py). Its commands: `python -m arr_coc_shapes
gen-data | train-vlm | train-adapter` (`cli/`), run from the checkout's root.

Each item is a cluttered canvas of 8-24 small coloured shapes and one templated question whose
answer depends on one small region (or, for "count", on every instance of a shape). A token
budget that cannot cover every object therefore rewards an allocator that finds the region the
question is about, which is the whole point of ARR-COC's participatory ("query-aware") knowing.

    from arr_coc_shapes import make_item, write_split
    image, record, scene = make_item(seed=0, split="train", index=7)   # in memory
    write_split("data/shapes", split="test", n=2000, seed=0)            # to disk (JSONL: arr_coc.data)

Determinism: every item draws from its own ``numpy.random.Generator(PCG64)`` seeded by
``(seed, split, index)``, so items are independent (parallel or on-the-fly generation gives the
same bytes) and two splits with the same seed differ. Rendering is a pure function of the
``Scene`` (texture noise has its own stored seed), so ``render_scene(scene)`` always reproduces
the image.

Generation plans the question first (type, then a uniformly drawn answer), then builds a scene
that makes that answer true, then re-derives the answer from the scene with ``ask``: question
types and answers are balanced by construction and the ground truth always comes from the
scene, never from the plan.

Coordinates: boxes are ``(x0, y0, x1, y1)`` integer pixels with ``x1``/``y1`` exclusive (PIL
crop convention), so width = x1 - x0 and a box fits an image of size (W, H) when
0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H. Sizes are (width, height) as in PIL; arrays are
[height, width] as in numpy.

Modules, by responsibility:

    vocabulary   colours, shapes, letters, question types, templates, sizes (standard library only)
    seeding      item_rng: the per-item generator
    scene        Scene, SceneObject, FaintMark: what an image is rendered from
    drawing      rendering shapes, letters and backgrounds (render_scene)
    plan         the question planned first, and the objects its answer needs
    layout       canvas size, hard cases, background, object placement (generate_scene)
    questions    Question, ask, questions_for_scene: ground truth from a scene
    cells        cell_labels on the merged-token grid; boxes -> cells (arr_coc.geometry, 28 px default)
    items        make_item / make_record / generate_split: one item in memory
    files        write_split: PNGs + JSONL on disk
    video        ShapesVQA-video, a package: clips with questions that need time (arr_coc_shapes.video)

and the embedded model (torch; import these modules by name, nothing here imports them):

    embedded     build_embedded: the model, its word-level tokenizer and image processor
    vlm_config   VLMTrainConfig: the training recipe (no torch)
    supervision  training items, dense per-cell labels, answer cells, visual-token dropout
    batching     visual_tokens, Batcher: several questions per image in one LM sequence
    attention    AttentionRecorder: attention rows recorded during an sdpa forward
    losses       DenseHead and the dense, attention and count losses
    checkpoint   save, warm_start
    trainer      train: the three-stage loop (command line: arr_coc_shapes.cli.train_vlm)
    adapter_items  ShapesVQA items drawn on the fly for train-adapter (`ShapesSource`, an `ItemSource`)

Every name below is imported on first use (the command line reads the defaults without loading
the generator); none of them imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> module that owns it
_EXPORTS = {
    "CELL_PX": "vocabulary",
    "COLOR_NAMES": "vocabulary",
    "COLORS": "vocabulary",
    "DEFAULT_HARD_RATE": "vocabulary",
    "HARD_KINDS": "vocabulary",
    "LETTERS": "vocabulary",
    "P_LETTER": "vocabulary",
    "QUESTION_TYPES": "vocabulary",
    "SHAPES": "vocabulary",
    "TEMPLATES": "vocabulary",
    "item_rng": "seeding",
    "Scene": "scene",
    "SceneObject": "scene",
    "render_scene": "drawing",
    "generate_scene": "layout",
    "parse_canvas": "layout",
    "Question": "questions",
    "ask": "questions",
    "questions_for_scene": "questions",
    "CellLabels": "cells",
    "boxes_to_cell_mask": "cells",
    "boxes_to_cell_shares": "cells",
    "cell_labels": "cells",
    "Item": "items",
    "generate_split": "items",
    "make_item": "items",
    "make_record": "items",
    "write_split": "files",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .cells import CellLabels, boxes_to_cell_mask, boxes_to_cell_shares, cell_labels
    from .drawing import render_scene
    from .files import write_split
    from .items import Item, generate_split, make_item, make_record
    from .layout import generate_scene, parse_canvas
    from .questions import Question, ask, questions_for_scene
    from .scene import Scene, SceneObject
    from .seeding import item_rng
    from .vocabulary import (
        CELL_PX, COLOR_NAMES, COLORS, DEFAULT_HARD_RATE, HARD_KINDS, LETTERS, P_LETTER, QUESTION_TYPES, SHAPES,
        TEMPLATES,
    )


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
