"""`python -m arr_coc ask`: answer one question about one image or one video clip, baseline or pruned.

    python -m arr_coc ask --image cat.png --question "What colour is the cat?" --budget 0.1
    python -m arr_coc ask --video clip.mp4 --question "What moves?" --budget 0.1 --encode before
    python -m arr_coc ask --model Qwen/Qwen2-VL-2B-Instruct --image cat.png --question ... --json
    python -m arr_coc ask --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda --dtype bfloat16 \
        --attn-implementation flash_attention_2 --image cat.png --question ...
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .args import add_budget_mode, add_encode, add_fast, add_runtime, budget_arg, encode_options, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder or hub id (default: the model under checkpoints/)")
    visual = parser.add_mutually_exclusive_group(required=True)
    visual.add_argument("--image", help="image file")
    visual.add_argument("--video", help="video file (mp4, webm, avi, mkv, mov, gif): one budget for the whole clip")
    parser.add_argument("--fps", type=float, default=None,
                        help="--video: frames sampled per second (default: the model's own rule, 2 for Qwen)")
    parser.add_argument("--num-frames", type=int, default=None, help="--video: sample this many frames instead")
    parser.add_argument("--question", required=True)
    parser.add_argument("--budget", type=budget_arg, default=None,
                        help="share of visual tokens to keep (0.1, 10%%) or a token count (64, 64tok); "
                             "default: the layer's own (0.25)")
    add_budget_mode(parser)
    add_encode(parser)
    parser.add_argument("--method", default="arr_coc",
                        help="arr_coc (default), none (baseline, all tokens), or a registered anchor method")
    parser.add_argument("--arr-coc", dest="arr_coc", default=None,
                        help="trained ARR-COC layer folder, or 'untrained' (default: the trained layer shipped "
                             "under checkpoints/ for the embedded model, else untrained)")
    adapters = parser.add_mutually_exclusive_group()
    adapters.add_argument("--adapter", default=None,
                          help="LoRA adapters (a folder written by train-adapter, a layer folder holding adapter/, or "
                               "a hub id), run when tokens are pruned (never with every token kept); default: the "
                               "layer folder's own adapter/, where it holds one trained for this model")
    adapters.add_argument("--no-adapter", dest="adapter", action="store_false", default=None,
                          help="no adapter, not even the layer folder's own")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    add_runtime(parser)
    add_fast(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from arr_coc.errors import InputError
    from arr_coc.paths import LayerNotFound

    try:
        plan = _plan(args)                     # every argument read before the model loads
        vlm = _load(args, plan)
        visual, info_notes = _visual(args, plan, vlm)
    except (InputError, LayerNotFound, ValueError) as exc:
        return refuse(exc)
    got = vlm.respond([visual], [plan.question], plan.pruning, max_new_tokens=plan.max_new_tokens)
    _print(args, vlm, got, visual, plan.question, plan.notes + info_notes)
    return 0


class _Plan:
    """What `ask` read before the model loads (issues 27, 39: every argument through the one validator)."""

    def __init__(self, model: str, run_on: Any, pruning: Any, question: str, notes: list[str], max_new_tokens: int,
                 layer: Any, opened: Any):
        self.model, self.run_on, self.pruning, self.question, self.notes = model, run_on, pruning, question, notes
        self.max_new_tokens, self.layer, self.opened = max_new_tokens, layer, opened


def _plan(args: argparse.Namespace) -> _Plan:
    from arr_coc.errors import InputError
    from arr_coc.validation.clips import check_video_file
    from arr_coc.validation.images import open_image
    from arr_coc.validation.limits import LIMITS
    from arr_coc.validation.requests import check_max_new_tokens, check_question
    from arr_coc.paths import CHECKPOINTS, default_model_path, resolve_layer
    from arr_coc.pipeline.request import Pruning, check_encode, check_for_video, check_method
    from arr_coc.video.animation import animated_notes
    from arr_coc.video.reading import is_clip_path

    run_on = runtime(args)  # a wrong device / dtype / attention name, or no GPU for cuda: said before anything loads
    clip_notes = []
    if args.video is None and is_clip_path(args.image):   # a clip wherever it is given (issues 49, 55): read as a
        clip_notes = animated_notes(args.image)           # clip by the model for clips, as --video would be
        args.video, args.image = args.image, None
    model_path = args.model or default_model_path(video=args.video is not None)
    if model_path is None:
        raise SystemExit(
            f"no embedded model found under {CHECKPOINTS}; pass --model PATH "
            "(a local Qwen-VL folder, or a hub id such as Qwen/Qwen2-VL-2B-Instruct when online)"
        )
    args.method = check_method(args.method)
    encode = check_encode(args.method, encode_options(args))
    max_new_tokens = check_max_new_tokens(args.max_new_tokens)
    question, notes = check_question(args.question)
    notes += clip_notes
    layer = resolve_layer(model_path, args.arr_coc, encode)
    if getattr(args, "adapter", None) not in (None, False):   # an adapter that is not there, before the model loads
        from arr_coc.adapter_files import adapter_folder

        adapter_folder(args.adapter)
    if args.video is None and (args.fps is not None or args.num_frames is not None):
        raise InputError("--fps and --num-frames sample a video: pass --video PATH", "video_options")
    if args.video is not None:       # issue 49: what a clip cannot be asked with, and its file, before the model loads
        check_for_video(args.method, encode)
        check_video_file(args.video, LIMITS, name=args.video, sampling=_sampling(args))
    opened = open_image(args.image, name=args.image) if args.video is None else None
    none = args.method == "none"            # the budget was read by argparse (`budget_arg`): once
    pruning = Pruning.of(args.method, 1.0 if none else args.budget, args.budget_mode, None if none else encode,
                         parsed=True)
    return _Plan(model_path, run_on, pruning, question, notes, max_new_tokens, layer, opened)


def _load(args: argparse.Namespace, plan: _Plan) -> Any:
    from arr_coc.adapter_files import AdapterError
    from arr_coc.front import ARRCOC
    from arr_coc.runtime import RuntimeChoiceError

    run_on = plan.run_on
    try:
        vlm = ARRCOC.from_pretrained(plan.model, arr_coc=plan.layer, device=run_on.device, dtype=run_on.dtype,
                                     attn_implementation=run_on.attn_implementation, fast=args.fast,
                                     adapter=getattr(args, "adapter", None))
    except RuntimeChoiceError as exc:  # e.g. flash_attention_2 without a GPU: not the model's fault
        raise SystemExit(f"error: {exc}") from None
    except AdapterError:               # the model loaded; the adapter does not fit it (its own one line)
        raise
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"could not load a Qwen-VL model from {plan.model!r} ({first}); "
                         "pass --model PATH to a local model folder")
    try:  # e.g. --whole-windows on a tower without window attention: said before any image work
        vlm.check_encode(plan.pruning.encode)
    except ValueError:
        if plan.opened is not None:
            plan.opened.close()
        raise
    return vlm


def _visual(args: argparse.Namespace, plan: _Plan, vlm: Any) -> tuple[Any, list[str]]:
    """The image decoded and normalised with this model's limits, or the clip sampled by the model's rule."""
    from arr_coc.validation.images import finish_image

    if args.video is not None:
        return load_video(args, vlm.input_limits(), vlm.video_sampling()), []
    image, info = finish_image(plan.opened, vlm.input_limits())
    return image, list(info.notes)


def _print(args: argparse.Namespace, vlm: Any, got: Any, visual: Any, question: str, notes: list[str]) -> None:
    """The answer on stdout (or one JSON object), what happened on stderr."""
    from arr_coc.answer_notes import answer_notes

    answer, trace = got.answers[0], got.traces[0]
    result = {
        "answer": answer, "kept_tokens": trace.kept_tokens, "total_tokens": trace.total_tokens,
        "latency_s": round(trace.total_s, 4), "method": args.method, "budget": trace.budget, "encode": trace.encode,
        "encoded_tokens": sum(int(c.numel()) for c in trace.encoded_cells), "vision_s": round(trace.vision_s, 4),
        "runtime": vlm.runtime.describe(),   # as loaded, e.g. "cpu, bfloat16, sdpa"
        "model": trace.model,
        "adapter": trace.adapter,                # the adapter that ran ("": none, or every token kept)
    }
    if args.video is not None:
        result["kept_per_group"] = trace.kept_per_group[0]
        result["frames"] = visual.num_frames
    if trace.bucket:                           # --fast: the cells chosen, then filled to the bucket's shape
        result["bucket"] = {"chosen": sum(trace.bucket["chosen"]), "filled": sum(trace.bucket["filled"]),
                            "prompt": trace.bucket["prompt"]}
    if trace.looks:                            # --passes 2+: each look's cells, uncertainty and decision
        result["looks"] = [look.to_dict() for look in trace.looks]
    result["notes"] = notes = notes + list(trace.notes) + answer_notes(answer, question, vlm.tokenizer)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
        return
    print(answer)
    print(f"kept {trace.kept_tokens}/{trace.total_tokens} visual tokens ({100 * trace.kept_ratio:.0f}%), "
          f"{trace.total_s:.2f} s (prefill {trace.prefill_s:.2f} s), method {args.method}, budget {trace.budget}"
          + (f" [fallback: {trace.error}]" if trace.error else ""), file=sys.stderr)
    if trace.bucket:
        print(f"fast path: the method chose {sum(trace.bucket['chosen'])} cells, filled to "
              f"{sum(trace.bucket['filled'])} (its bucket's fixed shape)", file=sys.stderr)
    if args.video is not None:
        print(f"{visual.num_frames} frames, tokens kept per temporal group: {trace.kept_per_group[0]}", file=sys.stderr)
    for n, look in enumerate(trace.looks, 1):
        print(f"look {n}: +{sum(int(c.numel()) for c in look.cells)} cells, uncertainty {look.uncertainty:.3f} "
              f"-> {'looked again' if look.saccade else 'stopped'}", file=sys.stderr)


def _sampling(args: argparse.Namespace, model_sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """How --video is sampled: the model's own rule (`ARRCOC.video_sampling`; before it loads, Qwen's: 2 frames
    per second), with --fps / --num-frames."""
    sampling = dict(model_sampling) if model_sampling is not None else {"fps": 2.0}
    if args.fps is not None:
        sampling["fps"] = args.fps
    if args.num_frames is not None:
        sampling["num_frames"] = args.num_frames
    return sampling


def load_video(args: argparse.Namespace, limits: Any, model_sampling: dict[str, Any]) -> Any:
    """The --video clip, checked by the one validator with the model's limits and sampled by the model's rule
    (--fps / --num-frames)."""
    from arr_coc.validation.clips import check_clip

    return check_clip(args.video, limits, name=args.video, sampling=_sampling(args, model_sampling))


def refuse(exc: Exception) -> int:
    """An input problem: its message as argparse words a bad option (the same words as the library and the app)."""
    print(f"python -m arr_coc ask: error: {exc}", file=sys.stderr)
    return 2
