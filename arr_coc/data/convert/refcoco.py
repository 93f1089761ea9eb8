"""RefCOCO / RefCOCO+ / RefCOCOg: referring expressions -> JSONL relevance supervision, box of the referred object.

The published annotations (lichengunc/refer: refcoco.zip, refcoco+.zip, refcocog.zip) are a
folder with ``instances.json`` and ``refs(unc).p`` / ``refs(google).p`` / ``refs(umd).p``. The
refs file is a Python pickle, which this project never loads (a pickle can run code), so the refs
are read as JSON: ``--src`` is a JSON list of the same ref objects the pickle holds (or
{"refs": [...]}), each {"ref_id", "ann_id", "image_id", "category_id", "split" (train / val /
testA / testB / test), "sentences": [{"sent", "sent_id", "raw", "tokens"}], "file_name", ...}
(docs/DATA.md says how to make it once). ``--instances`` is the folder's ``instances.json``
(COCO layout: images, annotations with ``bbox`` [x, y, w, h] pixels, categories); the box is the
annotation ``ann_id`` and the image file the instances' ``file_name`` for ``image_id`` (the
refs' own ``file_name`` carries an annotation suffix that names no file).

Images: COCO train2014, e.g. ``train2014/COCO_train2014_000000581857.jpg``.
Record, one per sentence (stage-1 relevance supervision; its accuracy is no benchmark): id =
"<ref_id>-<sent_id>", question = the referring expression, answers = [the object's category
name], type "refer", boxes = [the referred box]. One JSONL per split of the refs (``--split``
keeps one).
"""

from __future__ import annotations

from typing import Any, Iterator

from .coco import load_instances
from .common import Inputs, LayoutError, at, field, load_json, need_list, record

NAME = "refcoco"
LOOKS = "a RefCOCO refs JSON (a list of {ref_id, ann_id, image_id, split, sentences: [{sent}]})"
EXTRA = {"instances": True}
SPLITS = "field"


def _refs(inputs: Inputs) -> list[Any]:
    data = load_json(inputs.src, "RefCOCO refs")
    if isinstance(data, dict):
        if "images" in data and "annotations" in data:
            raise LayoutError(f"{inputs.src} is a COCO instances file; give it as --instances and the refs "
                              "JSON as --src")
        data = need_list(data, "refs", f"{inputs.src}", LOOKS)
    if not isinstance(data, list):
        raise LayoutError(f"{inputs.src}: a JSON {type(data).__name__}; this does not look like {LOOKS}")
    return data


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    refs = _refs(inputs)
    inst = load_instances(inputs.extra["instances"])
    for n, ref in enumerate(refs):
        ref_id = field(ref, "ref_id", at(inputs.src, f"item {n}"), LOOKS, "id")
        where = at(inputs.src, f"item {n}", ref_id, "ref_id")
        ann_id, image_id = field(ref, "ann_id", where, LOOKS, "id"), field(ref, "image_id", where, LOOKS, "id")
        split = str(field(ref, "split", where, LOOKS, "text"))
        sentences = field(ref, "sentences", where, LOOKS, "list")
        if inputs.split is not None and split != inputs.split:
            continue
        if ann_id not in inst.by_ann or image_id not in inst.images:
            raise LayoutError(f"{where}: ann_id {ann_id} / image_id {image_id} is not in "
                              f"{inputs.extra['instances'].name}; give the instances.json of the same data set")
        ann_image, cid, _ = inst.by_ann[ann_id]
        if ann_image != image_id:   # the box would be another image's
            inputs.log.add("record dropped: the ref's image is not its annotation's",
                           f"{where}: 'image_id' {image_id!r}, but ann_id {ann_id!r} is on image {ann_image!r} in "
                           f"{inputs.extra['instances'].name}")
            continue
        category = inst.categories.get(cid, {}).get("name")
        if category is None:
            raise LayoutError(f"{where}: category {cid} of ann_id {ann_id} is not among the instances' categories")
        box = inst.box(ann_id, inputs.log)
        for i, sentence in enumerate(sentences):
            text = field(sentence, "sent", f"{where}, sentences[{i}]", LOOKS, "text")
            sid = sentence.get("sent_id", i) if isinstance(sentence, dict) else i
            yield split, record(f"{ref_id}-{sid}", inst.images[image_id]["file_name"], text, [category],
                                type="refer", boxes=[box] if box else None, ref_id=ref_id, ann_id=ann_id,
                                _note=None if box else "the referred box was dropped (see the log): no boxes",
                                _size=inst.size(image_id))
