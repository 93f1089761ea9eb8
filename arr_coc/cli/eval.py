"""`python -m arr_coc eval`: accuracy vs. visual-token budget, ARR-COC beside the anchor methods, on images or clips.

    python -m arr_coc eval --data data/shapes/test.jsonl --methods all \
        --budgets 0.05,0.1,0.25,0.5,1.0 --limit 500 --out results.json --plot acc.png --markdown table.md
    python -m arr_coc eval --data data/shapes_video/test.jsonl --methods none,arr_coc_trained,arr_coc_trained@before,evs \
        --budgets 0.03,0.05 --out video.json
    python -m arr_coc eval --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16 \
        --attn-implementation sdpa --data data/gqa/testdev.jsonl --methods none,arr_coc,fastv --budgets 0.1 --out r.json

A split of clips (`gen-data --video`) runs through the same loop as images. What is measured and how:
arr_coc/evaluation/loop.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .args import add_budget_mode, add_encode, add_fast, add_runtime, budgets_arg, encode_config, fail, runtime

DEFAULT_BUDGETS = "0.02,0.03,0.05,0.1,0.25,0.5,1.0"
METHODS_HELP = ("'all' (every method that can be given the split's visuals) or a comma list of: none, random, grid, "
                "downscale, fastv, visionzip, divprune, cdpruner, oracle, arr_coc, arr_coc_trained, and on clips "
                "evs, uniform_frames (or any registered selector); NAME@before / NAME@after sets one method's "
                "encoding (e.g. arr_coc_trained@before)")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None,
                        help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder or hub id (default: the embedded model under "
                             "checkpoints/; on a clip split, its video fine-tune)")
    parser.add_argument("--data", required=True,
                        help="VQA JSONL (the ShapesVQA test split from `python -m arr_coc_shapes gen-data`), or a "
                             "ShapesVQA-video split (`gen-data --video`)")
    parser.add_argument("--methods", default="all", help=METHODS_HELP)
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, type=budgets_arg,
                        help=f"comma list of shares (0.1, 10%%) or token counts (64) (default: {DEFAULT_BUDGETS})")
    add_budget_mode(parser)
    add_encode(parser)
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N items only")
    parser.add_argument("--batch-size", type=int, default=8, help="questions per forward pass (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random selections (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="answer length limit (default: 8)")
    parser.add_argument("--fastv-layer", type=int, default=None,
                        help="FastV's scoring layer K, 1-based (default: 2; images only: FastV cannot run on clips)")
    parser.add_argument("--arr-coc-weights", default=None,
                        help="folder of trained ARR-COC weights for arr_coc_trained (default: the layer shipped under "
                             "checkpoints/ when --model is the embedded model; otherwise skipped without it)")
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--adapter", default=None,
                          help="LoRA adapters (a folder written by train-adapter, a layer folder holding adapter/, or "
                               "a hub id) run for every pruned row; a method ending in -adapter runs without them, "
                               "one ending in +adapter with them (e.g. arr_coc@before-adapter,arr_coc@before+adapter)."
                               " Default: the --arr-coc-weights folder's own adapter/, where it holds one trained for "
                               "this model, for that layer's rows (arr_coc_trained) only")
    adapters.add_argument("--no-adapter", dest="adapter", action="store_false", default=None,
                          help="no adapter, not even the layer folder's own")
    parser.add_argument("--no-strict", dest="strict", action="store_false",
                        help="report a method that failed on some items with those items' keep-all fallback "
                             "(default: strict, such a row is reported as failed)")
    add_runtime(parser)
    add_fast(parser, buckets=True)
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--plot", default=None, help="accuracy vs. kept-token share plot (PNG)")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _plan(args: argparse.Namespace) -> tuple[Any, str, list, list[str], dict[str, str]]:
    """Everything read before the model loads: (runtime, model, items, methods, skipped); exits 2 on a bad one."""
    from arr_coc.evaluation.items import is_video_split, read_items
    from arr_coc.evaluation.loop import resolve_methods
    from arr_coc.errors import InputError
    from arr_coc.validation.requests import check_max_new_tokens
    from arr_coc.pipeline.request import LOOKS_REFUSAL
    from arr_coc.paths import (EMBEDDED_MODEL, UNTRAINED, LayerNotFound, check_layer_folder, default_model_path,
                               resolve_layer)

    run_on = runtime(args)  # a wrong device / dtype / attention name, or no GPU for cuda: said before anything loads
    try:  # issue 39: the library's validator, before any work (transformers refused 0 halfway, with a traceback)
        args.max_new_tokens = check_max_new_tokens(args.max_new_tokens)
    except InputError as exc:
        fail(args, str(exc))
    video = is_video_split(args.data)
    if video:   # issue 49: an option that cannot change a clip's result is refused, not ignored
        if args.fastv_layer is not None:
            _error("--fastv-layer sets FastV's layer, and FastV cannot run on a video split (it reads the unpruned "
                   "prompt's layout): leave it out")
        if encode_config(args).passes > 1:
            _error(LOOKS_REFUSAL)
    args.fastv_layer = 2 if args.fastv_layer is None else args.fastv_layer
    model = args.model or (default_model_path(video=True) if video else None) or EMBEDDED_MODEL
    if args.arr_coc_weights is None:   # the shipped trained layer for this encoding, embedded model only
        args.arr_coc_weights = resolve_layer(model, None, encode_config(args))
    elif args.arr_coc_weights == UNTRAINED:   # no trained layer: arr_coc_trained is skipped, and says so
        args.arr_coc_weights = None
    try:
        if args.arr_coc_weights is not None:   # issue 39: a layer that is not there, before the model loads
            args.arr_coc_weights = check_layer_folder(args.arr_coc_weights)
        methods, skipped = resolve_methods(args.methods, args.arr_coc_weights, video=video)
        _check_adapter(args, methods)
        items = read_items(args.data, args.limit)
    except (ValueError, FileNotFoundError, LayerNotFound) as exc:
        _error(str(exc))
    if not items:
        _error(f"{args.data} holds no items (or --limit is 0)")
    for name, why in skipped.items():
        print(f"eval: skipping {name}: {why}", file=sys.stderr)
    return run_on, model, items, methods, skipped


def _check_adapter(args: argparse.Namespace, methods: list[str]) -> None:
    """An adapter that is not there, or methods naming one that was not given: refused before the model loads."""
    from arr_coc.evaluation.plans import split_adapter
    from arr_coc.adapter_files import adapter_folder

    named = [m for m in methods if split_adapter(m)[0] != m]
    if named and not args.adapter:
        _error(f"{', '.join(named)} name the adapter, and no --adapter FOLDER was given")
    if args.adapter not in (None, False):
        adapter_folder(args.adapter)       # AdapterError (a ValueError): said by the caller


def _error(message: str) -> None:
    print(f"eval: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run(args: argparse.Namespace) -> int:
    from arr_coc.evaluation.loop import evaluate, load_vlm
    from arr_coc.pipeline.backend import Adapts, MissingCapability, has
    from arr_coc.pipeline.registry import HubUnreachable
    from arr_coc.runtime import RuntimeChoiceError
    from arr_coc.distributed import LaunchError, Processes

    try:  # under torchrun / accelerate launch: the launcher's device, a share of the batches, rank 0 writes
        processes = Processes.start(args.device)
        args.device = processes.device_for(args.device)
    except LaunchError as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_on, model, items, methods, skipped = _plan(args)
    except SystemExit as exc:
        if not isinstance(exc.code, int):      # a message (a wrong runtime): the command line prints it
            raise
        return exc.code
    try:
        vlm = load_vlm(model, run_on.device, args.seed, dtype=run_on.dtype,
                       attn_implementation=run_on.attn_implementation, fast=args.fast, adapter=args.adapter or False)
        vlm.check_encode(encode_config(args))   # e.g. --whole-windows on a tower without windows
        adapter_for = "pruned"
        if args.adapter is None and args.arr_coc_weights and has(vlm.backend, Adapts):   # the layer folder's own,
            args.adapter = vlm.backend.default_adapter(args.arr_coc_weights, model)     # for its layer's rows
            if args.adapter:
                vlm.backend.load_adapter(args.adapter)
                adapter_for = "trained"
    except (RuntimeChoiceError, HubUnreachable, ValueError) as exc:  # flash_attention_2 without a GPU; offline hub
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = evaluate(
            vlm, items, methods, args.budgets, batch_size=args.batch_size, seed=args.seed,
            max_new_tokens=args.max_new_tokens, fastv_layer=args.fastv_layer, arr_coc_weights=args.arr_coc_weights,
            progress=not args.quiet, strict=args.strict, budget_mode=args.budget_mode, encode=encode_config(args),
            processes=processes, adapter_for=adapter_for,
        )
    except MissingCapability as exc:   # what this model's backend cannot do for a method or the FLOP counts
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    processes.close()
    if not processes.is_main:
        return 0
    report = {"model": model, "data": args.data, "arr_coc_weights": args.arr_coc_weights, "adapter": args.adapter or None,
              "runtime": vlm.runtime.describe(), **report, "skipped": skipped}
    _write(args, report)
    return 0


def _write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The JSON, the plot, the Markdown table, and the tables on the terminal."""
    from arr_coc.evaluation.report import accuracy_table, cost_table, markdown_table, write_json, write_plot

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
    print(cost_table(report))
    failed = [f"{r['method']} @ {r['budget']}" for r in report["results"] if r.get("status") == "failed"]
    if failed:
        print(f"eval: {len(failed)} row(s) failed: {', '.join(failed)} (see 'error' in {args.out})", file=sys.stderr)
