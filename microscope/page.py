"""The microscope's page: the Gradio Blocks layout, its CSS and its examples.

One event, `ask` (api_name="ask"), wired to `microscope.handler.ask`; its inputs and outputs are
documented in docs/APP.md. Gradio is imported when the page is built, not before.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable

from microscope import handler
from microscope.handler import OUTPUT_NAMES, STATS_HEADERS, Microscope
from microscope.inputs import Unreadable, reason
from microscope.memory import release_memory

if TYPE_CHECKING:
    import gradio as gr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(ROOT, "assets", "examples")

MIN_BUDGET = 0.02                    # the slider's range only: the handler reads any budget parse_budget takes
QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 2              # model calls are serialised by a lock; the second slot overlaps I/O and drawing

CSS = """
#answer-baseline textarea, #answer-arr textarea { font-size: 1.2rem; font-weight: 600; }
#error { min-height: 1rem; }
#error p { margin: 0.2rem 0; }
"""


def read_examples(folder: str = EXAMPLES_DIR) -> list[dict]:
    """assets/examples/examples.json entries whose image exists (image made absolute)."""
    path = os.path.join(folder, "examples.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        entries = json.load(f)
    out = []
    for e in entries:
        image = os.path.join(folder, e["image"])
        if os.path.isfile(image):
            out.append({**e, "image": image})
    return out


# ----------------------------------------------------------------------------- components the handler reads itself


def _hand_raw_uploads_to_the_handler(image: gr.Image) -> gr.Image:
    """Make this gr.Image instance pass the uploaded file's path to the handler unopened.

    The stock preprocess opens the upload with PIL before the handler runs and fails with a generic
    error on anything PIL cannot identify; the handler reads and checks it itself and says what is wrong.
    Patched on this one instance (a subclass would make Gradio write a .pyi stub next to this module).
    """
    stock = image.preprocess

    def preprocess(payload):
        if payload is None:
            return None
        path = getattr(payload, "path", None)
        if path and not str(path).startswith("data:"):
            return str(path)
        try:
            return stock(payload)
        except Exception as exc:  # noqa: BLE001
            return Unreadable(reason(exc))

    image.preprocess = preprocess
    return image


def _hand_raw_budgets_to_the_handler(slider: gr.Slider) -> gr.Slider:
    """Make this gr.Slider instance pass the budget to the handler as sent, for `parse_budget` to read.

    The stock preprocess refuses anything outside the slider's range with a generic error, and strings
    outright; an API client may send any budget the command line takes ("64", "64tok", "10%", 0.1), and
    a bad one gets the parser's message in the page. One exception, for the wire: JSON has no 1.0, so
    the slider's maximum arrives as the integer 1, which here means every token (1.0); an API client asks
    for one token with "1tok". Patched on this one instance, like the image.
    """

    def preprocess(payload):
        if type(payload) is int and payload == 1:
            return 1.0
        return payload

    def api_info() -> dict[str, Any]:
        return {"anyOf": [{"type": "number"}, {"type": "string"}],
                "description": "share of visual tokens kept (0.25, '10%') or a token count ('64', '64tok')"}

    slider.preprocess = preprocess
    slider.api_info = api_info
    return slider


def _maybe_gpu(fn: Callable) -> Callable:
    """On a Hugging Face ZeroGPU Space, run the handler under spaces.GPU; elsewhere unchanged."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return fn
    return spaces.GPU(duration=120)(fn)


# ----------------------------------------------------------------------------- the page


