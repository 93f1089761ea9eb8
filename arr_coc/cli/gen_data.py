"""``python -m arr_coc gen-data``: write a ShapesVQA split to disk.

    python -m arr_coc gen-data --out DIR --split test --n 2000 --seed 0 \
        [--canvas 448x448 | --canvas random] [--workers N]

writes DIR/images/<split>-NNNNNN.png and DIR/<split>.jsonl (format: see
arr_coc/data/jsonl.py). The output depends only on (split, n, seed, canvas,
hard-rate), never on --workers. ``arr_coc.cli`` wires this in by calling
``add_arguments`` on the subcommand's parser and ``run`` with the parsed args.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the gen-data options to ``parser`` (a subcommand parser)."""
    from arr_coc.shapes.vocabulary import DEFAULT_HARD_RATE

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
        "--hard-rate", type=float, default=DEFAULT_HARD_RATE,
        help=f"fraction of hard cases (low_contrast / void / border, equal shares) (default: {DEFAULT_HARD_RATE})",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Generate the split described by ``args``; returns the exit code.

    Bad options (canvas, n, split name, ...) print one line saying what to
    change and return 2, like argparse does.
    """
    import sys

    from arr_coc.shapes.files import write_split
    from arr_coc.shapes.vocabulary import DEFAULT_HARD_RATE

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
