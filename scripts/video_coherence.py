"""Temporal coherence of ARR-COC on ShapesVQA-video clips: carry-over against per-group selection.

    python scripts/video_coherence.py --n 100 --budget 0.1 [--pan-only] [--layer checkpoints/arr-coc-shapes-before]

Per clip, every temporal group's picture is scored by the shipped layer with the embedded model's question
embeddings, and the clip's budget is spread over time with the default temporal settings and with nothing
carried (`arr_coc.evaluation.coherence`). Prints coverage of the answer's objects per group and jitter.
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

from arr_coc.config import TemporalConfig
from arr_coc.evaluation.coherence import clip_coherence, summary, target_over_time, without_carry
from arr_coc.layer import ARRCOCLayer
from arr_coc.paths import default_model_path
from arr_coc.shapes.video import make_clip_item


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="val")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--pan-only", action="store_true", help="only clips with a panning camera")
    ap.add_argument("--whole-track", action="store_true",
                    help="the answer's objects in every frame they are in (not only the frames the record marks)")
    ap.add_argument("--layer", default="checkpoints/arr-coc-shapes-before")
    ap.add_argument("--decay", type=float, default=TemporalConfig().decay)
    ap.add_argument("--carry", default=TemporalConfig().carry, choices=["max", "mean"])
    ap.add_argument("--static-weight", type=float, default=TemporalConfig().static_weight)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = default_model_path()
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    embed = model.get_input_embeddings()
    layer = ARRCOCLayer.from_pretrained(args.layer).eval()
    config = TemporalConfig(decay=args.decay, static_weight=args.static_weight, carry=args.carry)
    runs = {"carry": [], "no_carry": []}
    index = 0
    bar = tqdm(total=args.n, desc="clips")
    while len(runs["carry"]) < args.n:
        frames, rec, track = make_clip_item(seed=args.seed, split=args.split, index=index)
        index += 1
        target = target_over_time(track, rec["boxes_over_time"]) if args.whole_track else rec["boxes_over_time"]
        if (args.pan_only and rec["pan"] is None) or not any(target):
            continue
        with torch.no_grad():
            query = embed(torch.tensor(tok(rec["question"], add_special_tokens=False)["input_ids"]))
        for name, cfg in (("carry", config), ("no_carry", without_carry(config))):
            runs[name].append(clip_coherence(layer, frames, target, rec["question"], query,
                                             args.budget, cfg))
        bar.update(1)
    bar.close()
    print(json.dumps({k: summary(v) for k, v in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
