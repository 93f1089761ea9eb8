"""``python -m arr_coc train-saccade``: train the saccade gate (when to look again) against the frozen VLM.

    python -m arr_coc train-saccade --data data/val/val.jsonl --budget 0.03 --saccade-budget 0.05 \\
        --out checkpoints/arr-coc-saccade [--signal auto] [--target next] [--rows rows.jsonl]

Every item takes two looks (`arr_coc.training.saccade.collect`; the rows are written to OUT/rows.jsonl and
reused with --rows), the signal that best predicts a wrong first answer is chosen (--signal auto: the higher
AUROC), the soft gate is trained (OUT/train_log.jsonl, one line per step) and written as OUT/gate.json with
its measurements; OUT/frontier.png draws accuracy against cost for every threshold, with the trained one
marked. `eval --encode before --passes 2 --saccade-gate OUT` then runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .args import add_runtime, budget_arg, runtime


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="a ShapesVQA-style JSONL split to train on (not the test split)")
    parser.add_argument("--limit", type=int, default=None, help="first N items only")
    parser.add_argument("--model", default=None, help="VLM folder or hub id (default: the embedded model)")
    parser.add_argument("--arr-coc", default=None, help="ARR-COC layer (default: the shipped before-mode layer)")
    parser.add_argument("--budget", type=budget_arg, default=0.03, help="the first look's budget (default: 0.03)")
    parser.add_argument("--saccade-budget", type=budget_arg, default=0.05, help="cells a saccade adds (default 0.05)")
    parser.add_argument("--target", choices=("next", "ring", "grow"), default="next", help="which cells a saccade adds")
    parser.add_argument("--no-memory", action="store_true",
                        help="a saccade's cells form a tower segment of their own (default: they attend to the first "
                             "look's keys and values, Qwen2-VL / Qwen3-VL)")
    parser.add_argument("--signal", choices=("auto", "margin", "entropy"), default="auto",
                        help="the uncertainty the gate reads (auto: the one that predicts a wrong answer best)")
    parser.add_argument("--target-rate", type=float, default=0.3, help="the share of items meant to look again")
    parser.add_argument("--cost-weight", type=float, default=1.0, help="weight of the second look's cost")
    parser.add_argument("--rate-weight", type=float, default=1.0, help="weight of (saccade rate - target)^2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rows", default=None, help="reuse collected rows (a rows.jsonl) instead of running the VLM")
    parser.add_argument("--out", default="checkpoints/arr-coc-saccade", help="output folder (default: %(default)s)")
    add_runtime(parser)


def run(args: argparse.Namespace) -> int:
    from arr_coc.saccade import SaccadeConfig, write_gate
    from arr_coc.training.saccade import auroc, collect, fit, frontier

    config = SaccadeConfig(passes=2, budget=args.saccade_budget, target=args.target, memory=not args.no_memory)
    os.makedirs(args.out, exist_ok=True)
    if args.rows:
        with open(args.rows) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = _collect(args, config, collect)
        with open(os.path.join(args.out, "rows.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if not rows:
        print("train-saccade: error: no items", file=sys.stderr)
        return 2
    wrong = [r["correct_1"] < 1 for r in rows]
    scores = {s: auroc([r[f"u_{s}"] for r in rows], wrong) for s in ("margin", "entropy")}
    signal = max(scores, key=lambda s: scores[s]) if args.signal == "auto" else args.signal
    before = {s: auroc([r[f"u_{s}"] for r in rows], wrong) for s in ("spread", "extent") if f"u_{s}" in rows[0]}
    with open(os.path.join(args.out, "train_log.jsonl"), "w") as log:
        gate, lines = fit(rows, signal, steps=args.steps, cost_weight=args.cost_weight, rate_weight=args.rate_weight,
                          target_rate=args.target_rate, log=log)
    trained = SaccadeConfig(passes=2, budget=args.saccade_budget, target=args.target, signal=signal,
                            memory=config.memory).with_gate(gate)
    curve = frontier(rows, signal)
    point = frontier(rows, signal, [trained.threshold])[0]
    one = frontier(rows, signal, [2.0])[0]
    file = write_gate(args.out, trained, {
        "trained_on": args.data, "items": len(rows), "first_look_budget": args.budget, "auroc": scores,
        "auroc_before_answering": before,
        "at_trained_threshold": point, "one_look": one, "final_loss": lines[-1]})
    _plot(curve, point, one, signal, os.path.join(args.out, "frontier.png"))
    print(f"auroc of a wrong first answer: margin {scores['margin']:.3f}, entropy {scores['entropy']:.3f} -> {signal}"
          + "".join(f"; {k} (before answering) {v:.3f}" for k, v in before.items()))
    print(f"one look: accuracy {one['accuracy']:.4f} at {100 * one['cost']:.2f}% of the full prefill")
    print(f"trained gate (threshold {trained.threshold:.4f}, sharpness {trained.sharpness:.1f}): accuracy "
          f"{point['accuracy']:.4f} at {100 * point['cost']:.2f}%, {100 * point['saccade_share']:.1f}% of items look again")
    print(f"wrote {file}")
    return 0


def _collect(args: argparse.Namespace, config, collect) -> list[dict]:
    from arr_coc.data import read_jsonl
    from arr_coc.evaluation.loop import load_vlm
    from arr_coc.paths import EMBEDDED_MODEL, resolve_layer
    from arr_coc.encode import EncodeConfig

    run_on = runtime(args)
    model = args.model or EMBEDDED_MODEL
    layer = args.arr_coc or resolve_layer(model, None, EncodeConfig(mode="before"))
    records = read_jsonl(args.data)[: args.limit]
    vlm = load_vlm(model, run_on.device, dtype=run_on.dtype, attn_implementation=run_on.attn_implementation,
                   arr_coc=layer)
    return collect(vlm, records, args.budget, config, batch_size=args.batch_size)


def _plot(curve: list[dict], point: dict, one: dict, signal: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * c["cost"] for c in curve], [c["accuracy"] for c in curve], "-", lw=1, label=f"every threshold ({signal})")
    ax.plot([100 * one["cost"]], [one["accuracy"]], "ks", label="one look")
    ax.plot([100 * point["cost"]], [point["accuracy"]], "r*", ms=12, label="trained gate")
    ax.set_xlabel("whole-prefill FLOPs, % of the full model")
    ax.set_ylabel("accuracy")
    ax.set_title("two looks: the gate's threshold trades cost for accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
