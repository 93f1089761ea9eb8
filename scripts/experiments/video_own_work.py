r"""ARR-COC's own work on a video clip against the whole prefill, wall time, one clip at a time.

    OMP_NUM_THREADS=1 python scripts/experiments/video_own_work.py --data data/shapes_video/test.jsonl --limit 40

For each clip: `generate` with every token (the baseline's whole prefill: vision tower + LM prefill), then
ARR-COC before the tower at --budget with the shipped before-mode layer. ARR-COC's own work is the trace's
`arr_coc_s` (selection over every temporal group + the temporal allocation + packing). Prints medians over the
clips and the median per-clip share of ARR-COC's own work in the baseline's whole prefill.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    from arr_coc.evaluation.items import read_items
    from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_BEFORE_LAYER
    from arr_coc import ARRCOC
    from arr_coc.runtime import keep_large_buffers

    keep_large_buffers()
    vlm = ARRCOC.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_BEFORE_LAYER)
    rows = []
    for k, item in enumerate(read_items(args.data, args.limit + args.warmup)):
        clip = item.load()
        _, full = vlm.generate(clip, item.question, method="none", max_new_tokens=1)
        _, mine = vlm.generate(clip, item.question, budget=args.budget, encode="before", max_new_tokens=1)
        if k >= args.warmup:
            whole = full.vision_s + full.prefill_s
            rows.append({"frames": clip.num_frames, "tokens": full.total_tokens, "whole_s": whole,
                         "own_s": mine.arr_coc_s, "before_whole_s": mine.vision_s + mine.arr_coc_s + mine.prefill_s})
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(f"{len(rows)} clips, median {med('frames')} frames, {med('tokens')} visual tokens")
    print(f"baseline whole prefill (vision + LM): median {1000 * med('whole_s'):.1f} ms")
    print(f"ARR-COC's own work (before, {args.budget:g}): median {1000 * med('own_s'):.1f} ms, "
          f"share of the baseline's whole prefill: median {statistics.median(r['own_s'] / r['whole_s'] for r in rows):.3f}")
    print(f"before-mode whole prefill (vision + own work + LM): median share of the baseline "
          f"{statistics.median(r['before_whole_s'] / r['whole_s'] for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
