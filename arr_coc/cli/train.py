"""`python -m arr_coc train`: train ARR-COC's scorers against a frozen VLM (stage 1 or 2).

    python -m arr_coc train --model checkpoints/shapes-qwen2vl --data data/train/train.jsonl \
        --stage 1 --out checkpoints/arr-coc-shapes
    python -m arr_coc train ... --stage 2 --init checkpoints/arr-coc-shapes --out checkpoints/arr-coc-shapes

Data-parallel, one process per device (--batch-size is then per process; only rank 0 writes):

    accelerate launch --multi_gpu --num_processes 8 -m arr_coc train --data ... --stage 1 --feature-cache DIR
    accelerate launch --multi_gpu --num_processes 2 -m arr_coc train --device cpu ...   # CPU processes (gloo)
    torchrun --nproc_per_node 2 -m arr_coc train --device cpu ...

What the stages do: arr_coc/training/loop.py; how the processes share a step: arr_coc/distributed.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from .args import add_runtime, budgets_arg, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from arr_coc.core.config import SPREAD_SOURCES
    from arr_coc.paths import EMBEDDED_MODEL
    from arr_coc.training.config import TrainConfig

    d = TrainConfig()
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="VLM folder or hub id (frozen)")
    parser.add_argument("--data", required=True, nargs="+",
                        help="JSONL file(s) with answers and boxes (e.g. from gen-data); 10%% of each is held out")
    parser.add_argument("--stage", type=int, choices=(1, 2), required=True)
    parser.add_argument("--out", default=d.out, help="folder for the trained layer (save_pretrained)")
    parser.add_argument("--init", default=None, help="start from this trained layer folder (e.g. stage 1 output)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"items per step and per process: N processes step on N x this (default {d.batch_size})")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--rank-weight", type=float, default=d.rank_weight,
                        help="stage 2: add this x the stage-1 ranking loss on the boxes (0 = answer loss only)")
    parser.add_argument("--budgets", type=lambda text: tuple(budgets_arg(text)), default=d.budgets,
                        help="stage 2: comma-separated budgets (shares or counts), one drawn per step "
                             "(default: 0.05,0.1,0.25)")
    parser.add_argument("--feature-cache", default=None, metavar="DIR",
                        help="keep the frozen VLM's features of each data file here and reuse them while the VLM, "
                             "processor, JSONL and images are unchanged (stage-2 variants then skip 2-9 min of "
                             "extraction; about 0.8 GB per 1,000 items of the embedded model at 448 px)")
    parser.add_argument("--attn-dim", type=int, default=None,
                        help="width of a fresh layer's participatory scorer (default: knowing.attn_dim, 32); "
                             "not with --init")
    parser.add_argument("--spread-tau", type=float, default=d.spread_tau,
                        help="the saved layer scales each image's budget by the cells its relevance points at "
                             "(perplexity of softmax(relevance / T)), calibrated on the training items to average "
                             "1 and raised to at most 2 tokens per such cell, so the tokens kept average at most the "
                             "budget; 0 keeps every image's budget exact (default: 0.02)")
    parser.add_argument("--budget-follows", choices=SPREAD_SOURCES, default=d.budget_follows,
                        help="what the budget's scale counts as the cells a question needs: the relevance map's "
                             "perplexity, or the answer's cells as a linear head on the question and the map predicts "
                             "them (fitted in closed form on the training items' boxes after the steps; with --init "
                             "and --steps 0 it refits an existing layer's budget only) (default: perplexity)")
    parser.add_argument("--spread-range", type=_spread_range, default=d.spread_bounds, metavar="LOW,HIGH",
                        help="clip the budget's scale to [LOW, HIGH], LOW <= 1 <= HIGH (default: the layer's own, "
                             "0.6,2 for a fresh one)")
    parser.add_argument("--spread-per-cell", type=float, default=d.spread_per_cell, metavar="N",
                        help="raise an image's budget to at most N tokens per cell its question needs (default: the "
                             "layer's own, 2 for a fresh one)")
    parser.add_argument("--encode", choices=("after", "before"), default=d.encode,
                        help="the mode the layer is trained for: after (it reads the full encoding) or before (it reads "
                             "the gist with --gist > 0, else only the texture array and the question; stage 2's "
                             "language model still reads the full encoding)")
    parser.add_argument("--gist", type=float, default=d.gist,
                        help="train the scorers for encode='before': the layer reads the gist's tokens (a gist of this "
                             "share of the image's tokens) instead of the full encoding; stage 2's language model "
                             "still reads the full encoding (default 0: encode='after')")
    parser.add_argument("--add-texture", type=_texture_groups, default=(), metavar="GROUP[,GROUP]",
                        help="add texture channel groups to the layer, shape cues for --encode before: silhouette, "
                             "orientation (what each cell holds), object (the shape of the whole object a cell is "
                             "on); with --init the new channels start at zero weight, so training "
                             "starts from exactly the init layer's scores")
    add_runtime(parser)  # the frozen VLM's; the layer trains in float32 on the same device
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None, help="stop at this step (continue later with --resume)")


def _texture_groups(text: str) -> tuple[str, ...]:
    """'silhouette,orientation' -> the groups, each one the texture array knows."""
    from arr_coc.core.config import EXTRA_GROUPS, TEXTURE_GROUPS

    groups = tuple(g.strip() for g in text.split(",") if g.strip())
    unknown = [g for g in groups if g not in TEXTURE_GROUPS + EXTRA_GROUPS]
    if not groups or unknown:
        raise argparse.ArgumentTypeError(f"unknown texture groups {unknown or [text]}; add some of {list(EXTRA_GROUPS)}")
    return groups


def _spread_range(text: str) -> tuple[float, float]:
    """'0.3,4' -> (0.3, 4.0), checked: the scale must be able to average 1."""
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH such as 0.6,2, got {text!r}") from None
    if not 0 < low <= 1 <= high:
        raise argparse.ArgumentTypeError(f"need 0 < LOW <= 1 <= HIGH, got {low},{high}")
    return low, high


def run(args: argparse.Namespace) -> int:
    from arr_coc.training.config import TrainConfig
    from arr_coc.distributed import LaunchError, Processes
    from arr_coc.pipeline.backend import MissingCapability
    from arr_coc.training.loop import train

    try:  # under a launcher, this process's device is the launcher's (accelerate's), not a second opinion
        processes = Processes.start(args.device)
        args.device = processes.device_for(args.device)
    except LaunchError as exc:
        raise SystemExit(f"error: {exc}") from None
    cfg = TrainConfig(stage=args.stage, out=args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, eval_every=args.eval_every, rank_weight=args.rank_weight, budgets=args.budgets,
                      attn_dim=args.attn_dim, spread_tau=args.spread_tau, encode=args.encode, gist=args.gist,
                      add_texture=args.add_texture, budget_follows=args.budget_follows, spread_bounds=args.spread_range,
                      spread_per_cell=args.spread_per_cell)
    run_on = runtime(args)  # a wrong --device/--dtype stops here, before anything is written
    os.makedirs(cfg.out, exist_ok=True)
    try:
        train(cfg, args.model, args.data, init=args.init, resume=args.resume, stop_after=args.stop_after,
              feature_cache=args.feature_cache, runtime=run_on, processes=processes)
    except MissingCapability as exc:   # this model's backend cannot train through it: said before any work
        print(f"python -m arr_coc train: error: {exc}", file=sys.stderr)
        processes.close()             # every process refuses alike
        return 2
    processes.close()  # (a process that raised exits instead, and its launcher stops the others)
    return 0
