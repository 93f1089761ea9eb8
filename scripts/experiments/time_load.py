"""Where a fresh process's time goes before the embedded model answers its first question.

    python scripts/experiments/time_load.py [checkpoints/shapes-qwen2vl] [--repeat 3]

Each repeat is a new Python process, so every import is paid again (bytecode caches are warm).
Prints seconds for: importing torch, importing transformers' Qwen2-VL modules (the modeling
module and the loader that `from_pretrained` imports lazily), importing arr_coc, loading the
checkpoint, and answering one generated question at a 25% budget.
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers.core_model_loading
from transformers import Qwen2VLForConditionalGeneration
t2 = time.perf_counter()
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the checkout's root: arr_coc_shapes/ (not installed)
from arr_coc_shapes import make_item
from arr_coc import ARRCOC
t3 = time.perf_counter()
wrapper = ARRCOC.from_pretrained(sys.argv[1])
t4 = time.perf_counter()
item = make_item(4242, "regress", 0)
answer, _ = wrapper.generate(item.image, item.record["question"], budget=0.25, max_new_tokens=4)
t5 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "transformers": t2 - t1, "arr_coc": t3 - t2, "load": t4 - t3,
                  "answer": t5 - t4}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="checkpoints/shapes-qwen2vl")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeat):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'':>14}" + "".join(f"{i + 1:>8}" for i in range(len(runs))))
    for key in runs[0]:
        print(f"{key:>14}" + "".join(f"{r[key]:8.2f}" for r in runs))
    own = [r["load"] + r["answer"] for r in runs]
    total = [sum(r.values()) for r in runs]
    print(f"{'load+answer':>14}" + "".join(f"{x:8.2f}" for x in own))
    print(f"{'fresh process':>14}" + "".join(f"{x:8.2f}" for x in total))


if __name__ == "__main__":
    main()
