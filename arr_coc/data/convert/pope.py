"""POPE: yes/no object questions -> JSONL, boxes of the object asked about from COCO instances.

File (RUCAIBox/POPE, ``output/coco/coco_pope_{random,popular,adversarial}.json``): one JSON object
per line, {"question_id": 1, "image": "COCO_val2014_000000310196.jpg", "text": "Is there a
snowboard in the image?", "label": "yes"}. The objects are COCO categories and the images COCO
val2014, so ``--instances instances_val2014.json`` (optional) gives the boxes.

Record: id = question_id, question = text, answers = [label], type = the POPE setting read from
the file name (random / popular / adversarial) when it has one, metric "yesno" (POPE's rule:
"no" when the reply's first sentence has "no" or "not", else "yes"). Boxes, with --instances:
every instance of the asked object's category in the image ([] for a "no", whose object is
absent); no boxes when the question is not "Is there a(n) X in the image?" with X a COCO category.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from .coco import load_instances
from .common import Inputs, LayoutError, at, field, load_json_lines, record, split_from_stem

NAME = "pope"
LOOKS = "a POPE question file (one JSON object per line: {question_id, image, text, label})"
EXTRA = {"instances": False}
SPLITS = "one"
ASKED = re.compile(r"^\s*is there an? (.+?) in the im(?:age|g)\s*\?*\s*$", re.IGNORECASE)


def asked_object(question: str) -> str | None:
    """"Is there a dining table in the image?" -> "dining table"; None for any other question."""
    m = ASKED.match(question)
    return m.group(1).strip().lower() if m else None


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    lines = load_json_lines(inputs.src, "POPE questions")
    inst = load_instances(inputs.extra["instances"]) if inputs.extra.get("instances") else None
    split = inputs.split or split_from_stem(inputs.src, r"^(.+?)\.jsonl?$")
    setting = next((s for s in ("random", "popular", "adversarial") if s in inputs.src.name), None)
    for n, item in enumerate(lines):
        qid = field(item, "question_id", at(inputs.src, f"line {n + 1}"), LOOKS, "id")
        where = at(inputs.src, f"line {n + 1}", qid, "question_id")
        image, text = field(item, "image", where, LOOKS, "text"), field(item, "text", where, LOOKS, "text")
        label = field(item, "label", where, LOOKS, "text")
        if label.lower() not in ("yes", "no"):
            raise LayoutError(f"{where}: 'label' is {label!r}, not yes or no; this does not look like {LOOKS}")
        boxes, note, size = None, None, None
        if inst is None:
            note = "no --instances given: no boxes"
        else:
            name = asked_object(text)
            iid = inst.by_file.get(image)
            if name is None or name not in inst.by_name:
                note = "the question names no COCO category: no boxes"
            elif iid is None:
                note = "image not in the instances file: no boxes"
            else:
                boxes, size = inst.boxes_of(iid, inst.by_name[name], inputs.log), inst.size(iid)
                if label.lower() == "yes" and not boxes:
                    note = "a 'yes' whose object has no instance: boxes []"
        yield split, record(qid, image, text, [label.lower()], type=setting, boxes=boxes, metric="yesno",
                            _note=note, _size=size)
