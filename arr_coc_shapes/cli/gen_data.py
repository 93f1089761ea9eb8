"""``python -m arr_coc_shapes gen-data``: write a ShapesVQA split (or, with --video, a ShapesVQA-video split) to disk.

    python -m arr_coc_shapes gen-data --out DIR --split test --n 2000 --seed 0 \
        [--canvas 448x448 | --canvas random] [--workers N]
    python -m arr_coc_shapes gen-data --video --out DIR --split test --n 2000 --seed 0 \
        [--preset standard | holdout] [--frames 4,6,8] [--pan-rate P] [--cut-rate P]

writes DIR/images/<split>-NNNNNN.png and DIR/<split>.jsonl (format: see
arr_coc/data/jsonl.py), or with --video DIR/clips/<split>-NNNNNN.gif (.png: APNG)
and DIR/<split>.jsonl (format: docs/SHAPESVQA.md, "ShapesVQA-video"). The output
depends only on the options, never on --workers. ``arr_coc_shapes.cli`` wires this in by calling
``add_arguments`` on the subcommand's parser and ``run`` with the parsed args.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the gen-data options to ``parser`` (a subcommand parser)."""
    from arr_coc_shapes.vocabulary import DEFAULT_HARD_RATE

    parser.add_argument("--out", required=True, help="output folder (created if missing)")
    parser.add_argument("--split", default="test", help="split name; prefixes ids and file names (default: test)")
    parser.add_argument("--n", type=int, default=2000, help="number of items (default: 2000)")
    parser.add_argument(
        "--seed", type=int, default=0, help="base seed; items are seeded by (seed, split, index) (default: 0)"
    )
    parser.add_argument(
        "--canvas", default="448x448",
        help="WIDTHxHEIGHT, each a multiple of 28 in [336, 896], or 'random' for a size per item (default: 448x448)",
    )
    parser.add_argument("--workers", type=int, default=1, help="processes; does not change the output (default: 1)")
    parser.add_argument(
        "--hard-rate", type=float, default=None,
        help=f"fraction of hard cases (low_contrast / void / border, equal shares) (default: {DEFAULT_HARD_RATE}); "
             "images only",
    )
    video = parser.add_argument_group("ShapesVQA-video (--video)")
    video.add_argument("--video", action="store_true",
                       help="write clips (GIF, or APNG past 256 colours) with questions that need time")
    video.add_argument("--preset", choices=("standard", "holdout"), default=None,
                       help="standard: 4-16 frames (4, 6, 8, 12, 16), 28-112 px moves; holdout: 10 or 14 frames, "
                            "84-196 px moves (default: standard)")
    video.add_argument("--frames", default=None,
                       help="clip lengths to draw from, e.g. 10,14 (4-16; default: the preset's)")
    video.add_argument("--pan-rate", type=float, default=None,
                       help="share of clips with a panning camera (default 0.2)")
    video.add_argument("--cut-rate", type=float, default=None, help="share of clips with a scene cut (default 0.15)")
    return parser


VIDEO_OPTIONS = ("preset", "frames", "pan_rate", "cut_rate")


def _run_video(args: argparse.Namespace) -> int:
    """The --video branch: a ShapesVQA-video split."""
    import sys

    from arr_coc_shapes.video.files import write_video_split
    from arr_coc_shapes.video.spec import options, parse_lengths

    try:
        if args.hard_rate is not None:
            raise ValueError("--hard-rate is for image splits; a video split has no hard cases")
        opts = options(args.preset or "standard", pan_rate=args.pan_rate, cut_rate=args.cut_rate,
                       lengths=parse_lengths(args.frames) if args.frames else None)
        start = time.perf_counter()
        path = write_video_split(args.out, split=args.split, n=args.n, seed=args.seed, canvas=args.canvas, opts=opts,
                                 workers=args.workers, progress=True)
    except ValueError as exc:
        print(f"gen-data: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {args.n} clips to {path} and {path.parent / 'clips'} ({args.n / seconds:.1f} clips/s)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Generate the split described by ``args``; returns the exit code.

    Bad options (canvas, n, split name, ...) print one line saying what to
    change and return 2, like argparse does.
    """
    import sys

    from arr_coc_shapes.files import write_split
    from arr_coc_shapes.vocabulary import DEFAULT_HARD_RATE

    if getattr(args, "video", False):
        return _run_video(args)
    given = [f"--{name.replace('_', '-')}" for name in VIDEO_OPTIONS if getattr(args, name, None) is not None]
    if given:
        print(f"gen-data: error: {', '.join(given)} need --video", file=sys.stderr)
        return 2
    hard_rate = getattr(args, "hard_rate", None)
    start = time.perf_counter()
    try:
        path = write_split(
            args.out, split=args.split, n=args.n, seed=args.seed, canvas=args.canvas,
            hard_rate=DEFAULT_HARD_RATE if hard_rate is None else hard_rate,
            workers=args.workers, progress=True,
        )
    except ValueError as exc:
        print(f"gen-data: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {args.n} items to {path} and {path.parent / 'images'} ({args.n / seconds:.1f} images/s)")
    return 0
