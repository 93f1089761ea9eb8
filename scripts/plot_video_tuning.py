r"""The video fine-tune's losses against steps, from its training_log_video.json.

    python scripts/plot_video_tuning.py checkpoints/shapes-qwen2vl-video/training_log_video.json \
        --out docs/video_tuning.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def smooth(xs: list[float], k: int = 25) -> list[float]:
    return [sum(xs[max(0, i - k + 1): i + 1]) / len(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    data = json.loads(Path(args.log).read_text())
    log = data["log"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in log]
    for key, label in (("loss_video", "clips (ShapesVQA-video)"), ("loss_image", "images (ShapesVQA)")):
        if key in log[0]:
            ys = [r[key] for r in log]
            line, = ax.plot(steps, ys, lw=0.6, alpha=0.35)
            ax.plot(steps, smooth(ys), lw=2, color=line.get_color(), label=f"{label}, mean of 25 steps")
    ax.set_xlabel(f"step ({data['clips_per_step']} clips + {data['images_per_step']} images each; "
                  f"{log[-1]['seconds']:.0f} s on {data['device']})")
    ax.set_ylabel("answer cross-entropy")
    ax.set_yscale("log")
    ax.set_title(f"video fine-tune of the embedded model ({len(data['words_added'])} words added)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
