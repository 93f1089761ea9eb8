r"""Paired comparisons on a ShapesVQA-video `eval` report: every row against the full model and against an anchor
at the same budget, overall and on the questions that name an object (their template holds "{shape}").

    python scripts/experiments/video_paired.py runs/video_eval_2000.json --anchor evs [--markdown pairs.md]

Needs a report with per-clip `correct` (eval writes it since the video fine-tune); intervals: paired 95%
(`arr_coc.evaluation.report.paired_stats`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from arr_coc.evaluation.report import paired_stats
    from arr_coc_shapes.video.spec import VIDEO_TEMPLATES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report")
    p.add_argument("--anchor", default="evs")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    rows = report["results"]
    if "correct" not in rows[0]:
        raise SystemExit(f"{args.report} has no per-clip `correct`: rerun eval with this version")
    named = {t for t, text in VIDEO_TEMPLATES.items() if "{shape}" in text}
    on_named = [i for i, t in enumerate(report["qtypes"]) if t in named]
    full = next(r for r in rows if r["method"] == "none")

    def fmt(a: list[float], b: list[float]) -> str:
        d = paired_stats(a, b)
        return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"

    pick = lambda xs: [xs[i] for i in on_named]   # noqa: E731
    lines = [f"{report['n']} clips, {len(on_named)} of them name an object ({', '.join(sorted(named))}); full model "
             f"{full['accuracy']:.3f} (named {sum(pick(full['correct'])) / len(on_named):.3f})", "",
             f"| method | encode | budget | cost | accuracy | of full | vs full | named: accuracy | named: vs {args.anchor} "
             "at the same budget |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r is full:
            continue
        anchor = next((a for a in rows if a["method"] == args.anchor and a["budget"] == r["budget"] and a is not r), None)
        vs_anchor = "" if anchor is None else fmt(pick(r["correct"]), pick(anchor["correct"])) + \
            f" ({args.anchor} costs {anchor['cost']:.3f})"
        lines.append(f"| {r['method']} | {r['encode']} | {r['budget']} | {r['cost']:.3f} | {r['accuracy']:.3f} | "
                     f"{r['accuracy'] / full['accuracy']:.1%} | {fmt(r['correct'], full['correct'])} | "
                     f"{sum(pick(r['correct'])) / len(on_named):.3f} | {vs_anchor} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
