"""COCO instances -> JSONL relevance targets: per (image, category), all boxes of that category.

File (https://cocodataset.org/#format-data), ``instances_val2017.json`` / ``instances_train2014.json``:
{"info", "licenses", "images": [{"id", "file_name", "width", "height", ...}], "annotations":
[{"id", "image_id", "category_id", "bbox": [x, y, w, h] (pixels, top-left corner), "area",
"iscrowd", "segmentation"}], "categories": [{"id", "name", "supercategory"}]}. POPE and RefCOCO
read the same file for their boxes (``load_instances``).

Images: ``<file_name>`` under the images folder (e.g. val2017/000000000139.jpg).
Record (stage-1 relevance supervision, not a benchmark): id = "<image_id>-<category_id>",
question = "Where is the <category>?" (the template can be changed with ``QUESTION``), answers =
[category], type = supercategory, boxes = every instance of the category in the image, crowd
regions included (they are where the category is).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .common import Inputs, load_json, need, need_list, record, split_from_stem, unique_boxes, xywh_box

NAME = "coco"
LOOKS = "COCO's instances file ({images: [{id, file_name, width, height}], annotations: [{image_id, " \
        "category_id, bbox}], categories: [{id, name}]})"
EXTRA: dict[str, bool] = {}
SPLITS = "one"
QUESTION = "Where is the {category}?"


@dataclass
class Instances:
    """A COCO instances file, indexed."""

    images: dict[int, dict[str, Any]]           # image id -> {file_name, width, height}
    by_file: dict[str, int]                     # file_name -> image id
    categories: dict[int, dict[str, Any]]       # category id -> {name, supercategory}
    by_name: dict[str, int]                     # category name -> id
    boxes: dict[tuple[int, int], list[list[float]]]   # (image id, category id) -> pixel boxes
    by_ann: dict[int, tuple[int, int, list[float] | None]]   # annotation id -> (image id, category id, box)


def load_instances(path: Path) -> Instances:
    data = load_json(path, "COCO instances")
    images, by_file = {}, {}
    for n, im in enumerate(need_list(data, "images", f"{path}", LOOKS)):
        where = f"{path.name}: images[{n}]"
        iid = need(im, "id", where, LOOKS)
        images[iid] = {k: need(im, k, where, LOOKS) for k in ("file_name", "width", "height")}
        by_file[images[iid]["file_name"]] = iid
    categories = {}
    for n, cat in enumerate(need_list(data, "categories", f"{path}", LOOKS)):
        where = f"{path.name}: categories[{n}]"
        categories[need(cat, "id", where, LOOKS)] = {"name": need(cat, "name", where, LOOKS),
                                                      "supercategory": cat.get("supercategory")}
    boxes: dict[tuple[int, int], list] = defaultdict(list)
    by_ann = {}
    for n, ann in enumerate(need_list(data, "annotations", f"{path}", LOOKS)):
        where = f"{path.name}: annotations[{n}]"
        iid, cid = need(ann, "image_id", where, LOOKS), need(ann, "category_id", where, LOOKS)
        bbox = need(ann, "bbox", where, LOOKS)
        im = images.get(iid)
        box = xywh_box(*bbox, size=(im["width"], im["height"]) if im else None) if len(bbox) == 4 else None
        by_ann[ann.get("id", n)] = (iid, cid, box)
        if box is not None:
            boxes[(iid, cid)].append(box)
    by_name = {c["name"]: cid for cid, c in categories.items()}
    return Instances(images, by_file, categories, by_name, dict(boxes), by_ann)


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    inst = load_instances(inputs.src)
    split = inputs.split or split_from_stem(inputs.src, r"^instances_(.+)\.json$")
    for (iid, cid), boxes in sorted(inst.boxes.items()):
        cat = inst.categories.get(cid)
        if cat is None or iid not in inst.images:
            continue
        yield split, record(f"{iid}-{cid}", inst.images[iid]["file_name"], QUESTION.format(category=cat["name"]),
                            [cat["name"]], type=cat["supercategory"], boxes=unique_boxes(boxes), image_id=iid)
