"""`python -m arr_coc train-adapter`: LoRA adapters (peft) so the frozen VLM reads what ARR-COC keeps.

    python -m arr_coc train-adapter --model Qwen/Qwen2-VL-2B-Instruct --arr-coc LAYER --data gqa/train.jsonl ...
    python -m arr_coc train-adapter --data data/shapes/train.jsonl --out runs/adapter   # the embedded model
    python -m arr_coc_shapes train-adapter --out runs/adapter    # the embedded model, ShapesVQA drawn on the fly
    python -m arr_coc_shapes train-adapter --stage joint --init-adapter runs/adapter --out runs/joint   # 2b

Defaults: the embedded model and the shipped encode="before" layer; the data: --data's JSONL splits (the checkout's
`python -m arr_coc_shapes train-adapter` draws ShapesVQA items instead, through this command's `run`). What each
stage trains:
arr_coc/training/adapter.py; the recipe and its costs: docs/TRAINING.md, "Adapters (stage 2 and 3)".
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from .args import add_runtime, runtime

if TYPE_CHECKING:
    from arr_coc.training.adapter_items import ItemSource


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _range(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH shares such as 0.02,0.10, got {text!r}") from None
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from arr_coc.paths import EMBEDDED_MODEL
    from arr_coc.adapter_files import TARGET_GROUPS
    from arr_coc.training.adapter import AdapterTrainConfig

    d = AdapterTrainConfig()
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="VLM folder or hub id (frozen)")
    parser.add_argument("--arr-coc", dest="arr_coc", default=None,
                        help="the ARR-COC layer that prunes (default: the shipped layer for --encode, embedded model "
                             "only; 'untrained' for the untrained one)")
    parser.add_argument("--out", default=d.out, help="folder for the pair: the layer's files + the adapter in adapter/")
    parser.add_argument("--stage", choices=("frozen", "joint"), default=d.stage,
                        help="frozen: only the adapter trains; joint: the layer too (its differentiable relaxation)")
    parser.add_argument("--init-adapter", default=None,
                        help="continue this adapter (a folder, a pair folder holding adapter/, or a hub id) instead "
                             "of a fresh one (e.g. the frozen stage's, for --stage joint)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr, help="the adapter's peak learning rate")
    parser.add_argument("--layer-lr", type=float, default=d.layer_lr, help="--stage joint: the layer's")
    parser.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    parser.add_argument("--alpha", type=float, default=d.alpha, help=f"LoRA alpha (default {d.alpha:g})")
    parser.add_argument("--targets", type=_names, default=d.targets,
                        help=f"comma-separated, of {', '.join(TARGET_GROUPS)} (default {','.join(d.targets)})")
    parser.add_argument("--budgets", type=_range, default=d.budgets, metavar="LOW,HIGH",
                        help="each item's budget is drawn uniformly in [LOW, HIGH] (default 0.02,0.10)")
    parser.add_argument("--encode", choices=("before", "after"), default=d.encode,
                        help="where the pipeline prunes: before the tower (default; the tower's adapter trains on the "
                             "chosen cells) or after it (the tower stays stock: only the language model's adapter "
                             "learns)")
    parser.add_argument("--hard", action="store_true",
                        help="stage 3: draw --hard-types and the generator's hard scenes --hard-weight times as often")
    parser.add_argument("--hard-types", type=_names, default=d.hard_types, help="default count,letter")
    parser.add_argument("--hard-weight", type=float, default=d.hard_weight, help="default 2")
    parser.add_argument("--workers", type=int, default=d.workers,
                        help="DataLoader workers drawing (or reading) the items (default 0: this process; a GPU "
                             "host: 8+)")
    parser.add_argument("--val-items", type=int, default=d.val_items)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--data", nargs="+", default=[], metavar="JSONL",
                        help="train on these JSONL splits (docs/DATA.md's format, e.g. GQA converted by `convert`), "
                             "--val-items of them held out for validation (python -m arr_coc_shapes train-adapter: "
                             "ShapesVQA items drawn on the fly instead)")
    parser.add_argument("--data-seed", type=int, default=d.data_seed,
                        help="with --data, the seed of its shuffle and hold-out; otherwise of the items drawn on "
                             "the fly")
    add_runtime(parser)  # the VLM's; the layer runs in float32 beside it
    parser.add_argument("--resume", action="store_true", help="continue from the state file in --out")
    parser.add_argument("--stop-after", type=int, default=None, help="stop at this step (continue later with --resume)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace, items: ItemSource | None = None, prog: str = "python -m arr_coc train-adapter"
        ) -> int:
    """The command -> its exit status; without --data the items are drawn from `items` (none: refused)."""
    from arr_coc.encode import EncodeConfig
    from arr_coc.paths import LayerNotFound, check_layer_folder, resolve_layer
    from arr_coc.adapter_files import AdapterError, adapter_folder
    from arr_coc.pipeline.backend import MissingCapability
    from arr_coc.training.adapter import AdapterTrainConfig, check_run, train_adapter

    try:   # every argument, the layer and the adapter to continue, before the model loads
        cfg = AdapterTrainConfig(out=args.out, stage=args.stage, steps=args.steps, batch_size=args.batch_size,
                                 lr=args.lr, layer_lr=args.layer_lr, rank=args.rank, alpha=args.alpha,
                                 targets=args.targets, budgets=args.budgets, encode=args.encode, hard=args.hard,
                                 hard_types=args.hard_types, hard_weight=args.hard_weight, workers=args.workers,
                                 val_items=args.val_items, eval_every=args.eval_every, seed=args.seed,
                                 data_seed=args.data_seed, data=tuple(args.data))
        for path in cfg.data:
            if not os.path.isfile(path):
                raise ValueError(f"--data {path}: no such file (a JSONL split: docs/DATA.md)")
        layer = resolve_layer(args.model, args.arr_coc, EncodeConfig(args.encode))
        layer = check_layer_folder(layer) if layer is not None else None
        if args.init_adapter:
            adapter_folder(args.init_adapter)
        notes = check_run(cfg, args.resume, items)   # the data read and sized, --out writable, --resume's state
    except (ValueError, LayerNotFound, AdapterError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"train-adapter: note: {note}", file=sys.stderr)
    run_on = runtime(args)
    try:
        state = train_adapter(cfg, args.model, layer, init_adapter=args.init_adapter, resume=args.resume,
                              progress=not args.quiet, runtime=run_on, stop_after=args.stop_after, items=items)
    except MissingCapability as exc:   # this model's backend cannot train adapters through it: before any work
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"train-adapter: {state['step']} steps; the pair is in {cfg.out} (the adapter in {cfg.out}/adapter)")
    return 0
