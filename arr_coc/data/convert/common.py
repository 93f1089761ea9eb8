"""What every converter shares: reading a source file strictly, boxes, records, image placement, writing.

A converter module (gqa.py, textvqa.py, ...) reads its data set's published files and yields
``(split, record)`` pairs; a record is a dict in the project's JSONL format (docs/SHAPESVQA.md,
"Files") whose ``image`` is still the file name under the images folder, whose optional
``"_note"`` says why it has no boxes and whose optional ``"_size"`` is the (width, height) its
boxes are in (neither is written). ``convert`` (in ``__init__``) keeps the first ``--limit`` per
split, places each image (``Images``), leaves out boxes whose stated size is not the file's,
validates the record with the reader's own check and writes ``OUT/<split>.jsonl``.

Every field a converter reads goes through ``field`` (its type checked, a wrong one refused naming
the file, the record and the field), every box through ``pixel_box``, and every record or box left
out or changed is logged (``Inputs.log``): nothing changes silently.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections import Counter
from dataclasses import dataclass
from dataclasses import field as field_
from pathlib import Path
from typing import Any, Iterable

IMAGE_MODES = ("relative", "symlink", "copy")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class LayoutError(ValueError):
    """A source file that is not in the layout its converter reads; the message names the file and the field."""


@dataclass
class Inputs:
    """What the command line gave one converter; ``extra`` holds the data set's other files (ocr, ...)."""

    src: Path
    images: Path
    split: str | None = None
    extra: dict[str, Path | None] = field_(default_factory=dict)
    log: Log = field_(default_factory=lambda: Log())


def load_json(path: Path, what: str) -> Any:
    """The decoded JSON of `path`; refuses pickles and names the file in every error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist ({what})")
    with path.open("rb") as handle:
        head = handle.read(2)
    if path.suffix in (".p", ".pkl", ".pickle") or head[:1] == b"\x80":
        raise LayoutError(f"{path} is a Python pickle; this project never loads pickles (they can run code). "
                          f"Give the {what} as JSON (see docs/DATA.md)")
    try:
        with path.open("r", encoding="utf-8") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LayoutError(f"{path}: not a JSON file ({exc}); expected the {what}") from None


def load_json_lines(path: Path, what: str) -> list[Any]:
    """One JSON value per non-blank line of `path`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist ({what})")
    out = []
    with path.open("r", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise LayoutError(f"{path}, line {lineno}: not JSON ({exc.msg}); expected the {what}, "
                                      "one JSON object per line") from None
    return out


def need(obj: Any, key: str, where: str, looks: str) -> Any:
    """obj[key], or a LayoutError: "<where> has no '<key>'; this does not look like <looks>"."""
    if not isinstance(obj, dict):
        raise LayoutError(f"{where} is a JSON {type(obj).__name__}, not an object; this does not look like {looks}")
    if key not in obj:
        raise LayoutError(f"{where} has no {key!r}; this does not look like {looks}")
    return obj[key]


def need_list(obj: Any, key: str, where: str, looks: str) -> list:
    value = need(obj, key, where, looks)
    if not isinstance(value, list):
        raise LayoutError(f"{where}: {key!r} is a {type(value).__name__}, not a list; this does not look like {looks}")
    return value


# ---------------------------------------------------------------------------- one record's fields, checked

KINDS = {
    "text": "a string",
    "id": "an integer or a string",
    "number": "a number",
    "size": "a positive number",
    "xywh": "[x, y, w, h]: four numbers",
    "list": "a list",
    "map": "an object",
}


def field(obj: Any, key: str, where: str, looks: str, kind: str | None = None, default: Any = ...) -> Any:
    """obj[key] checked to be of `kind` (see KINDS; None: any), else a LayoutError naming the file, the record
    and the field: "<where>: 'width' is 'abc', not a positive number; this does not look like <looks>".

    The one check every converter applies to every field it reads, so a wrong type is refused with the
    record it is in, never a traceback ("could not convert string to float") or a silently changed record.
    `where` names the file and the record (`at`); `default` (when given) is returned for a missing key.
    """
    if default is not ... and isinstance(obj, dict) and key not in obj:
        return default
    value = need(obj, key, where, looks)
    if kind is None or _is(value, kind):
        return value
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:36] + "...'"
    raise LayoutError(f"{where}: {key!r} is {shown}, not {KINDS[kind]}; this does not look like {looks}")


def _is(value: Any, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "text":
        return isinstance(value, str)
    if kind == "id":
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and bool(value))
    if kind == "number":
        return number
    if kind == "size":
        return number and value > 0
    if kind == "xywh":
        return isinstance(value, list) and len(value) == 4 and all(_is(v, "number") for v in value)
    if kind == "list":
        return isinstance(value, list)
    if kind == "map":
        return isinstance(value, dict)
    raise ValueError(f"unknown kind {kind!r}")


def at(file: Path | str, position: str, rid: Any = None, id_name: str = "id") -> str:
    """How errors and notes name a record: "q.json: item 3 (question_id 12)" (the file's name, not its path)."""
    name = Path(file).name
    return f"{name}: {position}" + (f" ({id_name} {rid!r})" if rid is not None else "")


