"""Temporal coherence of ARR-COC on ShapesVQA-video clips: carried relevance against per-group selection.

    python scripts/experiments/video_coherence.py --n 100 --budget 0.1 --named-object     # panning clips, one named object
    python scripts/experiments/video_coherence.py --n 60 --budget 0.1 [--carry mean --decay 0.5 --static-weight 1.0]

Per clip, every temporal group's picture is scored by the shipped before-mode layer with the embedded model's
question embeddings, and the clip's budget is spread over time with the given temporal settings and with
nothing carried (`arr_coc.evaluation.coherence`). Prints, for both: coverage (share of the target's cells kept
in each group), covered (counting a cell whose earlier kept token stands in, unchanged since) and jitter
(1 - IoU of consecutive groups' kept sets inside a scene).

--named-object: clips with a panning camera and one answer object visible from the first frame, asked the
image set's "Is there a <color> <shape>?" about it (no word about time), the target being that object in every
frame; otherwise the records' own questions and boxes.
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)
from arr_coc.core.config import TemporalConfig
from arr_coc.evaluation.coherence import clip_coherence, named_object, summary, without_carry
from arr_coc.core.layer import ARRCOCLayer
from arr_coc.paths import SHIPPED_BEFORE_LAYER, default_model_path
from arr_coc_shapes.video import make_clip_item


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="val")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--named-object", action="store_true")
    ap.add_argument("--layer", default=SHIPPED_BEFORE_LAYER)
    ap.add_argument("--decay", type=float, default=TemporalConfig().decay)
    ap.add_argument("--carry", default=TemporalConfig().carry, choices=["motion", "max", "mean"])
    ap.add_argument("--static-weight", type=float, default=TemporalConfig().static_weight)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = default_model_path()
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    layer = ARRCOCLayer.from_pretrained(args.layer).eval()
    config = TemporalConfig(decay=args.decay, static_weight=args.static_weight, carry=args.carry)
    runs: dict[str, list] = {"carry": [], "no_carry": []}
    index = 0
    bar = tqdm(total=args.n, desc="clips")
    while len(runs["carry"]) < args.n and index < 50 * args.n:
        frames, rec, track = make_clip_item(seed=args.seed, split=args.split, index=index)
        index += 1
        picked = named_object(rec, track) if args.named_object else (rec["boxes_over_time"], rec["question"])
        if picked is None or not any(picked[0]):
            continue
        target, question = picked
        with torch.no_grad():
            query = model.get_input_embeddings()(torch.tensor(tok(question, add_special_tokens=False)["input_ids"]))
        for name, cfg in (("carry", config), ("no_carry", without_carry(config))):
            runs[name].append(clip_coherence(layer, frames, target, question, query, args.budget, cfg))
        bar.update(1)
    bar.close()
    print(json.dumps({k: summary(v) for k, v in runs.items()}, indent=2))


if __name__ == "__main__":
    main()
