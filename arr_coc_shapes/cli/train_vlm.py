"""``python -m arr_coc_shapes train-vlm``: train the embedded Qwen2-VL-architecture model on ShapesVQA.

    python -m arr_coc_shapes train-vlm --out checkpoints/shapes-qwen2vl [--resume] [--steps 1100,0,2000] \
        [--init STATE_OR_FOLDER] [--letter-tiles N] [--count-heads 2.1:5] [--count-balance CAP]

The recipe and the training loop are `arr_coc_shapes.trainer` (defaults: `arr_coc_shapes.vlm_config`).
``arr_coc_shapes.cli`` wires this in by calling ``add_arguments`` on the subcommand's parser and ``run``
with the parsed args; torch is imported only inside ``run``.
"""

from __future__ import annotations

import argparse

from arr_coc.cli.args import add_runtime, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the train-vlm options to ``parser`` (a subcommand parser); the defaults are the shipped recipe's."""
    from arr_coc_shapes.vlm_config import VLMTrainConfig

    d = VLMTrainConfig()
    parser.add_argument("--out", default=d.out, help="checkpoint folder (default: %(default)s)")
    parser.add_argument("--state", default=d.state, help="resumable training state file (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--steps", default=",".join(map(str, d.steps)), help="steps per stage vision,language,joint")
    parser.add_argument("--images", default=",".join(map(str, d.images_per_step)), help="images per step, per stage")
    parser.add_argument("--val-items", type=int, default=d.val_items)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--resume", action="store_true", help="continue from --state")
    parser.add_argument("--init", default=None,
                        help="start from the weights of another run's state file or checkpoint folder (not its progress)")
    parser.add_argument("--lr", default=",".join(map(str, d.lr)), help="peak learning rate per stage vision,language,joint")
    parser.add_argument("--letter-tiles", type=int, default=d.letter_tiles,
                        help="letter-centred 4x4-cell tiles added to each step's dense loss (default: %(default)s)")
    parser.add_argument("--count-heads", default=",".join(f"{l}.{h}:{s:g}" for l, h, s in d.count_heads),
                        help="attention heads supervised to count, LAYER.HEAD:SINK,... (default: %(default)s)")
    parser.add_argument("--count-balance", type=float, default=d.count_balance, metavar="CAP",
                        help="reweight count answers to a uniform 0-9 prior, each weight at most CAP (0 = off; default: %(default)s)")
    parser.add_argument("--vision-crop", type=int, default=d.vision_crop, help="vision-stage crop in cells (0 = whole images)")
    video = parser.add_argument_group("--video: fine-tune a trained embedded model on ShapesVQA-video clips "
                                      "(arr_coc_shapes/video/tuning.py; any device)")
    video.add_argument("--video", action="store_true",
                       help="grow the vocabulary by the video questions' words, then train on clips + images from "
                            "--init (default checkpoints/shapes-qwen2vl) into --out")
    video.add_argument("--video-steps", type=int, default=2000, help="--video: steps (default 2000)")
    video.add_argument("--seconds", type=float, default=None, help="--video: stop after this many seconds")
    video.add_argument("--clips", type=int, default=8, help="--video: clips per step (default 8)")
    video.add_argument("--video-images", type=int, default=8, help="--video: images per step (default 8)")
    video.add_argument("--video-lr", type=float, default=2e-4, help="--video: peak learning rate (default 2e-4)")
    add_runtime(parser)
    # The recipe trains a toy-width model on the CPU in float32 with its own supervised-attention kernel
    # (arr_coc_shapes.trainer): those are its defaults, and anything else is refused before training starts.
    parser.set_defaults(device="cpu", dtype="float32")


def check_runtime(args: argparse.Namespace) -> None:
    """The recipe's runtime (cpu, float32, its own attention) or a SystemExit that says so and what to pass."""
    import torch

    run = runtime(args)  # wrong names: arr_coc.runtime's message
    if run.device.type != "cpu" or run.dtype != torch.float32 or run.attn_implementation not in (None, "sdpa"):
        raise SystemExit(f"error: train-vlm trains the embedded toy model on the CPU in float32 with its own "
                         f"supervised attention (arr_coc_shapes/trainer.py), not on {run.describe()}; leave out "
                         "--device, --dtype and --attn-implementation")


def parse_count_heads(text: str) -> tuple[tuple[int, int, float], ...]:
    """'2.1:5,2.2:1.5' -> ((2, 1, 5.0), (2, 2, 1.5)): LAYER.HEAD:SINK per supervised count head."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            where, sink = part.split(":")
            layer, head = where.split(".")
            out.append((int(layer), int(head), float(sink)))
        except ValueError:
            raise SystemExit(f"--count-heads wants LAYER.HEAD:SINK items like 2.1:5, got {part!r}")
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    """Train with the options in ``args`` (see the module docstring); returns the exit code."""
    import os

    import torch

    from arr_coc_shapes.trainer import train
    from arr_coc_shapes.vlm_config import VLMTrainConfig

    if args.video:
        from arr_coc.paths import EMBEDDED_MODEL
        from arr_coc_shapes.video.tuning import run as tune

        init = args.init or EMBEDDED_MODEL
        if os.path.abspath(init) == os.path.abspath(args.out):
            raise SystemExit("--video writes a new checkpoint: give --out a folder other than --init")
        got = tune(init, args.out, args.video_steps, args.seconds, args.clips, args.video_images, args.video_lr,
                   args.seed, device=runtime(args).device)
        print(f"added {len(got['words_added'])} words; {got['steps']} steps; last {got['last']}; wrote {got['out']}")
        return 0
    check_runtime(args)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    steps = tuple(int(s) for s in args.steps.split(","))
    if len(steps) != 3:
        raise SystemExit("--steps needs three numbers: vision,language,joint")
    images = tuple(int(s) for s in args.images.split(","))
    lr = tuple(float(s) for s in args.lr.split(","))
    if len(images) != 3 or len(lr) != 3:
        raise SystemExit("--images and --lr need three numbers each: vision,language,joint")
    cfg = VLMTrainConfig(out=args.out, state=args.state, seed=args.seed, steps=steps, images_per_step=images,
                         val_items=args.val_items, init=args.init, vision_crop=args.vision_crop, lr=lr,
                         letter_tiles=args.letter_tiles, count_heads=parse_count_heads(args.count_heads),
                         count_balance=args.count_balance,
                         eval_every=args.eval_every, save_every=min(args.eval_every, VLMTrainConfig.save_every))
    train(cfg, resume=args.resume)
    return 0
