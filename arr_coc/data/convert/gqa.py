"""GQA: balanced questions + scene graphs -> JSONL, boxes of the objects the question points at.

Files (GQA's download page, https://cs.stanford.edu/people/dorarad/gqa/download.html):

- questions, e.g. ``testdev_balanced_questions.json`` / ``val_balanced_questions.json``: one JSON
  object {questionId: question}; a question has ``imageId`` (str), ``question``, ``answer`` (absent
  in the test/challenge files, which this refuses), ``fullAnswer``, ``types`` {structural, semantic,
  detailed} and ``annotations`` {question, answer, fullAnswer}: each a map from a token position
  or span ("2", "4:6") to the scene-graph objectId that word refers to;
- scene graphs (optional), ``val_sceneGraphs.json`` / ``train_sceneGraphs.json``: {imageId:
  {width, height, objects: {objectId: {name, x, y, w, h, attributes, relations}}}}, boxes in
  pixels (x, y the top-left corner). There are none for testdev: its records carry no boxes.

Images: ``images/<imageId>.jpg``. Record: id = questionId, answers = [answer], type = the
structural type (verify, query, choose, logical, compare), boxes = the objects named by the
question, answer and full-answer annotations (union, in that order, clipped to the image);
[] when the question points at no object (e.g. "Which room is it?"). Metric: exact match, as
GQA's own accuracy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from .common import (Inputs, LayoutError, Log, at, field, load_json, need, pixel_box, record, split_from_stem,
                     unique_boxes)

NAME = "gqa"
LOOKS = "GQA's balanced questions file ({questionId: {imageId, question, answer, annotations, ...}})"
SG_LOOKS = "GQA's scene graphs file ({imageId: {width, height, objects: {objectId: {name, x, y, w, h}}}})"
EXTRA = {"scene_graphs": False}
SPLITS = "one"


def _object_ids(annotations: Any, where: str) -> list[str]:
    """The objectIds of the question / answer / fullAnswer annotations, first seen first."""
    out: list[str] = []
    for part in ("question", "answer", "fullAnswer"):
        pointers = annotations.get(part) or {}
        if not isinstance(pointers, dict):
            raise LayoutError(f"{where}: annotations[{part!r}] is a {type(pointers).__name__}, not a map from "
                              f"token spans to objectIds; this does not look like {LOOKS}")
        for value in pointers.values():
            for oid in value if isinstance(value, list) else [value]:
                if str(oid) not in out:
                    out.append(str(oid))
    return out


def _scene_graphs(inputs: Inputs) -> dict[str, Any] | None:
    path = inputs.extra.get("scene_graphs")
    if path is None:
        return None
    graphs = load_json(path, "GQA scene graphs")
    if not isinstance(graphs, dict):
        raise LayoutError(f"{path}: a JSON {type(graphs).__name__}, not an object; this does not look like {SG_LOOKS}")
    for image_id, graph in list(graphs.items())[:1]:
        for key in ("width", "height", "objects"):
            need(graph, key, f"{path}: scene graph {image_id!r}", SG_LOOKS)
    return graphs


def _boxes(graph: dict[str, Any], ids: list[str], image_id: str, path: Path, log: Log, qid: Any
           ) -> tuple[list[list[float]] | None, tuple[float, float], str | None]:
    """(pixel boxes of `ids` in `graph`, the graph's image size, why there are none); boxes None when an id
    is not among its objects or its box is dropped (logged, with the object). Every field is checked."""
    where = at(path, f"scene graph {image_id!r}", qid, "for question")
    size = (field(graph, "width", where, SG_LOOKS, "size"), field(graph, "height", where, SG_LOOKS, "size"))
    objects = field(graph, "objects", where, SG_LOOKS, "map")
    boxes = []
    for oid in ids:
        if oid not in objects:
            return None, size, "an annotated object is not in the scene graph: no boxes"
        obj_where = f"{where}, object {oid!r}"   # the graph, the question that reads it, the object
        xywh = [field(objects[oid], k, obj_where, SG_LOOKS, "number") for k in ("x", "y", "w", "h")]
        boxes.append(pixel_box(xywh, size, obj_where, log))
    if None in boxes:   # a partial list would tell training the question points at fewer objects than it does
        return None, size, "an annotated object's box was dropped (see the log): no boxes"
    return unique_boxes(boxes), size, None


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    questions = load_json(inputs.src, "GQA questions")
    if not isinstance(questions, dict):
        raise LayoutError(f"{inputs.src}: a JSON {type(questions).__name__}, not an object keyed by questionId; "
                          f"this does not look like {LOOKS}")
    graphs = _scene_graphs(inputs)
    split = inputs.split or split_from_stem(inputs.src, r"^(.+?)_questions\.json$")
    for n, (qid, q) in enumerate(questions.items()):
        where = f"{inputs.src.name}: item {n} (question {qid!r})"
        image_id = str(field(q, "imageId", where, LOOKS, "id"))
        question = field(q, "question", where, LOOKS, "text")
        if "answer" not in q:
            raise LayoutError(f"{where} has no 'answer'; GQA's test and challenge questions have no answers "
                              "to score: convert testdev, val or train")
        answer = field(q, "answer", where, LOOKS, "text")
        types = need(q, "types", where, LOOKS)
        ids = _object_ids(field(q, "annotations", where, LOOKS, "map"), where)
        boxes, note, size = None, None, None
        if graphs is None:
            note = "no --scene-graphs given: no boxes"
        elif image_id not in graphs:
            note = "image has no scene graph: no boxes"
        else:
            boxes, size, note = _boxes(graphs[image_id], ids, image_id, inputs.extra["scene_graphs"], inputs.log,
                                       qid)
        yield split, record(qid, f"{image_id}.jpg", question, [answer],
                            type=types.get("structural") if isinstance(types, dict) else None,
                            boxes=boxes, full_answer=q.get("fullAnswer"), image_id=image_id, _note=note, _size=size)
