"""Converters from real data sets' published files to the project's VQA JSONL (layouts: docs/DATA.md).

    from arr_coc.data.convert import convert
    report = convert("textvqa", src="TextVQA_0.5.1_val.json", out="data/textvqa",
                     images="train_images", ocr="TextVQA_Rosetta_OCR_v0.2_val.json", limit=500)

One module per data set; each has ``NAME``, ``LOOKS`` (what its main file is, for errors),
``EXTRA`` (its other input files: option name -> required?), ``SPLITS`` ("one": the output split
is named after the source file or --split; "field": the records carry their own split) and
``records(inputs)`` yielding ``(split, record)``. Pure Python (PIL only for image sizes when the
data does not give them); no torch.
"""

from __future__ import annotations

import importlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from ..jsonl import parse_record, write_jsonl
from .common import IMAGE_MODES, Images, Inputs, LayoutError, check_split_name

# data set -> module (RefCOCO, RefCOCO+ and RefCOCOg share one layout and one reader)
DATASETS: dict[str, str] = {
    "gqa": "gqa",
    "textvqa": "textvqa",
    "vqav2": "vqav2",
    "pope": "pope",
    "refcoco": "refcoco",
    "refcoco+": "refcoco",
    "refcocog": "refcoco",
    "coco": "coco",
}
EXTRA_INPUTS = ("scene_graphs", "ocr", "annotations", "instances")

__all__ = ["DATASETS", "IMAGE_MODES", "ConvertReport", "LayoutError", "convert", "converter"]


def converter(dataset: str) -> ModuleType:
    """The module that reads `dataset` (a key of DATASETS)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown data set {dataset!r}; choose from {', '.join(DATASETS)}")
    return importlib.import_module(f"{__name__}.{DATASETS[dataset]}")


@dataclass
class ConvertReport:
    """What `convert` wrote: per split the JSONL path, its record count and how many have boxes."""

    files: dict[str, Path] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    with_boxes: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)    # reason -> records left out
    notes: Counter = field(default_factory=Counter)      # remark (a record's "_note") -> records written
    first_missing_image: Path | None = None

    def summary(self) -> str:
        lines = [f"wrote {self.counts[s]} records to {p} ({self.with_boxes[s]} with boxes)"
                 for s, p in self.files.items()]
        lines += [f"  skipped {n}: {why}" for why, n in self.skipped.most_common()]
        if self.first_missing_image is not None:
            lines.append(f"  (first image not found: {self.first_missing_image})")
        lines += [f"  note, {n} records: {what}" for what, n in self.notes.most_common()]
        return "\n".join(lines)


def convert(dataset: str, src: str | Path, out: str | Path, images: str | Path | None = None,
            split: str | None = None, limit: int | None = None, image_mode: str = "relative",
            **extra: str | Path | None) -> ConvertReport:
    """Convert `dataset` from its published file(s) to OUT/<split>.jsonl; returns what was written.

    `images` is the folder holding the data set's image files (default: SRC's folder/images);
    `limit` keeps the first N records of each split; `extra` are the data set's other files
    (scene_graphs, ocr, annotations, instances; see docs/DATA.md). Raises LayoutError (a
    ValueError) naming the file and the field when a file is not in the expected layout.
    """
    module = converter(dataset)
    unknown = [k for k in extra if k not in EXTRA_INPUTS]
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}; the converters take {', '.join(EXTRA_INPUTS)}")
    given = {k: Path(v) for k, v in extra.items() if v is not None}
    for name, required in module.EXTRA.items():
        if required and name not in given:
            raise ValueError(f"{dataset} needs --{name.replace('_', '-')} FILE (see docs/DATA.md)")
    stray = [k for k in given if k not in module.EXTRA]
    if stray:
        raise ValueError(f"{dataset} does not read --{stray[0].replace('_', '-')}; it reads "
                         f"{', '.join('--' + k.replace('_', '-') for k in module.EXTRA) or 'only --src'}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if split is not None:
        check_split_name(split)
    src, out = Path(src), Path(out)
    root = Path(images) if images is not None else src.parent / "images"
    if not root.is_dir():
        raise FileNotFoundError(f"no images folder at {root}; pass --images FOLDER, the folder holding the "
                                f"{dataset} image files")
    inputs = Inputs(src=src, images=root, split=split, extra=given)
    placer = Images(root, out, image_mode)
    kept: dict[str, list[dict[str, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    report = ConvertReport()
    for rec_split, rec in module.records(inputs):
        rows = kept.setdefault(check_split_name(rec_split), [])
        if limit is not None and len(rows) >= limit:
            if module.SPLITS == "one":
                break
            continue
        if (rec_split, rec["id"]) in seen:
            report.skipped[f"duplicate id in {rec_split}"] += 1
            continue
        name = rec["image"]
        placed = placer.place(name)
        if placed is None:
            report.skipped[f"image not found under {root}"] += 1
            report.first_missing_image = report.first_missing_image or placer.path(name)
            continue
        rec = {**rec, "image": placed}
        note = rec.pop("_note", None)
        try:
            parse_record(rec, out, check_image=False)   # the reader's own check, before anything is written
        except ValueError as exc:
            report.skipped[f"not a valid record ({exc})"] += 1
            continue
        seen.add((rec_split, rec["id"]))
        rows.append(rec)
        if note:
            report.notes[note] += 1
    if not any(kept.values()):
        raise ValueError(f"no record to write from {src}\n{report.summary()}".rstrip())
    for name, rows in kept.items():
        if rows:
            report.files[name] = write_jsonl(rows, out / f"{name}.jsonl")
            report.counts[name] = len(rows)
            report.with_boxes[name] = sum(1 for r in rows if r.get("boxes"))
    return report
