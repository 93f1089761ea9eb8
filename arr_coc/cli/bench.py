"""`python -m arr_coc bench`: the whole prefill (vision tower, ARR-COC, LM) per budget, both encoding modes.

    python -m arr_coc bench --preset qwen2-vl-2b --encode after,before --budgets 0.1,0.2,0.3,1.0 --out bench.json
    python -m arr_coc bench --preset qwen2.5-vl-3b --encode before --budgets 0.1,0.25 --margin 1 --whole-windows \
        --repeats 1 --out bench_context.json    # cells only, margin 1, whole windows, both: side by side
    python -m arr_coc bench --stages --device cuda --dtype bfloat16 --out stages.json   # ARR-COC stage by stage
    python -m arr_coc bench --layer --out layer.json         # the layer's pass alone: channel groups, knowing, ...

What it measures and how: arr_coc/evaluation/bench.py (--stages: arr_coc/evaluation/stages.py; --layer:
arr_coc/evaluation/layer_stages.py); the model shapes:
arr_coc/evaluation/bench_presets.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import add_budget_mode, add_fast, add_runtime, budget_arg, budgets_arg, runtime

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
    parser.add_argument("--stages", action="store_true",
                        help="time ARR-COC's own work stage by stage (un-patchify, texture, scorers, allocator, read, "
                             "packing) beside the tower and the LM prefill, with aten-op and host-sync counts, per image "
                             "size and batch size; the first of --budgets, the first of --encode")
    parser.add_argument("--layer", action="store_true",
                        help="time the ARR-COC layer's pass alone (no VLM), sub-stage by sub-stage: each texture "
                             "channel group, the three ways of knowing, balancing, attending, with aten-op counts; "
                             "--arr-coc (default: the shipped before-mode layer), --sizes, --batches, the first of "
                             "--budgets, --repeats (default 7)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="--layer on the CPU: time with this process's CPU clock, not the wall clock (a shared "
                             "machine's other jobs disturb it less)")
    parser.add_argument("--passes", type=int, default=1,
                        help="--stages with --encode before: looks per item (2+: saccades; the gate is forced open "
                             "with --saccade-threshold -1, so every item pays for every look)")
    parser.add_argument("--saccade-budget", type=budget_arg, default=0.05,
                        help="--passes 2+: cells each saccade adds per image (default 0.05)")
    parser.add_argument("--saccade-threshold", type=float, default=-1.0,
                        help="--passes 2+: the gate's threshold (default -1: every item looks again)")
    parser.add_argument("--sizes", default="448,896",
                        help="--stages: image sides in px (ShapesVQA scenes, multiples of 28 up to 896), default 448,896")
    parser.add_argument("--batches", default="1,8", help="--stages: batch sizes, default 1,8")
    parser.add_argument("--model", default=None,
                        help="--stages: a real checkpoint (folder or hub id) instead of a preset, e.g. "
                             "checkpoints/shapes-qwen2vl with --arr-coc checkpoints/arr-coc-shapes-before")
    add_budget_mode(parser)
    add_runtime(parser)
    add_fast(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    return parser


def run(args: argparse.Namespace) -> int:
    from arr_coc.evaluation.bench import bench, markdown_table

    run_on = runtime(args)
    if args.layer:
        return _layer(args, run_on)
    if args.stages or args.model:
        return _stages(args, run_on)
    encodes = [e.strip() for e in args.encode.split(",") if e.strip()]
    try:
        report = bench(preset=args.preset, vision_layers=args.vision_layers, lm_layers=args.lm_layers,
                       budgets=args.budgets, encodes=encodes, gist=args.gist, repeats=args.repeats,
                       method=args.method, arr_coc=args.arr_coc, budget_mode=args.budget_mode, runtime=run_on,
                       seed=args.seed, margin=args.margin, windows=args.whole_windows, fast=args.fast)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    return _write(args, report, markdown_table(report))


def _write(args: argparse.Namespace, report: dict, table: str) -> int:
    """The report as JSON at --out, its table as Markdown at --markdown and on stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table)
    print(f"wrote {args.out}")
    return 0


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} takes a comma list of whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{name} takes a comma list of whole numbers >= 1, got {text!r}")
    return values


