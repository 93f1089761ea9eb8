"""TextVQA: questions/answers JSON (+ Rosetta OCR JSON) -> JSONL, boxes of the OCR tokens that spell an answer.

Files (https://textvqa.org/dataset, dl.fbaipublicfiles.com/textvqa/data/):

- ``TextVQA_0.5.1_val.json`` / ``_train.json``: {"dataset_name": "textvqa", ..., "data": [item]},
  an item has ``question_id`` (int), ``question``, ``image_id`` (hex str), ``answers`` (ten
  strings; absent in the test file, which this refuses), ``image_width``, ``image_height``,
  ``image_classes``, ``flickr_original_url``, ``set_name``;
- ``TextVQA_Rosetta_OCR_v0.2_val.json`` (optional): {"data": [{"image_id", "ocr_tokens": [str],
  "ocr_info": [{"word", "bounding_box": {"top_left_x", "top_left_y", "width", "height",
  "rotation", ...}}]}]}, boxes normalised to [0, 1] of the image: they are scaled by the item's
  image_width / image_height (by the image file's size when the item lacks them).

Images: ``train_images/<image_id>.jpg`` for train and val (``test_images/`` for test).
Record: id = question_id, answers = the ten human answers (most frequent first), metric "vqa",
boxes = every OCR token, or run of consecutive tokens, whose words equal one of the answers after
VQA normalisation ("unanswerable" excluded), as the axis-aligned box of the run; [] when no token
matches; no boxes without an OCR file.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..metrics import vqa_normalize
from .common import (
    Inputs, LayoutError, image_size, load_json, most_common_first, need, need_list, record, split_from_stem,
    unique_boxes,
)

NAME = "textvqa"
LOOKS = "TextVQA's questions file ({'data': [{question_id, question, image_id, answers, ...}]})"
OCR_LOOKS = "TextVQA's Rosetta OCR file ({'data': [{image_id, ocr_info: [{word, bounding_box}]}]})"
EXTRA = {"ocr": False}
SPLITS = "one"
MAX_RUN = 6   # longest answer, in OCR tokens, looked for


def _ocr(inputs: Inputs) -> dict[str, list[tuple[str, dict]]] | None:
    """image_id -> [(normalised word, bounding_box)] in the file's token order, empty words left out."""
    path = inputs.extra.get("ocr")
    if path is None:
        return None
    data = need_list(load_json(path, "TextVQA Rosetta OCR"), "data", f"{path}", OCR_LOOKS)
    out = {}
    for n, entry in enumerate(data):
        where = f"{path.name}: item {n}"
        tokens = []
        for t, info in enumerate(need_list(entry, "ocr_info", where, OCR_LOOKS)):
            box = need(info, "bounding_box", f"{where}, ocr_info[{t}]", OCR_LOOKS)
            for key in ("top_left_x", "top_left_y", "width", "height"):
                need(box, key, f"{where}, ocr_info[{t}].bounding_box", OCR_LOOKS)
            word = vqa_normalize(need(info, "word", f"{where}, ocr_info[{t}]", OCR_LOOKS))
            if word:   # a token of punctuation only is no word
                tokens.append((word, box))
        out[str(need(entry, "image_id", where, OCR_LOOKS))] = tokens
    return out


def _pixel_box(run: list[dict], size: tuple[float, float]) -> list[float] | None:
    """The axis-aligned pixel box around normalised OCR boxes, clipped to the image."""
    w, h = size
    x0 = min(float(b["top_left_x"]) for b in run)
    y0 = min(float(b["top_left_y"]) for b in run)
    x1 = max(float(b["top_left_x"]) + float(b["width"]) for b in run)
    y1 = max(float(b["top_left_y"]) + float(b["height"]) for b in run)
    x0, x1 = max(0.0, x0) * w, min(1.0, x1) * w
    y0, y1 = max(0.0, y0) * h, min(1.0, y1) * h
    return [round(v, 2) for v in (x0, y0, x1, y1)] if x1 > x0 and y1 > y0 else None


def answer_boxes(tokens: list[tuple[str, dict]], answers: list[str], size: tuple[float, float]) -> list[list[float]]:
    """Pixel boxes of the runs of OCR tokens whose words, joined by spaces, equal a normalised answer."""
    wanted = {vqa_normalize(a) for a in answers} - {"", "unanswerable"}
    boxes = []
    for start in range(len(tokens)):
        for end in range(start + 1, min(len(tokens), start + MAX_RUN) + 1):
            words = " ".join(w for w, _ in tokens[start:end])
            if words in wanted:
                boxes.append(_pixel_box([b for _, b in tokens[start:end]], size))
    return unique_boxes(boxes)


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    items = need_list(load_json(inputs.src, "TextVQA questions"), "data", f"{inputs.src}", LOOKS)
    ocr = _ocr(inputs)
    split = inputs.split or split_from_stem(inputs.src, r"^TextVQA_[\d.]+_(\w+)\.json$")
    for n, item in enumerate(items):
        where = f"{inputs.src.name}: item {n}"
        qid, image_id = need(item, "question_id", where, LOOKS), str(need(item, "image_id", where, LOOKS))
        question = need(item, "question", where, LOOKS)
        if "answers" not in item:
            raise LayoutError(f"{where} has no 'answers'; TextVQA's test answers are hidden: convert train or val")
        answers = most_common_first(need_list(item, "answers", where, LOOKS))
        boxes, note = None, None
        if ocr is None:
            note = "no --ocr given: no boxes"
        elif image_id not in ocr:
            note = "image not in the OCR file: no boxes"
        else:
            if item.get("image_width") and item.get("image_height"):
                size = (float(item["image_width"]), float(item["image_height"]))
            elif inputs.images.joinpath(f"{image_id}.jpg").is_file():
                size = image_size(inputs.images / f"{image_id}.jpg")
            else:
                size = None
            if size is None:
                note = "no image size (item nor image file): no boxes"
            else:
                boxes = answer_boxes(ocr[image_id], answers, size)
                note = None if boxes else "no OCR token spells an answer: boxes []"
        yield split, record(qid, f"{image_id}.jpg", question, answers, boxes=boxes, metric="vqa",
                            image_id=image_id, _note=note)
