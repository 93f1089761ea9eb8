"""Plot an embedded-model training run: validation accuracy per question type and the losses.

    python scripts/plot_training.py checkpoints/shapes-qwen2vl/training_log.json docs/training_curve.png

Several logs (runs warm-started one from the other with --init) are drawn end to end, with
a dotted line where each continuation starts:

    python scripts/plot_training.py LOG1 LOG2 ... OUT.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(log_paths: list[str], out: str) -> None:
    log, offset, starts = [], 0.0, []
    for path in log_paths:
        with open(path) as f:
            run = json.load(f)["log"]
        starts.append(offset)
        log += [dict(r, minutes=r["minutes"] + offset) for r in run]
        offset = log[-1]["minutes"] if log else offset
    vals = [r for r in log if "val" in r]
    steps = [r for r in log if "val" not in r]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
    if vals:
        x = [r["minutes"] for r in vals]
        ax_acc.plot(x, [r["val"]["accuracy"] for r in vals], "k-o", lw=2.5, label="overall")
        for qtype in vals[0]["val"]["per_type"]:
            ax_acc.plot(x, [r["val"]["per_type"][qtype] for r in vals], "-o", ms=3, label=qtype)
    ax_acc.axhline(0.9, color="grey", ls=":", lw=1)
    for ax in (ax_acc, ax_loss):
        for start in starts[1:]:
            ax.axvline(start, color="grey", ls=":", lw=1)
    ax_acc.set(xlabel="training minutes" if len(starts) > 1 else "training minutes (this run)", ylabel="validation accuracy, all tokens", ylim=(0, 1.02),
               title="answers per question type")
    ax_acc.legend(fontsize=8, loc="lower right")
    x = [r["minutes"] for r in steps]
    for key, label in (("loss_answer", "answer CE"), ("loss_attn", "attention supervision"),
                       ("loss_dense", "vision dense loss")):
        ys = [r[key] for r in steps]
        if any(ys):
            ax_loss.plot(x, ys, label=label)
    ax_loss.set(xlabel="training minutes" if len(starts) > 1 else "training minutes (this run)", ylabel="loss", title="training losses")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", metavar="PATH",
                        help="LOG [LOG ...] OUT.png: training logs drawn end to end, then the picture to write (default: the embedded "
                             "model's log, docs/training_curve.png)")
    paths = parser.parse_args().paths or ["checkpoints/shapes-qwen2vl/training_log.json", "docs/training_curve.png"]
    if len(paths) < 2:
        parser.error("give at least one LOG and the OUT.png to write")
    main(paths[:-1], paths[-1])
