"""``python -m arr_coc convert``: a real VQA data set's published files -> the project's JSONL.

    python -m arr_coc convert DATASET --src FILE --out DIR [--images FOLDER] [--split NAME]
        [--limit N] [--image-mode relative|symlink|copy]
        [--scene-graphs FILE] [--ocr FILE] [--annotations FILE] [--instances FILE]

writes DIR/<split>.jsonl (format: arr_coc/data/jsonl.py). DATASET: gqa, textvqa, vqav2, pope,
refcoco, refcoco+, refcocog, coco. The files each one reads, and the exact commands:
docs/DATA.md. Pure Python, no torch.
"""

from __future__ import annotations

import argparse

DATASETS = ("gqa", "textvqa", "vqav2", "pope", "refcoco", "refcoco+", "refcocog", "coco")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("dataset", choices=DATASETS, metavar="DATASET", help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--src", required=True,
                        help="the data set's main file: GQA *_balanced_questions.json, TextVQA_0.5.1_<split>.json, "
                             "VQAv2 questions JSON, POPE coco_pope_<setting>.json, the RefCOCO refs JSON, COCO "
                             "instances_<split>.json")
    parser.add_argument("--out", required=True, help="output folder; writes <split>.jsonl there")
    parser.add_argument("--images", default=None,
                        help="folder holding the image files (default: the --src file's folder/images)")
    parser.add_argument("--image-mode", choices=("relative", "symlink", "copy"), default="relative",
                        help="relative: records point at the images where they are (default); symlink / copy: "
                             "into OUT/images/")
    parser.add_argument("--split", default=None,
                        help="output split name (default: from the source file); RefCOCO: keep this split only")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N records of each split")
    parser.add_argument("--scene-graphs", default=None, help="GQA: *_sceneGraphs.json, for boxes")
    parser.add_argument("--ocr", default=None, help="TextVQA: TextVQA_Rosetta_OCR_v0.2_<split>.json, for boxes")
    parser.add_argument("--annotations", default=None, help="VQAv2: the annotations JSON (the answers; required)")
    parser.add_argument("--instances", default=None,
                        help="POPE: COCO instances_val2014.json, for boxes; RefCOCO: the folder's instances.json "
                             "(required)")
    return parser


def run(args: argparse.Namespace) -> int:
    import sys

    from arr_coc.data.convert import convert

    extra = {k: getattr(args, k) for k in ("scene_graphs", "ocr", "annotations", "instances")}
    try:
        report = convert(args.dataset, args.src, args.out, images=args.images, split=args.split, limit=args.limit,
                         image_mode=args.image_mode, **{k: v for k, v in extra.items() if v is not None})
    except (ValueError, FileNotFoundError) as exc:
        print(f"convert: error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0
