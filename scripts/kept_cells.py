r"""Which cells the shipped ARR-COC layers keep on a split, and where two versions of the code differ.

    # dump (run once with each version of the code; only the public API is used)
    python scripts/kept_cells.py dump --data data/shapes/test.jsonl --out runs/kept_new.json
    # compare: every item whose kept cells differ, with the old relevance gap at the budget's boundary
    python scripts/kept_cells.py compare runs/kept_old.json runs/kept_new.json

Each dump imports the checkout it sits in (this file's parent folder, ahead of an installed or editable copy) and
records which code that was (folder, commit, uncommitted changes); `compare` says so when both dumps ran the same
code, which compares a version with itself.

The dump runs `ARRCOC.prepare` on the embedded model in batches of --batch items, with the shipped layer of
each encode mode ("after": checkpoints/arr-coc-shapes reading the encoded tokens; "before":
checkpoints/arr-coc-shapes-before, no gist) at the README's budgets in the layer's default budget mode, and
records per item the kept raster indices, the budget kept, and `gap`: the relevance of the lowest kept cell
minus that of the highest unkept one (a decision that flips between two versions at a gap near float32's
resolution is a tie, not a change of behaviour).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # this checkout's arr_coc, not the one pip installed (editable or not)

BUDGETS = {"after": (0.05, 0.1), "before": (0.03, 0.05, 0.08, 0.24, 0.5)}
LAYERS = {"after": "checkpoints/arr-coc-shapes", "before": "checkpoints/arr-coc-shapes-before"}


def _gap(relevance, kept) -> float | None:
    """Lowest kept relevance minus highest unkept (None when every cell is kept)."""
    import torch

    flat = relevance.reshape(-1).double()
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask[kept] = True
    if bool(mask.all()):
        return None
    return float(flat[mask].min() - flat[~mask].max())


def _code() -> dict:
    """Which code a dump ran: the imported package's folder, its checkout's commit and whether it had changes."""
    import arr_coc

    folder = Path(arr_coc.__file__).resolve().parent

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", "-C", str(folder), *cmd], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"package": str(folder), "commit": git("rev-parse", "HEAD"), "changed": bool(git("status", "--porcelain"))}


def dump(args: argparse.Namespace) -> None:
    import torch
    from PIL import Image

    from arr_coc.data.jsonl import read_jsonl
    from arr_coc import ARRCOC

    torch.set_num_threads(args.threads)
    records = read_jsonl(args.data)[: args.limit]
    out: dict = {"data": args.data, "code": _code(), "rows": {}}
    t0 = time.perf_counter()
    for mode in args.modes.split(","):
        vlm = ARRCOC.from_pretrained("checkpoints/shapes-qwen2vl", arr_coc=LAYERS[mode])
        for budget in BUDGETS[mode]:
            row = out["rows"][f"{mode} {budget:g}"] = {}
            for start in range(0, len(records), args.batch):
                chunk = records[start:start + args.batch]
                images = [[Image.open(r.image).convert("RGB")] for r in chunk]
                inputs = vlm.backend.build_inputs(images, [r.question for r in chunk])
                _, traces = vlm.prepare(inputs, budget=budget, encode=mode).outputs
                for r, tr in zip(chunk, traces):
                    kept = tr.kept_indices[0]
                    row[r.id] = {"kept": kept.tolist(), "grid": list(tr.grid_hw[0]), "fallback": tr.fallback[0],
                                 "gap": _gap(tr.arr_coc.relevance[0], kept)}
            print(f"{mode} {budget:g}: {len(records)} items, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f)


def compare(args: argparse.Namespace) -> int:
    dumps = [json.load(open(p)) for p in (args.old, args.new)]
    for path, d in zip((args.old, args.new), dumps):
        print(f"{path}: {d.get('code', 'code not recorded')}")
    codes = [d.get("code") for d in dumps]
    if codes[0] is not None and codes[0] == codes[1] and not codes[0]["changed"]:
        print("both dumps ran the same code: this compares a version with itself")
    old, new = (d["rows"] for d in dumps)
    differing = 0
    for row in old:
        items = old[row]
        diff = [i for i in items if items[i]["kept"] != new[row][i]["kept"]]
        differing += len(diff)
        gaps = [abs(items[i]["gap"] - new[row][i]["gap"]) for i in items
                if items[i]["gap"] is not None and new[row][i]["gap"] is not None]
        print(f"{row}: {len(items) - len(diff)} of {len(items)} items keep the same cells; "
              f"{sum(g == 0 for g in gaps)} of {len(gaps)} boundary gaps identical, the largest moved by "
              f"{max(gaps, default=0.0):.2g}")
        for i in diff:
            a, b = set(items[i]["kept"]), set(new[row][i]["kept"])
            print(f"  {i}: {len(a)} -> {len(b)} kept, {len(a - b)} out / {len(b - a)} in; old gap {items[i]['gap']}, "
                  f"new gap {new[row][i]['gap']}; fallback {items[i]['fallback']} -> {new[row][i]['fallback']}")
    return 0 if differing == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--data", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--modes", default="after,before")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--limit", type=int, default=None)
    d.add_argument("--threads", type=int, default=1)
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
