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

from pathlib import Path
from typing import Any, Iterator

from ..metrics import vqa_normalize
from .common import (
    Inputs, LayoutError, Log, at, field, image_size, load_json, most_common_first, need_list, record,
    split_from_stem, unique_boxes,
)

NAME = "textvqa"
LOOKS = "TextVQA's questions file ({'data': [{question_id, question, image_id, answers, ...}]})"
OCR_LOOKS = "TextVQA's Rosetta OCR file ({'data': [{image_id, ocr_info: [{word, bounding_box}]}]})"
EXTRA = {"ocr": False}
SPLITS = "one"
MAX_RUN = 6   # longest answer, in OCR tokens, looked for


def _ocr(inputs: Inputs) -> dict[str, list[tuple[str, list[float], str]]] | None:
    """image_id -> [(normalised word, [x, y, w, h] normalised, where)] in the file's token order, empty words
    left out; every field checked (`field`)."""
    path = inputs.extra.get("ocr")
    if path is None:
        return None
    data = need_list(load_json(path, "TextVQA Rosetta OCR"), "data", f"{path}", OCR_LOOKS)
    out = {}
    for n, entry in enumerate(data):
        image_id = field(entry, "image_id", at(path, f"item {n}"), OCR_LOOKS, "id")
        where = at(path, f"item {n}", image_id, "image_id")
        tokens = []
        for t, info in enumerate(field(entry, "ocr_info", where, OCR_LOOKS, "list")):
            box = field(info, "bounding_box", f"{where}, ocr_info[{t}]", OCR_LOOKS, "map")
            xywh = [field(box, key, f"{where}, ocr_info[{t}].bounding_box", OCR_LOOKS, "number")
                    for key in ("top_left_x", "top_left_y", "width", "height")]
            word = vqa_normalize(field(info, "word", f"{where}, ocr_info[{t}]", OCR_LOOKS, "text"))
            if word:   # a token of punctuation only is no word
                tokens.append((word, xywh, f"{where}, ocr_info[{t}]"))
        out[str(image_id)] = tokens
    return out


SLACK = 1e-3   # a normalised coordinate this far past [0, 1] is rounding; further, the box is not normalised


def _pixel_box(run: list[tuple[list[float], str]], size: tuple[float, float], log: Log) -> list[float] | None:
    """The axis-aligned pixel box around normalised OCR boxes, clipped to the image; None (logged) when a
    box is not normalised to [0, 1] (pixels, say: clipping it would make a wrong box) or has no area."""
    w, h = size
    for (x, y, bw, bh), where in run:
        if bw <= 0 or bh <= 0:
            log.add("box dropped: no area (width or height <= 0)", f"{where}.bounding_box: {[x, y, bw, bh]}")
            return None
        if min(x, y) < -SLACK or x + bw > 1 + SLACK or y + bh > 1 + SLACK:
            log.add("box dropped: OCR box not normalised to [0, 1]",
                    f"{where}.bounding_box: {[x, y, bw, bh]} (pixels? TextVQA's OCR boxes are shares of the image)")
            return None
    x0 = max(0.0, min(b[0] for b, _ in run)) * w
    y0 = max(0.0, min(b[1] for b, _ in run)) * h
    x1 = min(1.0, max(b[0] + b[2] for b, _ in run)) * w
    y1 = min(1.0, max(b[1] + b[3] for b, _ in run)) * h
    return [round(v, 2) for v in (x0, y0, x1, y1)]


def answer_boxes(tokens: list[tuple[str, list[float], str]], answers: list[str], size: tuple[float, float],
                 log: Log | None = None) -> list[list[float]]:
    """Pixel boxes of the runs of OCR tokens whose words, joined by spaces, equal a normalised answer."""
    log = log if log is not None else Log()
    wanted = {vqa_normalize(a) for a in answers} - {"", "unanswerable"}
    boxes = []
    for start in range(len(tokens)):
        for end in range(start + 1, min(len(tokens), start + MAX_RUN) + 1):
            words = " ".join(w for w, _, _ in tokens[start:end])
            if words in wanted:
                boxes.append(_pixel_box([(b, where) for _, b, where in tokens[start:end]], size, log))
    return unique_boxes(boxes)


def image_folders(src: Path) -> tuple[str, ...]:
    """Where TextVQA's images are, by default: train_images/ (train and val), test_images/ (test)."""
    return ("test_images",) if "_test" in src.name else ("train_images",)


def records(inputs: Inputs) -> Iterator[tuple[str, dict[str, Any]]]:
    items = need_list(load_json(inputs.src, "TextVQA questions"), "data", f"{inputs.src}", LOOKS)
    ocr = _ocr(inputs)
    split = inputs.split or split_from_stem(inputs.src, r"^TextVQA_[\d.]+_(\w+)\.json$")
    for n, item in enumerate(items):
        qid = field(item, "question_id", at(inputs.src, f"item {n}"), LOOKS, "id")
        where = at(inputs.src, f"item {n}", qid, "question_id")
        image_id = str(field(item, "image_id", where, LOOKS, "id"))
        question = field(item, "question", where, LOOKS, "text")
        if "answers" not in item:
            raise LayoutError(f"{where} has no 'answers'; TextVQA's test answers are hidden: convert train or val")
        answers = field(item, "answers", where, LOOKS, "list")
        for i, a in enumerate(answers):
            if not isinstance(a, str):
                raise LayoutError(f"{where}: 'answers'[{i}] is {a!r}, not a string; this does not look like {LOOKS}")
        answers = most_common_first(answers)
        stated = (field(item, "image_width", where, LOOKS, "size", default=None),
                  field(item, "image_height", where, LOOKS, "size", default=None))
        boxes, note, size = None, None, None
        if ocr is None:
            note = "no --ocr given: no boxes"
        elif image_id not in ocr:
            note = "image not in the OCR file: no boxes"
        else:
            if None not in stated:
                size = stated
            elif inputs.images.joinpath(f"{image_id}.jpg").is_file():
                size = image_size(inputs.images / f"{image_id}.jpg")
            if size is None:
                note = "no image size (item nor image file): no boxes"
            else:
                logged = len(inputs.log.entries)
                boxes = answer_boxes(ocr[image_id], answers, size, inputs.log)
                note = None if boxes else "no OCR token spells an answer: boxes []"
                if len(inputs.log.entries) > logged:   # a run's box was dropped: the list would be short
                    boxes, note = None, "an OCR box that spells an answer was dropped (see the log): no boxes"
        yield split, record(qid, f"{image_id}.jpg", question, answers, boxes=boxes, metric="vqa",
                            image_id=image_id, _note=note, _size=size)
