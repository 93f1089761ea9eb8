"""How the tension balancer weighs the three scorers from question to question.

    python scripts/experiments/balancer_weights.py [--data data/val/val.jsonl] [--n 40] [--budget 0.1]

Runs the first N questions of a ShapesVQA JSONL through the embedded model with the trained
layer (checkpoints/arr-coc-shapes) and with the untrained one, and prints the range and mean
of each balancer weight (information, perspectival, participatory) over those questions.
"""

import argparse

import torch

from arr_coc.data.jsonl import read_jsonl
from arr_coc.paths import EMBEDDED_MODEL as DEFAULT_CHECKPOINT
from arr_coc import ARRCOC

NAMES = ("information", "perspectival", "participatory")


def weights_over(wrapper: ARRCOC, records, budget: float) -> torch.Tensor:
    """[N, 3] balancer weights, one row per question."""
    rows = []
    for rec in records:
        _, trace = wrapper.generate(rec.load_image(), rec.question, budget=budget, max_new_tokens=1)
        rows.append(trace.arr_coc.weights[0])
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_CHECKPOINT)
    parser.add_argument("--layer", default="checkpoints/arr-coc-shapes", help="trained ARR-COC weights")
    parser.add_argument("--data", default="data/val/val.jsonl")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--budget", type=float, default=0.1)
    args = parser.parse_args()
    records = read_jsonl(args.data)[: args.n]
    for label, layer in (("trained", args.layer), ("untrained", None)):
        w = weights_over(ARRCOC.from_pretrained(args.model, arr_coc=layer), records, args.budget)
        print(f"{label} layer, {len(records)} questions of {args.data} at budget {args.budget:g}:")
        for k, name in enumerate(NAMES):
            col = w[:, k]
            print(f"  {name:13s} {col.min():.2f}-{col.max():.2f} (mean {col.mean():.2f})")


if __name__ == "__main__":
    main()
