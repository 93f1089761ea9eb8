"""`python -m arr_coc ask`: answer one question about one image, baseline or pruned.

    python -m arr_coc ask --image cat.png --question "What colour is the cat?" --budget 0.1
    python -m arr_coc ask --model Qwen/Qwen2-VL-2B-Instruct --image cat.png --question ... --json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Any

# The repository's checkpoints/ folder (next to the arr_coc package), wherever the command runs from.
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def default_model_path() -> str | None:
    """The embedded VLM: the first folder under checkpoints/ holding a Qwen-VL config.json."""
    for cfg in sorted(glob.glob(os.path.join(CHECKPOINTS, "*", "config.json"))):
        try:
            with open(cfg) as f:
                if json.load(f).get("model_type") in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
                    return os.path.dirname(cfg)
        except (OSError, ValueError):
            continue
    return None


def default_layer_path() -> str | None:
    """Trained ARR-COC weights shipped under checkpoints/ (a folder with model.safetensors and an
    ARR-COC config.json), if any."""
    for cfg in sorted(glob.glob(os.path.join(CHECKPOINTS, "*", "config.json"))):
        try:
            with open(cfg) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if {"texture", "knowing", "attending"} <= set(data):
            return os.path.dirname(cfg)
    return None


UNTRAINED = "untrained"


def resolve_layer(model_path: str, arr_coc: str | None) -> str | None:
    """The ARR-COC layer a command should load: `arr_coc` if given ("untrained" -> the untrained
    layer); by default the shipped trained layer, but only for the embedded model it was
    trained against (its scorers read that model's 192-d embeddings)."""
    if arr_coc == UNTRAINED:
        return None
    if arr_coc:
        return arr_coc
    embedded = default_model_path()
    if embedded and os.path.isdir(model_path) and os.path.samefile(model_path, embedded):
        return default_layer_path()
    return None


def _budget(text: str) -> float | int:
    """'0.1' -> share 0.1; '64' -> 64 tokens."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget {text!r} is neither a share like 0.1 nor a count like 64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder or hub id (default: the model under checkpoints/)")
    parser.add_argument("--image", required=True, help="image file")
    parser.add_argument("--question", required=True)
    parser.add_argument("--budget", type=_budget, default=0.25,
                        help="share of visual tokens to keep (0.1) or a token count (64); default 0.25")
    parser.add_argument("--method", default="arr_coc",
                        help="arr_coc (default), none (baseline, all tokens), or a registered anchor method")
    parser.add_argument("--arr-coc", dest="arr_coc", default=None,
                        help="trained ARR-COC layer folder, or 'untrained' (default: the trained layer shipped "
                             "under checkpoints/ for the embedded model, else untrained)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from PIL import Image

    model_path = args.model or default_model_path()
    if model_path is None:
        raise SystemExit(
            f"no embedded model found under {CHECKPOINTS}; pass --model PATH "
            "(a local Qwen-VL folder, or a hub id such as Qwen/Qwen2-VL-2B-Instruct when online)"
        )
    try:
        image = Image.open(args.image).convert("RGB")
    except OSError as exc:
        raise SystemExit(f"cannot read image {args.image!r}: {exc}")
    from .model import ARRCOCQwen

    try:
        wrapper = ARRCOCQwen.from_pretrained(model_path, arr_coc=resolve_layer(model_path, args.arr_coc),
                                             device=args.device)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"could not load a Qwen-VL model from {model_path!r} ({first}); "
                         "pass --model PATH to a local model folder")
    budget: Any = 1.0 if args.method == "none" else args.budget
    answer, trace = wrapper.generate(image, args.question, budget=budget, method=args.method,
                                     max_new_tokens=args.max_new_tokens)
    result = {
        "answer": answer,
        "kept_tokens": trace.kept_tokens,
        "total_tokens": trace.total_tokens,
        "latency_s": round(trace.total_s, 4),
        "method": args.method,
        "budget": trace.budget,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(answer)
        print(f"kept {trace.kept_tokens}/{trace.total_tokens} visual tokens ({100 * trace.kept_ratio:.0f}%), "
              f"{trace.total_s:.2f} s (prefill {trace.prefill_s:.2f} s), method {args.method}, budget {trace.budget}"
              + (f" [fallback: {trace.error}]" if trace.error else ""), file=sys.stderr)
    return 0
