"""VQAv2: questions + annotations JSONs -> JSONL with the ten human answers (no boxes).

Files (https://visualqa.org/download.html; the official API, GT-Vision-Lab/VQA, reads the same):

- questions, ``v2_OpenEnded_mscoco_val2014_questions.json``: {"info", "task_type", "data_type":
  "mscoco", "data_subtype": "val2014", "license", "questions": [{"image_id", "question",
  "question_id"}]};
- annotations (required: the answers), ``v2_mscoco_val2014_annotations.json``: {"info",
  "data_type", "data_subtype", "license", "annotations": [{"question_id", "image_id",
  "question_type", "answer_type", "multiple_choice_answer", "answers": [{"answer",
  "answer_confidence", "answer_id"}] (ten)}]}. The test splits have none.

Images: COCO's ``COCO_<data_subtype>_<image_id:012d>.jpg`` (e.g. val2014/COCO_val2014_000000393225.jpg).
Record: id = question_id, answers = the ten ``answers[].answer`` (most frequent first), type =
answer_type (yes/no, number, other), metric "vqa". Split name: data_subtype (e.g. val2014).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from .common import Inputs, LayoutError, at, field, load_json, most_common_first, need, need_list, record

NAME = "vqav2"
LOOKS = "VQAv2's questions file ({'data_subtype', 'questions': [{image_id, question, question_id}]})"
ANN_LOOKS = "VQAv2's annotations file ({'annotations': [{question_id, answers: [{answer}], answer_type, ...}]})"
EXTRA = {"annotations": True}
SPLITS = "one"


def image_folders(src: Path) -> tuple[str, ...]:
    """Where VQAv2's images are, by default: COCO's folder for the split the file names (val2014/, ...)."""
    m = re.search(r"(train|val|test)(20\d\d)", src.name)
    return (m.group(0),) if m else ()


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    qfile = load_json(inputs.src, "VQAv2 questions")
    subtype = str(need(qfile, "data_subtype", f"{inputs.src}", LOOKS))
    questions = need_list(qfile, "questions", f"{inputs.src}", LOOKS)
    ann_path = inputs.extra["annotations"]
    afile = load_json(ann_path, "VQAv2 annotations")
    annotations = need_list(afile, "annotations", f"{ann_path}", ANN_LOOKS)
    if afile.get("data_subtype") not in (None, subtype):
        raise LayoutError(f"{ann_path} is for {afile['data_subtype']!r} but {inputs.src} for {subtype!r}; "
                          "give the annotations of the same split")
    by_qid = {}
    for n, ann in enumerate(annotations):
        aid = field(ann, "question_id", at(ann_path, f"item {n}"), ANN_LOOKS, "id")
        where = at(ann_path, f"item {n}", aid, "question_id")
        answers = field(ann, "answers", where, ANN_LOOKS, "list")
        by_qid[aid] = ([str(field(a, "answer", f"{where}, answers[{i}]", ANN_LOOKS, "text"))
                        for i, a in enumerate(answers)], ann.get("answer_type"),
                       field(ann, "image_id", where, ANN_LOOKS, "id", default=None))
    split = inputs.split or subtype
    for n, q in enumerate(questions):
        qid = field(q, "question_id", at(inputs.src, f"item {n}"), LOOKS, "id")
        where = at(inputs.src, f"item {n}", qid, "question_id")
        image_id = field(q, "image_id", where, LOOKS, "id")
        question = field(q, "question", where, LOOKS, "text")
        if not (str(image_id).isascii() and str(image_id).isdigit()):
            raise LayoutError(f"{where}: 'image_id' is {image_id!r}, not a COCO image id (a whole number); "
                              f"this does not look like {LOOKS}")
        if qid not in by_qid:
            raise LayoutError(f"{where}: question_id {qid} has no annotation in {ann_path.name}; "
                              "give the annotations file of the same split")
        answers, answer_type, ann_image = by_qid[qid]
        if ann_image is not None and str(ann_image) != str(image_id):   # whose answers are these?
            inputs.log.add("record dropped: its question and its annotation name different images",
                           f"{where}: 'image_id' {image_id!r}, but its annotation in {ann_path.name} says {ann_image!r}")
            continue
        image = f"COCO_{subtype}_{int(image_id):012d}.jpg"
        yield split, record(qid, image, question, most_common_first(answers), type=answer_type, metric="vqa",
                            image_id=image_id)
