"""`python -m arr_coc bench`: the whole prefill (vision tower, ARR-COC, LM) per budget, both encoding modes.

    python -m arr_coc bench --preset qwen2-vl-2b --encode after,before --budgets 0.1,0.2,0.3,1.0 --out bench.json
    python -m arr_coc bench --preset qwen2.5-vl-3b --encode before --budgets 0.1,0.25 --margin 1 --whole-windows \
        --repeats 1 --out bench_context.json    # cells only, margin 1, whole windows, both: side by side

What it measures and how: arr_coc/evaluation/bench.py; the model shapes: arr_coc/evaluation/bench_presets.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import add_budget_mode, add_runtime, budgets_arg, runtime

PRESETS = ("qwen2-vl-2b", "qwen2.5-vl-3b", "tiny", "tiny-qwen2.5")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--preset", default="qwen2-vl-2b", choices=PRESETS,
                        help="model shape: qwen2-vl-2b (default) or qwen2.5-vl-3b (real widths, random weights), "
                             "tiny / tiny-qwen2.5 (seconds, for tests)")
    parser.add_argument("--vision-layers", type=int, default=None,
                        help="vision blocks that run (default 2; the real towers have 32)")
    parser.add_argument("--lm-layers", "--layers", dest="lm_layers", type=int, default=None,
                        help="LM layers that run (default 2; the real 2B has 28, the 3B 36)")
    parser.add_argument("--encode", default="after,before",
                        help="comma list of encoding modes to measure: after (the tower encodes every patch, then "
                             "ARR-COC selects), before (ARR-COC selects from the texture and the question, the tower "
                             "encodes only the chosen cells); default both")
    parser.add_argument("--gist", type=float, default=0.0,
                        help="also measure 'before' rows with a gist of this share of the tokens, e.g. 0.25 "
                             "(default 0: no gist rows)")
    parser.add_argument("--margin", type=int, default=0,
                        help="also measure 'before' rows that encode this many rings of context cells around the "
                             "chosen ones, not read by the LM (default 0: no margin rows)")
    parser.add_argument("--whole-windows", action="store_true",
                        help="also measure 'before' rows that encode every attention window holding a chosen cell "
                             "whole (Qwen2.5-VL presets only; with --margin, the union rows too)")
    parser.add_argument("--budgets", type=budgets_arg, default="0.1,0.2,0.3,1.0",
                        help="comma list of shares in (0, 1] or token counts; 1.0 (the reference) is always added")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions (default: 3; tiny: 2)")
    parser.add_argument("--method", default="arr_coc",
                        help="selector whose overhead is measured (default: arr_coc)")
    parser.add_argument("--arr-coc", default=None,
                        help="folder of a trained ARR-COC layer whose query width is the preset's LM hidden size "
                             "(default: the untrained layer built for that width; the shipped layer reads 192-d "
                             "embeddings and cannot run on these presets)")
    add_budget_mode(parser)
    add_runtime(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    return parser


def run(args: argparse.Namespace) -> int:
    from arr_coc.evaluation.bench import bench, markdown_table

    run_on = runtime(args)
    encodes = [e.strip() for e in args.encode.split(",") if e.strip()]
    try:
        report = bench(preset=args.preset, vision_layers=args.vision_layers, lm_layers=args.lm_layers,
                       budgets=args.budgets, encodes=encodes, gist=args.gist, repeats=args.repeats,
                       method=args.method, arr_coc=args.arr_coc, budget_mode=args.budget_mode, runtime=run_on,
                       seed=args.seed, margin=args.margin, windows=args.whole_windows)
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
