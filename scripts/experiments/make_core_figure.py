"""Regenerate docs/core_maps.png and print the texture / layer timings quoted in docs/RESULTS.md.

    python scripts/experiments/make_core_figure.py
"""

import time

import torch
from PIL import Image, ImageDraw, ImageFont

from arr_coc import ARRCOCConfig, ARRCOCLayer, generate_texture_array, viz


def scene() -> Image.Image:
    im = Image.new("RGB", (448, 448), (70, 72, 80))
    d = ImageDraw.Draw(im)
    d.ellipse([40, 60, 90, 110], fill=(220, 40, 40))
    d.rectangle([300, 80, 350, 130], fill=(40, 80, 220))
    d.polygon([(200, 300), (230, 250), (260, 300)], fill=(240, 210, 40))
    d.rectangle([320, 330, 370, 380], fill=(245, 245, 245))
    d.text((333, 335), "A", fill=(0, 0, 0), font=ImageFont.load_default(size=36))
    return im


def median_ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1000


def main() -> None:
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig())
    im = scene()
    out = layer([im], [(16, 16)], budget=0.1)
    fig = viz.summary_figure(im, out, title="ARR-COC layer, untrained, no question: budget 10% (26 of 256 tokens)")
    fig.savefig("docs/core_maps.png", dpi=80)
    for size in (448, 896):
        x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
        g = size // 28
        q = [torch.randn(8, 64)]
        tex = median_ms(lambda: generate_texture_array(x, (g, g)))
        full = median_ms(lambda: layer([x[0]], [(g, g)], query_embeds=q))
        print(f"{size}x{size} ({g}x{g} cells): texture {tex:.1f} ms, whole layer {full:.1f} ms (median of 7)")


if __name__ == "__main__":
    main()
