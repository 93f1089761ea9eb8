"""Reader for the project's VQA JSONL format (spec: docs/SHAPESVQA.md, "Files").

One JSON object per line::

    {"id": "test-000123", "image": "images/test-000123.png",
     "question": "What color is the triangle?", "answers": ["red"],
     "type": "color", "boxes": [[x0, y0, x1, y1]]}

ShapesVQA writes it and real data sets are converted to it, so the reader is
strict about the four required keys (id, image, question, answers) and lenient
about the rest: ``type`` and ``boxes`` are optional (real data rarely has
boxes), VQAv2-style multi-answer lists are fine, and unknown keys (e.g.
ShapesVQA's "hard") are kept in ``extra``. ``image`` is resolved relative to the
JSONL file's folder. Every error names the file, the line and what to fix.

Scoring is exact match after normalisation (lowercase, punctuation removed,
whitespace collapsed), against any of the accepted answers.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

REQUIRED_KEYS: tuple[str, ...] = ("id", "image", "question", "answers")
OPTIONAL_KEYS: tuple[str, ...] = ("type", "boxes")


class JSONLFormatError(ValueError):
    """A malformed JSONL record; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: Path | str, line: int, message: str):
        self.path, self.line = Path(path), line
        super().__init__(f"{path}, line {line}: {message}")


@dataclass(frozen=True)
class VQARecord:
    """One validated record. ``image`` is an absolute path."""

    id: str
    image: Path
    question: str
    answers: tuple[str, ...]
    type: str | None = None
    boxes: tuple[tuple[float, float, float, float], ...] | None = None  # None = not given
    extra: dict[str, Any] = field(default_factory=dict)  # any other keys, e.g. "hard"
    line: int = 0  # 1-based line in the JSONL file

    def load_image(self):
        """The image as an RGB PIL image (PIL is imported here, lazily)."""
        from PIL import Image

        with Image.open(self.image) as im:
            return im.convert("RGB")


# ---------------------------------------------------------------------------
# Answer normalisation and scoring
# ---------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation (any Unicode P* character), collapse whitespace.

    "  Red. " -> "red", "T-Shirt!" -> "tshirt", "2" -> "2".
    """
    lowered = str(text).lower()
    kept = "".join(ch for ch in lowered if not unicodedata.category(ch).startswith("P"))
    return " ".join(kept.split())


def score(prediction: str, answers: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_boxes(value: Any) -> tuple[tuple[float, float, float, float], ...]:
    """Validate ``boxes``; raises ValueError with the offending index."""
    if not isinstance(value, list):
        raise ValueError(
            f"'boxes' must be a list of [x0, y0, x1, y1] lists (use [] for none), got {type(value).__name__}"
        )
    out = []
    for i, box in enumerate(value):
        if not isinstance(box, list) or len(box) != 4 or not all(_is_number(v) for v in box):
            raise ValueError(f"'boxes'[{i}] must be a list of 4 numbers [x0, y0, x1, y1], got {box!r}")
        x0, y0, x1, y1 = box
        if x1 < x0 or y1 < y0:
            raise ValueError(f"'boxes'[{i}] = {box!r} has x1 < x0 or y1 < y0; boxes are [x0, y0, x1, y1] in pixels")
        out.append((x0, y0, x1, y1))
    return tuple(out)


def parse_record(obj: Any, base_dir: Path, check_image: bool = True) -> VQARecord:
    """Validate one decoded JSON value; raises ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object {{...}}, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(
            f"missing required key(s) {', '.join(map(repr, missing))}; every record needs {', '.join(REQUIRED_KEYS)}"
        )
    rid = obj["id"]
    if isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)  # VQAv2 question ids are integers
    if not isinstance(rid, str) or not rid:
        raise ValueError(f"'id' must be a non-empty string, got {obj['id']!r}")
    image = obj["image"]
    if not isinstance(image, str) or not image.strip():
        raise ValueError(f"'image' must be a non-empty path string relative to the JSONL folder, got {image!r}")
    image_path = base_dir / image  # absolute image paths stay as they are
    if check_image and not image_path.is_file():
        raise ValueError(f"image {image!r} not found at {image_path}; 'image' is relative to the JSONL file's folder")
    question = obj["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"'question' must be a non-empty string, got {question!r}")
    answers = obj["answers"]
    if isinstance(answers, str):
        raise ValueError(f"'answers' must be a list of strings, e.g. [{answers!r}], not a bare string")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"'answers' must be a non-empty list of strings, got {answers!r}")
    qtype = obj.get("type")
    if qtype is not None and not isinstance(qtype, str):
        raise ValueError(f"'type' must be a string when given, got {qtype!r}")
    boxes = _check_boxes(obj["boxes"]) if obj.get("boxes") is not None else None
    extra = {k: v for k, v in obj.items() if k not in REQUIRED_KEYS + OPTIONAL_KEYS}
    return VQARecord(rid, image_path, question, tuple(answers), qtype, boxes, extra)


def iter_jsonl(path: str | Path, check_images: bool = True) -> Iterator[VQARecord]:
    """Yield validated records from ``path``; blank lines are skipped.

    Raises JSONLFormatError (a ValueError) naming the file and 1-based line for
    invalid JSON, a missing or mistyped field, a missing image (when
    ``check_images``) or a duplicate id.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; generate one with `python -m arr_coc_shapes gen-data "
                                "--out DIR` (the checkout's ShapesVQA) or `python -m arr_coc convert` (docs/DATA.md)")
    base_dir = path.resolve().parent
    seen: dict[str, int] = {}
    with path.open("r", encoding="utf-8") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                what = f"not valid JSON ({exc.msg} at column {exc.colno}); each line must hold one JSON object"
                raise JSONLFormatError(path, lineno, what) from None
            try:
                record = parse_record(obj, base_dir, check_images)
            except ValueError as exc:
                raise JSONLFormatError(path, lineno, str(exc)) from None
            if record.id in seen:
                what = f"duplicate id {record.id!r} (first on line {seen[record.id]}); ids must be unique"
                raise JSONLFormatError(path, lineno, what)
            seen[record.id] = lineno
            yield dataclasses.replace(record, line=lineno)


def read_jsonl(path: str | Path, check_images: bool = True) -> list[VQARecord]:
    """All records of ``path`` (see ``iter_jsonl``)."""
    return list(iter_jsonl(path, check_images))


def write_jsonl(records: Sequence[dict], path: str | Path) -> Path:
    """Write dict records one per line (UTF-8, key order kept); atomic replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    tmp.replace(path)
    return path
