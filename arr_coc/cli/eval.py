"""`python -m arr_coc eval`: accuracy vs. visual-token budget, ARR-COC beside the anchor methods.

    python -m arr_coc eval --data data/shapes/test.jsonl --methods all \
        --budgets 0.05,0.1,0.25,0.5,1.0 --limit 500 --out results.json --plot acc.png --markdown table.md
    python -m arr_coc eval --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16 \
        --attn-implementation sdpa --data data/gqa/testdev.jsonl --methods none,arr_coc,fastv --budgets 0.1 --out r.json

What is measured and how: arr_coc/evaluation/loop.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .args import add_budget_mode, add_encode, add_runtime, budgets_arg, encode_config, fail, runtime

DEFAULT_BUDGETS = "0.02,0.03,0.05,0.1,0.25,0.5,1.0"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder or hub id (default: the embedded model under "
                             "checkpoints/)")
    parser.add_argument("--data", required=True,
                        help="VQA JSONL (e.g. the ShapesVQA test split from `python -m arr_coc gen-data`)")
    parser.add_argument("--methods", default="all",
                        help="'all' or a comma list of: none, random, grid, downscale, fastv, visionzip, divprune, "
                             "cdpruner, oracle, arr_coc, arr_coc_trained (or any registered selector)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, type=budgets_arg,
                        help=f"comma list of shares (0.1, 10%%) or token counts (64) (default: {DEFAULT_BUDGETS})")
    add_budget_mode(parser)
    add_encode(parser)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N items only")
    parser.add_argument("--batch-size", type=int, default=8, help="questions per forward pass (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random selections (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="answer length limit (default: 8)")
    parser.add_argument("--fastv-layer", type=int, default=2, help="FastV's scoring layer K, 1-based (default: 2)")
    parser.add_argument("--arr-coc-weights", default=None,
                        help="folder of trained ARR-COC weights for arr_coc_trained (default: the layer shipped under "
                             "checkpoints/ when --model is the embedded model; otherwise skipped without it)")
    parser.add_argument("--no-strict", dest="strict", action="store_false",
                        help="report a method that failed on some items with those items' keep-all fallback "
                             "(default: strict, such a row is reported as failed)")
    add_runtime(parser)
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--plot", default=None, help="accuracy vs. kept-token share plot (PNG)")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    from arr_coc.data import read_jsonl
    from arr_coc.evaluation.loop import evaluate, load_wrapper, resolve_methods
    from arr_coc.evaluation.report import accuracy_table, markdown_table, write_json, write_plot
    from arr_coc.paths import EMBEDDED_MODEL, LayerNotFound, check_layer_folder, default_model_path, resolve_layer
    from arr_coc.training.distributed import LaunchError, Processes

    try:  # under torchrun / accelerate launch: the launcher's device, a share of the batches, rank 0 writes
        processes = Processes.start(args.device)
        args.device = processes.device_for(args.device)
    except LaunchError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    run_on = runtime(args)  # a wrong device / dtype / attention name, or no GPU for cuda: said before anything loads
    from arr_coc.inputs import InputError, check_max_new_tokens

    try:  # issue 39: the library's validator, before any work (transformers refused 0 halfway, with a traceback)
        args.max_new_tokens = check_max_new_tokens(args.max_new_tokens)
    except InputError as exc:
        fail(args, str(exc))
    model = args.model or (default_model_path(video=True) if is_video_split(args.data) else None) or EMBEDDED_MODEL
    if args.arr_coc_weights is None:
        # the shipped trained layer for this encoding, embedded model only
        args.arr_coc_weights = resolve_layer(model, None, encode_config(args))
    if is_video_split(args.data):
        return run_video(args, run_on, model)
    try:
        if args.arr_coc_weights is not None:   # issue 39: a layer that is not there, before the model loads
            args.arr_coc_weights = check_layer_folder(args.arr_coc_weights)
        methods, skipped = resolve_methods(args.methods, args.arr_coc_weights)
        records = read_jsonl(args.data)
    except (ValueError, FileNotFoundError, LayerNotFound) as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    if args.limit is not None:
        records = records[: max(0, args.limit)]
    if not records:
        print(f"eval: error: {args.data} holds no items (or --limit is 0)", file=sys.stderr)
        return 2
    for name, why in skipped.items():
        print(f"eval: skipping {name}: {why}", file=sys.stderr)
    from arr_coc.qwen import HubUnreachable
    from arr_coc.runtime import RuntimeChoiceError

    try:
        wrapper = load_wrapper(model, run_on.device, args.seed, dtype=run_on.dtype,
                               attn_implementation=run_on.attn_implementation)
    except (RuntimeChoiceError, HubUnreachable) as exc:  # flash_attention_2 without a GPU; a hub id offline
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    try:  # e.g. --whole-windows on a tower without window attention: said before any item runs
        encode_config(args).check_family(wrapper.family)
    except ValueError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    report = evaluate(
        wrapper, records, methods, args.budgets, batch_size=args.batch_size, seed=args.seed,
        max_new_tokens=args.max_new_tokens, fastv_layer=args.fastv_layer, arr_coc_weights=args.arr_coc_weights,
        progress=not args.quiet, strict=args.strict, budget_mode=args.budget_mode, encode=encode_config(args),
        processes=processes,
    )
    processes.close()
    if not processes.is_main:
        return 0
    report = {"model": model, "data": args.data, "arr_coc_weights": args.arr_coc_weights,
              "runtime": wrapper.runtime.describe(), **report, "skipped": skipped}
    write_json(report, args.out)
    print(f"wrote {args.out} ({len(report['results'])} rows, {report['n']} items)")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    table = markdown_table(report)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(table)
        print(f"wrote {args.markdown}")
    print(accuracy_table(report))
    failed = [f"{r['method']} @ {r['budget']}" for r in report["results"] if r.get("status") == "failed"]
    if failed:
        print(f"eval: {len(failed)} row(s) failed: {', '.join(failed)} (see 'error' in {args.out})", file=sys.stderr)
    return 0


def is_video_split(path: str) -> bool:
    """A ShapesVQA-video JSONL (`gen-data --video`): its first record names a clip and its boxes over time."""
    import json

    try:
        with open(path) as f:
            first = json.loads(next((line for line in f if line.strip()), "{}"))
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and "video" in first and "boxes_over_time" in first


def run_video(args: argparse.Namespace, run_on: Any, model: str) -> int:
    """`eval` on a video split: every video method at the budgets (`arr_coc.evaluation.video`)."""
    from arr_coc.evaluation.report import write_json
    from arr_coc.evaluation.video import VIDEO_METHODS, evaluate_video, read_video_records, table
    from arr_coc.qwen import ARRCOCQwen

    methods = list(VIDEO_METHODS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in VIDEO_METHODS]
    if unknown:
        print(f"eval: error: {unknown} cannot run on a video split; choose from {list(VIDEO_METHODS)}", file=sys.stderr)
        return 2
    from arr_coc.paths import UNTRAINED

    records = read_video_records(args.data, args.limit)
    layer = None if args.arr_coc_weights == UNTRAINED else args.arr_coc_weights   # one layer for every arr_coc row
    wrapper = ARRCOCQwen.from_pretrained(model, arr_coc=layer, device=run_on.device, dtype=run_on.dtype,
                                         attn_implementation=run_on.attn_implementation)
    report = evaluate_video(wrapper, records, methods, [b for b in args.budgets if b != 1.0],
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=not args.quiet)
    write_json(report, args.out)
    print(table(report))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table(report) + "\n")
    print(f"wrote {args.out} ({len(report['results'])} rows, {report['n']} clips)")
    return 0
