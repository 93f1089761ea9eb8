"""COCO instances -> JSONL relevance targets: per (image, category), all boxes of that category.

File (https://cocodataset.org/#format-data), ``instances_val2017.json`` / ``instances_train2014.json``:
{"info", "licenses", "images": [{"id", "file_name", "width", "height", ...}], "annotations":
[{"id", "image_id", "category_id", "bbox": [x, y, w, h] (pixels, top-left corner), "area",
"iscrowd", "segmentation"}], "categories": [{"id", "name", "supercategory"}]}. POPE and RefCOCO
read the same file for their boxes (``load_instances``).

Images: ``<file_name>`` under the images folder (e.g. val2017/000000000139.jpg).
Record (stage-1 relevance supervision, not a benchmark), in the order of each (image, category)'s
first annotation in the file: id = "<image_id>-<category_id>",
question = "Where is the <category>?" (the template can be changed with ``QUESTION``), answers =
[category], type = supercategory, boxes = every instance of the category in the image, crowd
regions included (they are where the category is).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .common import (Inputs, Log, at, field, load_json, need_list, pixel_box, record, split_from_stem,
                     unique_boxes)

NAME = "coco"
LOOKS = "COCO's instances file ({images: [{id, file_name, width, height}], annotations: [{image_id, " \
        "category_id, bbox}], categories: [{id, name}]})"
EXTRA: dict[str, bool] = {}
SPLITS = "one"
QUESTION = "Where is the {category}?"


@dataclass
class Instances:
    """A COCO instances file, indexed, every field checked (`field`). Boxes stay as the file gives them
    ([x, y, w, h]) until a record uses them (`boxes_of`), so only a box a record would carry is dropped or
    clipped, and logged with its annotation."""

    path: Path
    images: dict[Any, dict[str, Any]]           # image id -> {file_name, width, height}
    by_file: dict[str, Any]                     # file_name -> image id
    categories: dict[Any, dict[str, Any]]       # category id -> {name, supercategory}
    by_name: dict[str, Any]                     # category name -> id
    anns: dict[tuple[Any, Any], list[tuple[Any, list[float]]]]   # (image id, category id) -> [(ann id, xywh)]
    by_ann: dict[Any, tuple[Any, Any, list[float]]]               # annotation id -> (image id, category id, xywh)

    def size(self, iid: Any) -> tuple[float, float] | None:
        im = self.images.get(iid)
        return (im["width"], im["height"]) if im else None

    def box(self, ann_id: Any, log: Log) -> list[float] | None:
        """Annotation `ann_id`'s box in pixels, clipped to its image; None (logged) when nothing is left."""
        iid, _, xywh = self.by_ann[ann_id]
        return pixel_box(xywh, self.size(iid), f"{self.path.name}: annotation {ann_id!r} (image {iid!r})", log)

    def boxes_of(self, iid: Any, cid: Any, log: Log) -> list[list[float]]:
        """Every box of category `cid` in image `iid`, in pixels, clipped; dropped ones logged."""
        return unique_boxes(self.box(ann_id, log) for ann_id, _ in self.anns.get((iid, cid), []))


def load_instances(path: Path) -> Instances:
    path = Path(path)
    data = load_json(path, "COCO instances")
    images, by_file = {}, {}
    for n, im in enumerate(need_list(data, "images", f"{path}", LOOKS)):
        where = at(path, f"images[{n}]")
        iid = field(im, "id", where, LOOKS, "id")
        where = at(path, f"images[{n}]", iid)
        images[iid] = {"file_name": field(im, "file_name", where, LOOKS, "text"),
                       "width": field(im, "width", where, LOOKS, "size"),
                       "height": field(im, "height", where, LOOKS, "size")}
        by_file[images[iid]["file_name"]] = iid
    categories = {}
    for n, cat in enumerate(need_list(data, "categories", f"{path}", LOOKS)):
        where = at(path, f"categories[{n}]")
        categories[field(cat, "id", where, LOOKS, "id")] = {"name": field(cat, "name", where, LOOKS, "text"),
                                                             "supercategory": cat.get("supercategory")}
    anns: dict[tuple[Any, Any], list] = defaultdict(list)
    by_ann = {}
    for n, ann in enumerate(need_list(data, "annotations", f"{path}", LOOKS)):
        ann_id = field(ann, "id", at(path, f"annotations[{n}]"), LOOKS, "id", default=n)
        where = at(path, f"annotations[{n}]", ann_id)
        iid, cid = field(ann, "image_id", where, LOOKS, "id"), field(ann, "category_id", where, LOOKS, "id")
        xywh = field(ann, "bbox", where, LOOKS, "xywh")
        by_ann[ann_id] = (iid, cid, xywh)
        anns[(iid, cid)].append((ann_id, xywh))     # in the file's order: records come in it too
    by_name = {c["name"]: cid for cid, c in categories.items()}
    return Instances(path, images, by_file, categories, by_name, dict(anns), by_ann)


def image_folders(src: Path) -> tuple[str, ...]:
    """Where COCO's images are, by default: the split's folder (val2017/ for instances_val2017.json)."""
    m = re.search(r"^instances_(\w+)\.json$", src.name)
    return (m.group(1),) if m else ()


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    inst = load_instances(inputs.src)
    split = inputs.split or split_from_stem(inputs.src, r"^instances_(.+)\.json$")
    for (iid, cid) in inst.anns:             # in the order of each pair's first annotation: --limit takes the first
        where = f"{inputs.src.name}: record {f'{iid}-{cid}'!r}"
        cat = inst.categories.get(cid)
        if cat is None or iid not in inst.images:
            missing = f"category_id {cid!r}" if cat is None else f"image_id {iid!r}"
            inputs.log.add("record dropped: its annotations name an image or a category the file does not have",
                           f"{where}: {missing} is not in the file")
            continue
        boxes = inst.boxes_of(iid, cid, inputs.log)
        if not boxes:
            inputs.log.add("record dropped: no box of its category is left", f"{where}: every bbox was dropped")
            continue
        yield split, record(f"{iid}-{cid}", inst.images[iid]["file_name"], QUESTION.format(category=cat["name"]),
                            [cat["name"]], type=cat["supercategory"], boxes=boxes, image_id=iid,
                            _size=inst.size(iid))
