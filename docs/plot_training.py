"""Plot an embedded-model training run: validation accuracy per question type and the losses.

    python docs/plot_training.py checkpoints/shapes-qwen2vl/training_log.json docs/training_curve.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(log_path: str, out: str) -> None:
    with open(log_path) as f:
        log = json.load(f)["log"]
    vals = [r for r in log if "val" in r]
    steps = [r for r in log if "val" not in r]
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.2), dpi=110)
    if vals:
        x = [r["minutes"] for r in vals]
        ax_acc.plot(x, [r["val"]["accuracy"] for r in vals], "k-o", lw=2.5, label="overall")
        for qtype in vals[0]["val"]["per_type"]:
            ax_acc.plot(x, [r["val"]["per_type"][qtype] for r in vals], "-o", ms=3, label=qtype)
    ax_acc.axhline(0.9, color="grey", ls=":", lw=1)
    ax_acc.set(xlabel="training minutes (this run)", ylabel="validation accuracy, all tokens", ylim=(0, 1.02),
               title="answers per question type")
    ax_acc.legend(fontsize=8, loc="lower right")
    x = [r["minutes"] for r in steps]
    for key, label in (("loss_answer", "answer CE"), ("loss_attn", "attention supervision"),
                       ("loss_dense", "vision dense loss")):
        ys = [r[key] for r in steps]
        if any(ys):
            ax_loss.plot(x, ys, label=label)
    ax_loss.set(xlabel="training minutes (this run)", ylabel="loss", title="training losses")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/shapes-qwen2vl/training_log.json",
         sys.argv[2] if len(sys.argv) > 2 else "docs/training_curve.png")
