r"""What an `eval` configuration would cost on a real model's shape: per item, at full depth, from `bench`.

    python -m arr_coc bench --preset qwen2-vl-2b --encode after,before --budgets 0.02,0.05,0.1,0.2,0.3,0.5,1.0 \
        --repeats 3 --out bench_2b.json
    python -m arr_coc eval --data data/shapes/test.jsonl --methods arr_coc_trained --budgets 0.08,0.24 \
        --encode before --out t_ship.json
    python scripts/cost_at_width.py bench_2b.json t_ship.json@0.08 t_ship.json@0.24 --markdown cost_2b.md

A before-mode row's cost depends on how many cells each item encodes and how many tokens its language
model reads, and attention makes it grow faster than linearly in both, so the cost of a configuration is
the mean of its items' costs, not the cost at its mean share. `bench` counts the full-depth FLOPs of the
tower and of the LM prefill at a few token counts of one shape (896 x 896: 1,024 cells); both are
polynomials of degree 2 in the count (linear layers and attention), so three before-mode rows fix each
exactly, and the other rows check it (the largest relative residual is printed). Each item of the eval
row (`item_encoded`, `item_kept`, `item_total` in its results.json) is mapped to the shape's grid by
its shares of its own grid, and costed. ARR-COC's own FLOPs are the before-mode rows' mean.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


def quadratic(xs: list[float], ys: list[float]) -> tuple[np.poly1d, float]:
    """The degree-2 least-squares fit and its largest relative residual over the points."""
    fit = np.poly1d(np.polyfit(xs, ys, 2))
    return fit, max(abs(fit(x) - y) / y for x, y in zip(xs, ys))


@dataclass
class WidthCost:
    """Full-depth FLOPs of one `bench` shape as functions of what an item encodes and reads."""

    preset: str
    grid: int             # the shape's cells (896 x 896: 1,024)
    full: float           # the full model's whole prefill (the after-mode row that keeps every token)
    vision: np.poly1d     # cells encoded -> tower FLOPs
    lm: np.poly1d         # tokens read -> LM prefill FLOPs
    own: float            # ARR-COC's own FLOPs per item
    residual: tuple[float, float]   # largest relative residuals of the two fits
    rows: int

    @classmethod
    def from_bench(cls, bench: dict) -> WidthCost:
        pruned = [r for r in bench["results"] if r["encode"] == "before" and not r["gist"] and not r["margin"]
                  and not r["windows"] and r["visual_tokens"] < r["visual_tokens_full"]]
        if len(pruned) < 4:
            raise SystemExit("the bench needs at least 4 before-mode rows below 100% without gist, margin or windows "
                             "(3 fix each quadratic, the rest check it)")
        ref = next(r for r in bench["results"] if r["encode"] == "after" and r["visual_tokens"] == r["visual_tokens_full"])
        vision, v_err = quadratic([r["encoded_tokens"] for r in pruned], [r["vision_flops_full"] for r in pruned])
        lm, l_err = quadratic([r["visual_tokens"] for r in pruned], [r["prefill_flops_full"] for r in pruned])
        return cls(bench["preset"], ref["visual_tokens_full"], ref["e2e_flops_full"], vision, lm,
                   float(np.mean([r["arr_coc_flops"] for r in pruned])), (v_err, l_err), len(pruned))

    def shares(self, encoded: Sequence[int], kept: Sequence[int], total: Sequence[int]) -> np.ndarray:
        """Per item: its whole prefill on this shape over the full model's, its counts scaled to this grid."""
        scale = self.grid / np.asarray(total, dtype=float)
        enc, read = np.round(np.asarray(encoded) * scale), np.round(np.asarray(kept) * scale)
        return (self.vision(enc) + self.lm(read) + self.own) / self.full


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", help="bench results JSON (before-mode rows without gist or margin, and the reference)")
    p.add_argument("rows", nargs="+", help="RESULTS.json@BUDGET[@METHOD] (default method: arr_coc_trained)")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)

    cost = WidthCost.from_bench(json.loads(Path(args.bench).read_text()))
    lines = [f"{cost.preset} shape ({cost.grid} cells), full depth; full prefill {cost.full / 1e12:.2f} TFLOPs. "
             f"Fits over {cost.rows} before-mode rows: largest relative residual {cost.residual[0]:.1e} (tower), "
             f"{cost.residual[1]:.1e} (LM).", "",
             "| row | budget | items | kept (of its grid) | e2e share, mean over items | at the mean counts | "
             "items over 15% / 25% |", "|---|---|---|---|---|---|---|"]
    for spec in args.rows:
        path, budget, *method = spec.split("@")
        method = method[0] if method else "arr_coc_trained"
        report = json.loads(Path(path).read_text())
        row = next((r for r in report["results"] if r["method"] == method and float(r["budget"]) == float(budget)),
                   None)
        if row is None or "item_kept" not in row:
            raise SystemExit(f"{path}: no row {method}@{budget} with per-item counts (item_kept; eval writes them "
                             "since 2026-11-25)")
        shares = cost.shares(row["item_encoded"], row["item_kept"], row["item_total"])
        at_mean = cost.shares([np.mean(row["item_encoded"])], [np.mean(row["item_kept"])],
                              [np.mean(row["item_total"])])[0]
        lines.append(f"| {method} ({row.get('encode', 'after')}) | {budget} | {len(shares)} | {row['kept_share']:.3f} | "
                     f"**{shares.mean():.3f}** | {at_mean:.3f} | {(shares > 0.15).mean():.1%} / "
                     f"{(shares > 0.25).mean():.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
