"""Plot ARR-COC scorer training (stage 1 then stage 2): validation coverage and the losses.

    python scripts/plot_arr_coc_training.py checkpoints/arr-coc-shapes docs/arr_coc_training.png

Reads `training_log_stage1.json` and `training_log_stage2.json` from the folder; stage 2's
steps continue stage 1's on the x axis.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _smooth(ys, k=15):
    out, acc = [], []
    for y in ys:
        acc = (acc + [y])[-k:]
        out.append(sum(acc) / len(acc))
    return out


def main(folder: str, out: str) -> None:
    logs = []
    for stage in (1, 2):
        path = os.path.join(folder, f"training_log_stage{stage}.json")
        if os.path.isfile(path):
            with open(path) as f:
                run = json.load(f)
            note = f", validated on {run['val_items']} held-out items" if "val_items" in run else ""
            logs.append((stage, run["log"], note))
    if not logs:
        raise SystemExit(f"no training_log_stage1.json / training_log_stage2.json in {folder}")
    fig, (ax_cov, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
    offset = 0
    for stage, log, note in logs:
        vals = [r for r in log if "val_coverage" in r]
        for budget, colour in zip(("0.05", "0.1", "0.25"), ("tab:red", "tab:orange", "tab:green")):
            ax_cov.plot([offset + r["step"] for r in vals], [r["val_coverage"][budget] for r in vals], "-o", ms=3,
                        color=colour, label=f"{float(budget) * 100:g}% budget" if stage == logs[0][0] else None)
        x = [offset + r["step"] for r in log]
        if stage == 1:
            ax_loss.plot(x, _smooth([r["loss"] for r in log]), color="tab:blue", label="stage 1 ranking loss")
        else:
            ax_loss.plot(x, _smooth([r["answer_loss"] for r in log]), color="tab:purple",
                         label="stage 2 answer CE (frozen VLM)")
            if "ranking_loss" in log[0]:
                ax_loss.plot(x, _smooth([r["ranking_loss"] for r in log]), color="tab:blue", ls="--",
                             label="stage 2 ranking term")
        for ax in (ax_cov, ax_loss):
            ax.axvline(offset, color="grey", ls=":", lw=1)
        ax_cov.text(offset + 3, 0.02 + 0.06 * (stage - 1), f"stage {stage}{note}",  # the empty bottom of the panel
                    transform=ax_cov.get_xaxis_transform(), fontsize=8, color="grey")
        offset += log[-1]["step"]
    ax_cov.set(xlabel="step", ylabel="share of the answer's box area kept", ylim=(0, 1.02),
               title="validation coverage of the answer's area (top-k of relevance)")
    ax_cov.legend(fontsize=8, loc="center right")
    ax_loss.set(xlabel="step", ylabel="loss (moving mean of 15 steps)", title="training losses")
    ax_loss.legend(fontsize=8)
    for ax in (ax_cov, ax_loss):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a layer's folder holding training_log_stage1.json / training_log_stage2.json")
    parser.add_argument("out", help="the picture to write (.png)")
    args = parser.parse_args()
    main(args.folder, args.out)
