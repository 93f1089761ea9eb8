"""The served choice (what the vLLM plugin runs) on every example picture: ms per picture, any version of the code.

    OMP_NUM_THREADS=1 python scripts/experiments/served_photos.py [--checkout /path/to/other/checkout]

`arr_coc.choose` on the processor's patches (`PatchImages`), as the plugin's `served_choice` calls it: the shipped
before-mode layer, 10% of each picture's cells (`budget_mode="exact"`), the question "What is in the picture?".
Each picture alone, two warm-up calls, then the median of --repeats on this process's CPU clock. --checkout runs
another version of the library (a `git worktree` of an older commit) with this script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", default=str(Path(__file__).resolve().parents[2]),
                   help="the checkout whose library runs (default: this one)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    root = Path(args.checkout).resolve()
    sys.path.insert(0, str(root))

    import torch
    from PIL import Image

    import arr_coc
    from arr_coc import ARRCOC
    from arr_coc.core.layer import build_layer
    from arr_coc.pipeline.pure import choose
    from arr_coc.qwen.pixels import PatchImages

    torch.set_num_threads(args.threads)
    print(f"library: {arr_coc.__file__}")
    layer_dir = str(root / "checkpoints/arr-coc-shapes-before")
    vlm = ARRCOC.from_pretrained(str(root / "checkpoints/shapes-qwen2vl"), arr_coc=layer_dir, adapter=False)
    backend = vlm.backend
    images, tokenizer = backend.processor.image_processor, backend.processor.tokenizer
    layer = build_layer(layer_dir, int(backend.model.config.text_config.hidden_size)).float().eval()
    embed = backend.model.get_input_embeddings()
    question = [tokenizer("What is in the picture?")["input_ids"]]
    print("| picture | cells | ms per picture |\n|---|---|---|")
    for path in sorted((root / "assets/examples").glob("*.*g")):
        out = images(images=[Image.open(path).convert("RGB")], return_tensors="pt")
        thw = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        grid = [(h // 2, w // 2) for _, h, w in thw]

        def run():
            with torch.inference_mode():
                return choose(PatchImages(out["pixel_values"], list(thw), images), grid, question, embed, layer=layer,
                              method="arr_coc", budget=[max(1, grid[0][0] * grid[0][1] // 10)], budget_mode="exact",
                              seed=0, pad_token_id=0, strict=True)

        run(), run()
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            run()
            times.append(time.process_time() - t0)
        print(f"| `{path.name}` | {grid[0][0]} x {grid[0][1]} | {1e3 * statistics.median(times):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
