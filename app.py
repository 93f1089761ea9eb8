"""ARR-COC microscope (Gradio Blocks): what the layer sees and which visual tokens it keeps.

This first version shows the ARR-COC layer alone (no VLM yet): upload an image,
pick a budget, and see the relevance heatmap with the kept tokens outlined,
the three scorer maps with the balancer's weights, and every texture channel.
The side-by-side VLM view arrives with the embedded model.

    python app.py [--port 7860] [--share]
Nothing is loaded at import time.
"""

from __future__ import annotations

import argparse
import os

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"), ("GRADIO_ANALYTICS_ENABLED", "False")):
    os.environ.setdefault(_key, _value)

CELL_PX = 28  # Qwen2-VL merged-token cell
MAX_SIDE = 896


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ARR-COC microscope")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="create a public Gradio link (off by default)")
    return p.parse_args(argv)


def load():
    from arr_coc import ARRCOCConfig, ARRCOCLayer

    return ARRCOCLayer(ARRCOCConfig())


def analyse(layer, image, budget: float):
    """Handler: image + budget -> (overlay, scorer maps, channel gallery, status text)."""
    from PIL import Image

    from arr_coc import viz

    if image is None:
        return None, [], [], "Upload an image first."
    image = image.convert("RGB")
    scale = min(1.0, MAX_SIDE / max(image.size))
    w = max(CELL_PX, round(image.size[0] * scale / CELL_PX) * CELL_PX)
    h = max(CELL_PX, round(image.size[1] * scale / CELL_PX) * CELL_PX)
    resized = image.resize((w, h), Image.BICUBIC)
    out = layer([resized], [(h // CELL_PX, w // CELL_PX)], budget=float(budget))
    status = f"grid {h // CELL_PX}x{w // CELL_PX}: kept {int(out.budgets[0])} of {(h // CELL_PX) * (w // CELL_PX)} tokens"
    if out.fallback[0]:
        status += f" (fallback: {out.fallback[0]})"
    return viz.overlay_heatmap(resized, out), viz.scorer_maps(out), viz.texture_gallery(out), status


def build_demo(layer):
    import gradio as gr

    with gr.Blocks(title="ARR-COC microscope") as demo:
        gr.Markdown("# ARR-COC microscope\nWhich visual tokens would ARR-COC keep, and why?")
        with gr.Row():
            with gr.Column():
                image = gr.Image(type="pil", label="image", elem_id="image", format="png")
                budget = gr.Slider(0.02, 1.0, value=0.25, step=0.01, label="budget (share of tokens)", elem_id="budget")
                run = gr.Button("Analyse", variant="primary", elem_id="run")
                status = gr.Markdown(elem_id="stats")
            with gr.Column():
                heatmap = gr.Image(label="relevance + kept tokens", elem_id="heatmap", format="png")
        maps = gr.Gallery(label="scorer maps", columns=4, height="auto")
        channels = gr.Gallery(label="texture channels", columns=7, height="auto", elem_id="channels")
        run.click(lambda im, b: analyse(layer, im, b), [image, budget], [heatmap, maps, channels, status], api_name="analyse")
    return demo


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    demo = build_demo(load())
    demo.queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port, share=args.share)


if __name__ == "__main__":
    main()
