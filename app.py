"""ARR-COC microscope: the baseline VLM and the ARR-COC VLM side by side, and why ARR-COC kept what it kept.

One question about one image runs through the same front door (`ARRCOC`) up to three times, one
instrumented `generate()` each: method="none" (every visual token, the baseline), config A (ARR-COC by
default) and config B (ARR-COC with another layer or encoding mode, e.g. encode="before"). The page shows
the answers, token counts, whole-prefill latencies and FLOPs (vision tower included), what was encoded at
which resolution, the relevance heatmap with the kept tokens outlined, the three scorer maps with the
balancer's weights, every texture channel by name, and the trace as JSON.

    python app.py                                   # embedded ShapesVQA model, http://127.0.0.1:7860
    python app.py --model Qwen/Qwen2-VL-2B-Instruct --device cuda --port 7861
    make run ARGS="--port 7861"

This file is the entry point (a Hugging Face Space runs it); the app is the `arr_coc_microscope` package.
Nothing is loaded at import time. The main event is `ask` (see docs/APP.md for its inputs and outputs
and a gradio_client example).
"""

from arr_coc_microscope.server import main

if __name__ == "__main__":
    main()