@dataclass
class Log:
    """Every record or box a converter dropped or changed: (kind, what), `what` naming the file, the record
    and the field. `convert` counts them in the summary and writes them all to OUT/convert_log.txt."""

    entries: list[tuple[str, str]] = field_(default_factory=list)

    def add(self, kind: str, what: str) -> None:
        self.entries.append((kind, what))


def pixel_box(xywh: list[float], size: tuple[float, float] | None, where: str, log: Log) -> list[float] | None:
    """[x, y, w, h] pixels (checked numbers) -> [x0, y0, x1, y1] pixels clipped to the image (width, height).

    None (dropped, logged) for a box without area (w or h <= 0) or wholly outside the image; a box the
    image cuts is clipped, and logged as changed."""
    x, y, w, h = (float(v) for v in xywh)
    if w <= 0 or h <= 0:
        log.add("box dropped: no area (width or height <= 0)", f"{where}: bbox {xywh}")
        return None
    box = xywh_box(x, y, w, h, size)
    if box is None:
        log.add("box dropped: wholly outside the image", f"{where}: bbox {xywh} outside the {_wh(size)} image")
    elif size is not None and box != xywh_box(x, y, w, h):
        log.add("box changed: clipped to the image", f"{where}: bbox {xywh} clipped to {box} ({_wh(size)} image)")
    return box


def _wh(size: tuple[float, float] | None) -> str:
    return "unknown-size" if size is None else f"{size[0]:g}x{size[1]:g}"


def xywh_box(x: float, y: float, w: float, h: float, size: tuple[float, float] | None = None) -> list[float] | None:
    """[x, y, w, h] pixels -> [x0, y0, x1, y1] pixels clipped to the image (width, height); None if empty."""
    x0, y0, x1, y1 = float(x), float(y), float(x) + float(w), float(y) + float(h)
    if size is not None:
        x0, x1 = min(max(x0, 0.0), size[0]), min(max(x1, 0.0), size[0])
        y0, y1 = min(max(y0, 0.0), size[1]), min(max(y1, 0.0), size[1])
    if x1 <= x0 or y1 <= y0:
        return None
    return [round(v, 2) for v in (x0, y0, x1, y1)]


def unique_boxes(boxes: Iterable[list[float] | None]) -> list[list[float]]:
    """The non-empty boxes, first occurrence kept."""
    seen, out = set(), []
    for box in boxes:
        if box is not None and tuple(box) not in seen:
            seen.add(tuple(box))
            out.append(box)
    return out


def most_common_first(answers: Iterable[str]) -> list[str]:
    """The same answers (a multiset), the most frequent first (ties: first seen), so answers[0] is the majority."""
    answers = [str(a) for a in answers]
    counts = Counter(answers)
    first = {a: i for i, a in reversed(list(enumerate(answers)))}
    return sorted(answers, key=lambda a: (-counts[a], first[a]))


def record(rid: Any, image: str, question: str, answers: list[str], type: str | None = None,
           boxes: list | None = None, **extra: Any) -> dict[str, Any]:
    """A record in the JSONL format's key order; None values are left out."""
    out: dict[str, Any] = {"id": str(rid), "image": image, "question": question, "answers": answers}
    if type is not None:
        out["type"] = type
    if boxes is not None:
        out["boxes"] = boxes
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


def split_from_stem(path: Path, *patterns: str) -> str:
    """A split name from a file name: the first regex group that matches, else the file's stem."""
    for pattern in patterns:
        m = re.search(pattern, path.name)
        if m:
            return m.group(1)
    return path.stem


def check_split_name(name: str) -> str:
    if not _SPLIT_NAME.match(name):
        raise ValueError(f"split name {name!r} cannot be a file name; use letters, digits, _ . + -")
    return name


class Images:
    """Where a record's image is: a path relative to the output folder (default), or a link or a copy.

    relative: ``image`` is the image's path relative to OUT (the JSONL's folder), nothing is written;
    symlink / copy: the image is linked / copied to OUT/images/NAME and ``image`` is "images/NAME".
    An image that is not a file under the images folder gives None (the record is skipped).
    """

    def __init__(self, root: Path, out: Path, mode: str = "relative"):
        if mode not in IMAGE_MODES:
            raise ValueError(f"image mode {mode!r}; choose from {', '.join(IMAGE_MODES)}")
        self.root, self.out, self.mode = Path(root), Path(out), mode

    def path(self, name: str) -> Path:
        return self.root / name

    def place(self, name: str) -> str | None:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise LayoutError(f"image name {name!r} leaves the images folder; a data set names files inside it")
        source = self.root / name
        if not source.is_file():
            return None
        if self.mode == "relative":
            try:
                return Path(os.path.relpath(source.resolve(), self.out.resolve())).as_posix()
            except ValueError:   # another drive (Windows): an absolute path, which the reader keeps as is
                return str(source.resolve())
        target = self.out / "images" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        if self.mode == "symlink":
            target.symlink_to(source.resolve())
        else:
            shutil.copy2(source, target)
        return Path("images", name).as_posix()


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) of an image file, read from its header (PIL, imported here)."""
    from PIL import Image

    with Image.open(path) as im:
        return im.size
