"""`python -m arr_coc bench`: what pruning saves in the prefill, on a Qwen2-VL-2B-shaped model.

    python -m arr_coc bench --preset qwen2-vl-2b --layers 4 --budgets 0.05,0.1,0.25,0.5,1.0 --out bench.json

What it measures and how: arr_coc/evaluation/bench.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import budgets_arg


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--preset", default="qwen2-vl-2b", choices=("qwen2-vl-2b", "tiny"),
                        help="model shape: qwen2-vl-2b (default) or tiny (seconds, for tests)")
    parser.add_argument("--layers", type=int, default=None,
                        help="LM layers (default: 4 for qwen2-vl-2b, 2 for tiny; the real 2B model has 28)")
    parser.add_argument("--budgets", type=budgets_arg, default="0.05,0.1,0.25,0.5,1.0",
                        help="comma list of shares in (0, 1] or token counts; 1.0 (the reference) is always added")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default: 5; tiny: 2)")
    parser.add_argument("--method", default="arr_coc",
                        help="selector whose overhead is measured (default: arr_coc, the untrained layer)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    return parser


def run(args: argparse.Namespace) -> int:
    from arr_coc.evaluation.bench import bench, markdown_table

    try:
        report = bench(preset=args.preset, layers=args.layers, budgets=args.budgets, repeats=args.repeats,
                       method=args.method, dtype=args.dtype, seed=args.seed)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    table = markdown_table(report)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table)
    print(f"wrote {args.out}")
    return 0