def _sizes(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    sizes, batches = _ints(args.sizes, "--sizes"), _ints(args.batches, "--batches")
    if any(s % 28 or not 336 <= s <= 896 for s in sizes):
        raise ValueError(f"--sizes {args.sizes}: each side a multiple of 28 in [336, 896] (the bench's pictures: "
                         "arr_coc/evaluation/scenes.py)")
    return sizes, batches


def _layer(args: argparse.Namespace, run_on) -> int:
    """bench --layer: the layer's pass alone, sub-stage by sub-stage (arr_coc/evaluation/layer_stages.py)."""
    from arr_coc.core.layer import ARRCOCLayer
    from arr_coc.evaluation.layer_stages import layer_stage_bench, markdown_layer_stages
    from arr_coc.paths import default_layer_path

    try:
        sizes, batches = _sizes(args)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    folder = args.arr_coc or default_layer_path("before")
    layer = ARRCOCLayer.from_pretrained(folder).to(run_on.device).eval()
    budget = next((b for b in args.budgets if b != 1.0), args.budgets[0])
    report = layer_stage_bench(layer, sizes, batches, budget, args.repeats or 7, args.seed,
                               note=f"layer {folder}, budget {budget}", cpu_time=args.cpu_time)
    return _write(args, report, markdown_layer_stages(report))


def _stages(args: argparse.Namespace, run_on) -> int:
    """bench --stages: ARR-COC's own work stage by stage (arr_coc/evaluation/stages.py)."""
    from arr_coc.evaluation.stages import markdown_stages, stage_bench

    try:
        if not args.stages:
            raise ValueError("--model benches a real checkpoint stage by stage: add --stages")
        sizes, batches = _sizes(args)
        budget = next((b for b in args.budgets if b != 1.0), args.budgets[0])
        encode = args.encode.split(",")[0].strip()
        if args.passes > 1:
            from arr_coc.encode import EncodeConfig
            from arr_coc.saccade import SaccadeConfig

            encode = EncodeConfig(encode, saccade=SaccadeConfig(passes=args.passes, budget=args.saccade_budget,
                                                                threshold=args.saccade_threshold))
        vlm, note = _stage_model(args, run_on)
    except ValueError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    report = stage_bench(vlm, sizes, batches, budget, encode, args.repeats or 3, args.seed, args.budget_mode,
                         note=f"{note}; encode {getattr(encode, 'mode', encode)}, budget {budget}"
                              + (f", {args.passes} looks (saccade budget {args.saccade_budget}, threshold "
                                 f"{args.saccade_threshold})" if args.passes > 1 else ""))
    return _write(args, report, markdown_stages(report))


def _stage_model(args: argparse.Namespace, run_on):
    """The model --stages runs: a real checkpoint (--model) or a preset's random model at real widths, behind
    the front door."""
    from arr_coc.execution import read_fast_flag
    from arr_coc.front import ARRCOC

    arr_coc = None if args.arr_coc in (None, "untrained") else args.arr_coc
    if args.model:
        vlm = ARRCOC.from_pretrained(args.model, arr_coc=arr_coc, device=run_on.device, dtype=run_on.dtype,
                                     attn_implementation=run_on.attn_implementation, fast=args.fast)
        return vlm, f"{args.model}, ARR-COC layer {arr_coc or 'untrained'}"
    from arr_coc.evaluation.bench_presets import build_backend, get_preset, label, run_layers

    spec = get_preset(args.preset)
    n_vision, n_lm = run_layers(spec, args.vision_layers, args.lm_layers)
    backend, model, summary = build_backend(spec, n_vision, n_lm, run_on, args.seed)
    vlm = ARRCOC(backend, arr_coc=arr_coc, seed=args.seed, execution=read_fast_flag(args.fast, run_on.device),
                 name=str(getattr(model.config, "_name_or_path", "") or ""))
    return vlm, f"{summary['shape']} widths, random weights, {label(spec, n_vision, n_lm)}, ARR-COC layer " \
                    f"{arr_coc or 'untrained'}"
