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
from .common import IMAGE_MODES, Images, Inputs, LayoutError, Log, check_split_name, image_size

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


LOG_NAME = "convert_log.txt"
SHOWN = 3   # examples per kind of change in the summary; the log file has them all


@dataclass
class ConvertReport:
    """What `convert` wrote: per split the JSONL path, its record count and how many have boxes; and every
    record or box it left out or changed (`log`: (kind, what), `what` naming the file, the record and the
    field), written in full to OUT/convert_log.txt."""

    files: dict[str, Path] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    with_boxes: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)    # reason -> records left out
    notes: Counter = field(default_factory=Counter)      # remark (a record's "_note") -> records written
    first_missing_image: Path | None = None
    log: Log = field(default_factory=Log)
    log_file: Path | None = None

    def summary(self) -> str:
        lines = [f"wrote {self.counts[s]} records to {p} ({self.with_boxes[s]} with boxes)"
                 for s, p in self.files.items()]
        lines += [f"  skipped {n}: {why}" for why, n in self.skipped.most_common()]
        if self.first_missing_image is not None:
            lines.append(f"  (first image not found: {self.first_missing_image})")
        lines += [f"  note, {n} records: {what}" for what, n in self.notes.most_common()]
        kinds = Counter(kind for kind, _ in self.log.entries)
        for kind, n in kinds.most_common():
            shown = [what for k, what in self.log.entries if k == kind][:SHOWN]
            lines.append(f"  {kind}: {n}, e.g. " + "; ".join(shown) + ("; ..." if n > SHOWN else ""))
        if self.log_file is not None:
            lines.append(f"  every record and box left out or changed, by file, record and field: {self.log_file}")
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
    given = _check_options(dataset, module, extra, split, limit)
    src, out = Path(src), Path(out)
    root = _images_root(dataset, module, src, images)
    report = ConvertReport()
    inputs = Inputs(src=src, images=root, split=split, extra=given, log=report.log)
    placer = Images(root, out, image_mode)
    kept = _collect(module, inputs, placer, report, src, root, out, limit)
    _write(report, kept, src, out)
    return report


def _check_options(dataset: str, module: ModuleType, extra: dict[str, str | Path | None], split: str | None,
                   limit: int | None) -> dict[str, Path]:
    """Check the other input files against the data set's, --limit and --split; -> the given files as Paths."""
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
    return given


def _images_root(dataset: str, module: ModuleType, src: Path, images: str | Path | None) -> Path:
    """The images folder: `images`, else the data set's default next to SRC; it must exist."""
    root = Path(images) if images is not None else default_images(module, src)
    if not root.is_dir():
        raise FileNotFoundError(f"no images folder at {root}; pass --images FOLDER, the folder holding the "
                                f"{dataset} image files")
    return root


def _collect(module: ModuleType, inputs: Inputs, placer: Images, report: ConvertReport, src: Path, root: Path,
             out: Path, limit: int | None) -> dict[str, list[dict[str, Any]]]:
    """Every split's records to write (the first `limit` kept of each), logging what is dropped or noted."""
    kept: dict[str, list[dict[str, Any]]] = {}
    seen: set[tuple[str, str]] = set()
    sizes: dict[str, tuple[int, int] | None] = {}   # image file -> (width, height), read once
    for rec_split, rec in module.records(inputs):
        rows = kept.setdefault(check_split_name(rec_split), [])
        if limit is not None and len(rows) >= limit:
            if module.SPLITS == "one":
                break
            continue
        where = f"{src.name}: record {rec['id']!r}"
        if (rec_split, rec["id"]) in seen:
            report.skipped[f"duplicate id in {rec_split}"] += 1
            report.log.add("record dropped: duplicate id", f"{where}: 'id' already written to {rec_split}")
            continue
        checked = _check_record(rec, where, placer, report, root, out, sizes)
        if checked is None:
            continue
        rec, note = checked
        seen.add((rec_split, rec["id"]))
        rows.append(rec)
        if note:
            report.notes[note] += 1
            report.log.add(f"note: {note}", f"{where}")
    return kept


def _check_record(rec: dict[str, Any], where: str, placer: Images, report: ConvertReport, root: Path, out: Path,
                  sizes: dict[str, tuple[int, int] | None]) -> tuple[dict[str, Any], Any] | None:
    """A record with its image placed and boxes checked -> (record, note); None (logged) when it is dropped."""
    name = rec["image"]
    placed = placer.place(name)
    if placed is None:
        report.skipped[f"image not found under {root}"] += 1
        report.first_missing_image = report.first_missing_image or placer.path(name)
        report.log.add("record dropped: image not found", f"{where}: 'image' {name!r} is not under {root}")
        return None
    rec = {**rec, "image": placed}
    note, stated = rec.pop("_note", None), rec.pop("_size", None)
    actual = _file_size(placer.path(name), sizes) if rec.get("boxes") and stated is not None else None
    if actual is not None and (abs(actual[0] - stated[0]) >= 1 or abs(actual[1] - stated[1]) >= 1):
        report.log.add("boxes left out: the data's image size is not the file's",
                       f"{where}: boxes are for a {stated[0]:g}x{stated[1]:g} image, but {name} is "
                       f"{actual[0]}x{actual[1]}")
        rec.pop("boxes")   # pixels of another size: wrong cells; the question and answers stand
    try:
        parse_record(rec, out, check_image=False)   # the reader's own check, before anything is written
    except ValueError as exc:
        report.skipped[f"not a valid record ({exc})"] += 1
        report.log.add("record dropped: not a valid record", f"{where}: {exc}")
        return None
    return rec, note


def _write(report: ConvertReport, kept: dict[str, list[dict[str, Any]]], src: Path, out: Path) -> None:
    """Write each split's JSONL and the log (or remove an earlier run's), filling `report`; none to write: raise."""
    if not any(kept.values()):
        raise ValueError(f"no record to write from {src}\n{report.summary()}".rstrip())
    for name, rows in kept.items():
        if rows:
            report.files[name] = write_jsonl(rows, out / f"{name}.jsonl")
            report.counts[name] = len(rows)
            report.with_boxes[name] = sum(1 for r in rows if r.get("boxes"))
    log_file = out / LOG_NAME
    if report.log.entries:
        log_file.write_text("".join(f"{kind}\t{what}\n" for kind, what in report.log.entries), encoding="utf-8")
        report.log_file = log_file
    elif log_file.exists():
        log_file.unlink()   # an earlier run's log would describe other records


def default_images(module: ModuleType, src: Path) -> Path:
    """The images folder when --images is not given: the data set's own layout next to SRC or one level up
    (TextVQA's train_images/, VQAv2's and COCO's train2014/ or val2014/ as the file names its split), the
    first that exists; else SRC's folder/images (what the error then names)."""
    names = list(module.image_folders(src)) if hasattr(module, "image_folders") else []
    for name in names:
        for base in (src.parent, src.parent.parent):
            if (base / name).is_dir():
                return base / name
    return src.parent / "images"


def _file_size(path: Path, sizes: dict[str, tuple[int, int] | None]) -> tuple[int, int] | None:
    """(width, height) of the image file at `path`, read from its header once; None when it cannot be read
    (the record keeps its boxes then: nothing contradicts them)."""
    key = str(path)
    if key not in sizes:
        try:
            sizes[key] = image_size(path)
        except Exception:  # noqa: BLE001 - not an image PIL reads: nothing to compare
            sizes[key] = None
    return sizes[key]
