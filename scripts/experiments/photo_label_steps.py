"""How many label steps the object group's masks need, and how many components they have, on any pictures: how
often a GPU's fixed steps (`components.STEPS`, `components.CAP`) make the layer redo its pass.

    python scripts/experiments/photo_label_steps.py PICTURE... [--sides 448,896] [--out steps.json]

Each picture is resized so that its longer side is --sides (in whole 28 px cells), run through the shipped
before-mode layer's pass, and its object mask (what `components.object_channels` receives) labelled to
convergence. A step is counted when it runs, the last one changing nothing, so a mask that 4 fixed steps settle
counts at most 4. The step as it is ("now") is counted beside two variants that reach the same labels: a second
pointer jump per step ("2jumps"), and a jump after each of the two run spreadings ("interleaved"). The photos in
RESULTS.md are scikit-image's data pictures (`pip download --no-deps scikit-image`, then unzip its skimage/data/)
and the examples' photos.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from PIL import Image

import arr_coc.core.components as components
import arr_coc.core.texture as texture
from arr_coc.core.layer import ARRCOCLayer

LAYER = "checkpoints/arr-coc-shapes-before"


def object_mask(layer: ARRCOCLayer, picture: Image.Image, side: int) -> torch.Tensor:
    """[1, H, W] bool: the object group's mask of `picture` with its longer side resized to `side`."""
    w, h = picture.size
    scale = side / max(w, h)
    width, height = max(28, round(w * scale / 28) * 28), max(28, round(h * scale / 28) * 28)
    picture = picture.convert("RGB").resize((width, height), Image.BICUBIC)
    query = torch.randn(16, layer.config.knowing.query_dim, generator=torch.Generator().manual_seed(0))
    work = layer.batch([picture], [(height // 28, width // 28)], [query])
    seen = []
    real = texture.object_channels

    def spy(mask, *args, **kwargs):
        seen.append(mask.clone())
        return real(mask, *args, **kwargs)

    texture.object_channels = spy
    try:
        with torch.no_grad():
            layer.device_pass(work, layer.allocator.plan(work.grid, 0.1))
    finally:
        texture.object_channels = real
    return seen[-1]


def _jump(label: torch.Tensor, inside: torch.Tensor, big: int) -> torch.Tensor:
    return torch.where(inside, torch.minimum(label, label.index_select(0, label.clamp(max=big - 1))), big)


def steps_needed(mask: torch.Tensor, variant: str, most: int = 100) -> int | None:
    """The steps `variant` runs until a step changes no label (that step included); None past `most`."""
    big = mask.numel()
    inside = mask.reshape(-1)
    label = torch.where(inside, torch.arange(big), big)
    rows, cols = components._run_ids(mask, 2), components._run_ids(mask, 1)
    for step in range(1, most + 1):
        if variant == "interleaved":
            new = _jump(components._spread(_jump(components._spread(label, rows, big), inside, big), cols, big),
                        inside, big)
        else:
            new = _jump(components._spread(components._spread(label, rows, big), cols, big), inside, big)
            if variant == "2jumps":
                new = _jump(new, inside, big)
        if torch.equal(new, label):
            return step
        label = new
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pictures", nargs="+")
    p.add_argument("--sides", default="448,896", help="longer sides to resize to, px")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    args = p.parse_args()
    layer = ARRCOCLayer.from_pretrained(LAYER)
    rows = []
    for path in args.pictures:
        picture = Image.open(path)
        for side in (int(s) for s in args.sides.split(",")):
            mask = object_mask(layer, picture, side)
            labels, _ = components.label_components(mask, None)
            areas = torch.bincount(labels[labels >= 0])
            row = {"picture": Path(path).name, "side": side, "foreground": round(float(mask.float().mean()), 3),
                   "components": int((areas >= components.MIN_AREA).sum()),
                   **{v: steps_needed(mask, v) for v in ("now", "2jumps", "interleaved")}}
            rows.append(row)
            print(row, flush=True)
    print(f"fixed steps {components.STEPS}, cap {components.CAP}; no redo = converged within the steps and at most "
          "cap components")
    for side in sorted({r["side"] for r in rows}):
        at = [r for r in rows if r["side"] == side]
        settles = [r for r in at if r["now"] is not None]
        no_redo = {v: sum(r[v] is not None and r[v] <= components.STEPS and r["components"] <= components.CAP
                          for r in at) for v in ("now", "2jumps", "interleaved")}
        print(f"{side} px: {len(at)} pictures, steps median {statistics.median(r['now'] for r in settles)}, "
              f"max {max(r['now'] for r in settles)}; no redo: {no_redo}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