def build_demo(scope: Microscope, concurrency: int = DEFAULT_CONCURRENCY,
               examples: list[dict] | None = None) -> gr.Blocks:
    import gradio as gr

    from arr_coc.budget import DEFAULT_BUDGET

    examples = read_examples() if examples is None else examples

    def run_ask(image, question, arr_coc, budget, adaptive, method):
        try:
            return handler.ask(scope, image, question, arr_coc, budget, adaptive, method).outputs()
        finally:
            release_memory()

    run_ask = _maybe_gpu(run_ask)

    with gr.Blocks(title="ARR-COC microscope", delete_cache=(3600, 3600)) as demo:
        gr.Markdown(
            "# ARR-COC microscope\n"
            "Ask a question about an image. The **baseline** VLM reads every visual token; **ARR-COC** keeps only "
            "the tokens its relevance map ranks highest for this question. Both answers come from the same model "
            f"(`{scope.model_name}`), one instrumented forward pass each. ARR-COC layer: {scope.layer_name}."
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=4, min_width=320):
                image = _hand_raw_uploads_to_the_handler(gr.Image(
                    label="image", type="filepath", image_mode=None, format="png", sources=["upload", "clipboard"],
                    elem_id="image", height=340))
                question = gr.Textbox(label="question", placeholder="What color is the circle?", lines=1,
                                      max_lines=4, elem_id="question")
                with gr.Row():
                    arr_toggle = gr.Checkbox(value=True, label="ARR-COC on", elem_id="arr-toggle",
                                             info="off: run the baseline only")
                    adaptive = gr.Checkbox(value=False, label="adaptive budget", elem_id="adaptive",
                                           info="ARR-COC picks 5-50% from how spread its relevance is")
                budget = _hand_raw_budgets_to_the_handler(gr.Slider(
                    MIN_BUDGET, 1.0, value=DEFAULT_BUDGET, step=0.01, elem_id="budget",
                    label="budget: share of visual tokens kept",
                    info="the trained layer keeps it on average: more for a question about many objects, "
                         "fewer for one about one"))
                method = gr.Dropdown(choices=scope.methods, value="arr_coc", label="method (pruned column)",
                                     elem_id="method",
                                     info="arr_coc, or a method registered with arr_coc.selection.register_selector")
                run = gr.Button("Ask both models", variant="primary", elem_id="run")
                if examples:
                    gr.Examples(examples=[[e["image"], e["question"]] for e in examples], inputs=[image, question],
                                elem_id="examples", cache_examples=False,
                                label="Examples: ShapesVQA scenes (incl. hard cases) and photographs")
            with gr.Column(scale=7, min_width=480):
                with gr.Row():
                    answer_base = gr.Textbox(label="baseline answer (all visual tokens)", elem_id="answer-baseline",
                                             interactive=False, lines=2)
                    answer_arr = gr.Textbox(label="ARR-COC answer (pruned visual tokens)", elem_id="answer-arr",
                                            interactive=False, lines=2)
                error = gr.Markdown(elem_id="error")
                with gr.Row(equal_height=False):
                    heatmap = gr.Image(label="relevance + kept tokens (green)", elem_id="heatmap",
                                       format="png", type="pil", interactive=False, height=440)
                    with gr.Column():
                        stats = gr.Dataframe(headers=STATS_HEADERS, elem_id="stats", interactive=False, wrap=True,
                                             label="tokens and latency", column_widths=["40%", "30%", "30%"],
                                             max_height=800)
                        trace = gr.File(label="trace (JSON)", elem_id="trace", interactive=False)
        with gr.Row(equal_height=False):
            maps = gr.Gallery(label="scorer maps and the balanced relevance", elem_id="maps", columns=4,
                              height=300, format="png", interactive=False, object_fit="contain", scale=3)
            weights = gr.Markdown(elem_id="weights")
        channels = gr.Gallery(label="texture channels (one cell per visual token, fixed [0, 1] scale)",
                              elem_id="channels", columns=7, height="auto", format="png", interactive=False,
                              object_fit="contain")

        outputs = [answer_base, answer_arr, stats, heatmap, maps, weights, channels, trace, error]
        assert len(outputs) == len(OUTPUT_NAMES)
        gr.on([run.click, question.submit], run_ask,
              inputs=[image, question, arr_toggle, budget, adaptive, method], outputs=outputs,
              api_name="ask", concurrency_limit=concurrency)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=concurrency)
    return demo
