"""How precisely the embedded model's supervised count heads count, by the true number n.

    python scripts/experiments/count_heads.py [checkpoints/shapes-qwen2vl] [--items 300]

`train-vlm --count-heads` supervises a head to put weight `sink` on position 0 and 1 on the
centre cell of every counted object, so its "count signal" s = m_t / (m_t + m_0) (m_t: its
attention mass on those centres, m_0: on position 0) should be n / (n + sink). For count
questions of the validation generator (seed 99, 448 px, every visual token) this prints,
per head and n: the mass on the centres, on the sink and elsewhere, the signal's mean +- sd
against its ideal, and the model's answers. Two counts are told apart only where their
signals differ by more than their spread.
"""

import argparse
import json
import os
from collections import Counter, defaultdict

import numpy as np
import torch

import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)
from arr_coc_shapes import make_item
from arr_coc.paths import EMBEDDED_MODEL as DEFAULT_CHECKPOINT
from arr_coc.qwen.processing import load_processor
from arr_coc_shapes.attention import SUPERVISED_SDPA, AttentionRecorder
from arr_coc_shapes.batching import Batcher, visual_tokens
from arr_coc_shapes.vlm_config import VLMTrainConfig


def count_items(n: int, seed: int = VLMTrainConfig.val_seed) -> list:
    items, i = [], 0
    while len(items) < n:
        item = make_item(seed, "val", i, canvas=(448, 448))
        i += 1
        if item.record["type"] == "count":
            items.append(item)
    return items


def main() -> None:
    from transformers import Qwen2VLForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=DEFAULT_CHECKPOINT)
    parser.add_argument("--items", type=int, default=300, help="count questions (default: %(default)s)")
    args = parser.parse_args()
    with open(os.path.join(args.model, "training_log.json")) as f:
        heads = [tuple(h) for h in json.load(f)["config"]["count_heads"]]  # (layer, head, sink)
    model = Qwen2VLForConditionalGeneration.from_pretrained(args.model).eval()
    processor = load_processor(args.model)
    layers = defaultdict(tuple)
    for layer, h, _ in heads:
        layers[layer] += (h,)
    recorder = AttentionRecorder(model.model.language_model, dict(layers))
    model.model.language_model.set_attn_implementation(SUPERVISED_SDPA)
    batcher = Batcher(model, processor)
    signal = defaultdict(lambda: defaultdict(list))  # (layer, head, sink) -> n -> [(m_t, m_0)]
    answers = defaultdict(Counter)
    items = count_items(args.items)
    with torch.no_grad():
        for s in range(0, len(items), 16):
            chunk = items[s : s + 16]
            feats, grids = visual_tokens(model, processor, [it.image for it in chunk])
            qs = [[(it.record["question"], it.record["answers"][0], "count", [tuple(b) for b in it.record["boxes"]])]
                  for it in chunk]
            inputs, pos, mask, _, _, sup = batcher.build(feats, grids, qs, [torch.arange(h * w) for h, w in grids])
            rows, positions, index = sup.rows()
            recorder.request(rows, positions)
            hidden = model.model.language_model(inputs_embeds=inputs, position_ids=pos, attention_mask=mask).last_hidden_state
            recorder.rows = None
            for row, query, centres in sup.count:
                n = int(chunk[row].record["answers"][0])
                answers[n][processor.tokenizer.convert_ids_to_tokens(int(model.lm_head(hidden[row, query]).argmax()))] += 1
                for layer, h, sink in heads:
                    probs = recorder.probs[(layer, h)][index[(row, query)]]
                    signal[(layer, h, sink)][n].append((float(probs[centres].sum()), float(probs[0])))
    for (layer, h, sink), by_n in signal.items():
        print(f"head {layer}.{h}, sink {sink:g}:   n  items  centres  sink  elsewhere  signal (ideal)")
        for n in sorted(by_n):
            a = np.array(by_n[n])
            s = a[:, 0] / np.maximum(a.sum(1), 1e-9)
            print(f"{'':22s}{n:2d}  {len(a):5d}  {a[:, 0].mean():7.3f}  {a[:, 1].mean():.3f}  {1 - a.sum(1).mean():9.3f}"
                  f"  {s.mean():.3f} +- {s.std():.3f} ({n / (n + sink):.3f})")
    print("answers by n: " + "; ".join(f"{n}: " + " ".join(f"{a}x{c}" for a, c in answers[n].most_common(3))
                                       for n in sorted(answers)))


if __name__ == "__main__":
    main()
