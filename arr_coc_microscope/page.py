"""The microscope's page: the Gradio Blocks layout, its CSS and its examples.

One event, `ask` (api_name="ask"), wired to `arr_coc_microscope.handler.ask`; its inputs and outputs are
documented in docs/APP.md. Gradio is imported when the page is built, not before.

The event is a coroutine that runs the handler on a worker thread under a cancellation token
(`arr_coc.cancel`): when the client cancels or disconnects (`arr_coc_microscope.lifetime`), the token is
cancelled and the model work stops at its next step boundary; the coroutine waits for that (a few
seconds at most), so the request's memory is free before its slot is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from arr_coc_microscope import handler, lifetime
from arr_coc_microscope.configs import ENCODE_CHOICES, MAX_LOOKS, MAX_MARGIN, OFF, THRESHOLD_RANGE, layer_for_mode
from arr_coc_microscope.handler import OUTPUT_NAMES, Microscope
from arr_coc_microscope.inputs import Refused, Unreadable, reason
from arr_coc_microscope.memory import release_memory
from arr_coc_microscope.readout import STATS_HEADERS

if TYPE_CHECKING:
    import gradio as gr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(ROOT, "assets", "examples")

logger = logging.getLogger("arr_coc.app")

MIN_BUDGET = 0.02                    # the slider's range only: the handler reads any budget parse_budget takes
MAX_GIST = 0.75                      # the gist slider's range only (a gist is a share in [0, 1))
QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 2              # model calls are serialised by a lock; the second slot overlaps I/O and drawing
WATCH_EVERY_S = 0.25                 # how often a running request checks that its client is still connected
CLIP_INPUT = 13                      # where the uploaded clip sits in the page's inputs (after periphery)
STOP_WAIT_S = 3.0                    # how long a cancelled request waits for its work to stop before it lets go

CSS = """
#answer-baseline textarea, #answer-arr textarea, #answer-compare textarea { font-size: 1.2rem; font-weight: 600; }
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
        if path and not str(path).startswith(("data:", "http://", "https://")):
            return str(path)
        if _url_of(path or getattr(payload, "url", None)):
            return Refused(URL_REFUSED)
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
    a bad one gets the parser's message in the page. A whole number is read as the command line reads it
    (`parse_budget(wire=True)`): JSON has no 1.0, so 1 is ambiguous there as "1" is on the command line;
    the page's own slider sends its maximum as "1.0" (`SLIDER_MAX_AS_TEXT`). Patched on this one instance,
    like the image.
    """

    def preprocess(payload):
        return payload

    def api_info() -> dict[str, Any]:
        return {"anyOf": [{"type": "number"}, {"type": "string"}],
                "description": "share of visual tokens kept (0.25, '10%') or a token count ('64', '64tok')"}

    slider.preprocess = preprocess
    slider.api_info = api_info
    return slider


def _hand_raw_values_to_the_handler(component: gr.components.Component) -> gr.components.Component:
    """Make this dropdown, radio, slider or textbox instance pass its value to the handler as sent: an API
    client's unknown method, layer or mode, an out-of-range gist or margin, or a question that is not text
    (a list, a dict: the stock textbox turned it into its repr), gets the handler's message (what is
    accepted), not Gradio's generic one or an answer. Patched on this one instance."""

    def preprocess(payload):
        return payload

    component.preprocess = preprocess
    return component


def slider_max_as_text(n_inputs: int, budget_at: int) -> str:
    """The `ask` event's browser-side step: the budget slider at its maximum is sent as the text "1.0", not as
    JSON's 1 (which the budget parser refuses as ambiguous, as the command line refuses "1"). Runs in the page
    only; an API client writes its budget itself."""
    return (f"(...args) => {{ const v = args.slice(0, {n_inputs}); "
            f"if (v[{budget_at}] === 1) {{ v[{budget_at}] = \"1.0\"; }} return v; }}")


URL_REFUSED = "The app does not fetch images from URLs: download the image and upload the file."
NOT_UPLOADED = ("The file was not uploaded to this app, and it reads no other files: upload the image, e.g. with "
                "gradio_client's handle_file(path).")


def _url_of(payload: Any) -> str | None:
    """The URL an API client sent as the image, if it sent one (a FileData dict or a plain string)."""
    if isinstance(payload, dict):
        payload = payload.get("path") or payload.get("url")
    text = str(payload or "")
    return text if text.startswith(("http://", "https://")) else None


FILE_INPUTS = {0: "image", CLIP_INPUT: "video"}   # the page's inputs that carry an uploaded file


def _take_requests_as_the_api_describes_them(demo: gr.Blocks) -> gr.Blocks:
    """Make this Blocks instance read `ask` requests as docs/APP.md describes them, before Gradio's own checks.

    - Inputs left out are optional: a raw HTTP call with only the image and the question gets None for the
      rest, which the handler reads as the defaults (Gradio refuses a short list with `{"error": null}`).
    - An image or video URL is not fetched (no outbound requests from a public Space): the handler says so.
    - An image or video payload Gradio cannot take in (a path outside the app's folders, a string that was never
      uploaded, a malformed file object) reaches the handler as `Refused`, with a message that names no server
      path, whichever of the two it was.
    Patched on this one instance, like the components above.
    """
    stock = demo.preprocess_data

    async def preprocess_data(block_fn, inputs, state, explicit_call=False):
        if getattr(block_fn, "api_name", None) != "ask":
            return await stock(block_fn, inputs, state, explicit_call)
        inputs = list(inputs) + [None] * (len(block_fn.inputs) - len(inputs))
        problems = {at: _url_refused(what) for at, what in FILE_INPUTS.items() if _url_of(inputs[at])}
        for at in problems:
            inputs[at] = None
        processed, refused = await _preprocess_refusing(stock, block_fn, inputs, state, explicit_call)
        problems.update(refused)
        for at, problem in problems.items():
            processed[at] = Refused(problem)
        return processed

    demo.preprocess_data = preprocess_data
    return demo


async def _preprocess_refusing(stock: Callable, block_fn: Any, inputs: list, state: Any, explicit_call: bool
                               ) -> tuple[list, dict[int, str]]:
    """Gradio's preprocess; when it fails on a file input, the same without the file that failed (tried one at a
    time, then both) -> (what it produced, {input: why it was refused})."""
    try:
        return await stock(block_fn, inputs, state, explicit_call), {}
    except Exception as exc:  # noqa: BLE001 - only a file payload can fail here (the rest are patched)
        files = [at for at in FILE_INPUTS if inputs[at] is not None]
        for bad in [[at] for at in files] + ([files] if len(files) > 1 else []):
            trial = [None if i in bad else v for i, v in enumerate(inputs)]
            try:
                processed = await stock(block_fn, trial, state, explicit_call)
            except Exception:  # noqa: BLE001 - not this one: try the next
                continue
            logger.info("a file payload was refused before the handler: %s", type(exc).__name__)
            return processed, {at: _not_taken(FILE_INPUTS[at], exc) for at in bad}
        raise


def _url_refused(what: str) -> str:
    return URL_REFUSED if what == "image" else URL_REFUSED.replace("images", "videos").replace("the image", "the video")


def _not_taken(what: str, exc: BaseException) -> str:
    """Why a file payload was refused: never uploaded (a server path, a plain string), or malformed."""
    if type(exc).__name__ == "InvalidPathError" or what == "video":
        return NOT_UPLOADED.replace("upload the image", f"upload the {what}")
    return f"The {what} could not be taken in ({type(exc).__name__}): upload the file again."


def _maybe_gpu(fn: Callable) -> Callable:
    """On a Hugging Face ZeroGPU Space, run the handler under spaces.GPU; elsewhere unchanged."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return fn
    return spaces.GPU(duration=120)(fn)


# ----------------------------------------------------------------------------- the page


@dataclass
class _Inputs:
    """The input column's components and its button (see `_Inputs.in_api_order` for the `ask` API's order)."""

    image: gr.Image
    video: gr.File
    question: gr.Textbox
    arr_toggle: gr.Checkbox
    adaptive: gr.Checkbox
    budget: gr.Slider
    method: gr.Dropdown
    encode: gr.Radio
    layer: gr.Dropdown
    compare_encode: gr.Radio
    compare_layer: gr.Dropdown
    gist: gr.Slider
    margin: gr.Slider
    periphery: gr.Checkbox
    looks: gr.Slider
    threshold: gr.Number
    run: gr.Button

    def in_api_order(self) -> list:
        """The `ask` event's inputs, in the order its API (and `run_ask`) takes them; clients rely on it."""
        return [self.image, self.question, self.arr_toggle, self.budget, self.adaptive, self.method, self.encode,
                self.layer, self.compare_layer, self.compare_encode, self.gist, self.margin, self.periphery,
                self.video, self.looks, self.threshold]


@dataclass
class _Outputs:
    """The output column's components and the two galleries under the row (see `_Outputs.in_order`)."""

    answer_base: gr.Textbox
    answer_arr: gr.Textbox
    answer_compare: gr.Textbox
    error: gr.Markdown
    stats: gr.Dataframe
    resolution_a: gr.Image
    resolution_b: gr.Image
    heatmap: gr.Image
    weights: gr.Markdown
    trace: gr.File
    maps: gr.Gallery
    channels: gr.Gallery

    def in_order(self) -> list:
        """The `ask` event's outputs, in the order of `handler.OUTPUT_NAMES`."""
        return [self.answer_base, self.answer_arr, self.answer_compare, self.stats, self.heatmap, self.resolution_a,
                self.resolution_b, self.maps, self.weights, self.channels, self.trace, self.error]


def _make_request_runner(scope: Microscope, demo: gr.Blocks) -> Callable:
    """The `ask` event's coroutine: runs the handler on a worker thread under a cancellation token, which
    is cancelled when the client cancels or disconnects; then it waits (briefly) for the work to stop."""
    import gradio as gr

    from arr_coc.cancel import CancelToken, cancellable

    # Every request's model work runs here (not on Gradio's thread pool), so it can be told to stop.
    workers = ThreadPoolExecutor(max_workers=max(2, scope.admission.max_requests), thread_name_prefix="ask")
    def respond(*args):   # a clip, when one was uploaded, replaces the image: one handler for both
        at = CLIP_INPUT   # the page's inputs: ..., periphery, video, looks, threshold (API order kept for clients)
        request, clip = list(args[:at]) + list(args[at + 1:]), args[at]
        return handler.ask(scope, *request, video=clip).outputs()

    answer = _maybe_gpu(respond)

    def work(token: CancelToken, args: tuple) -> tuple:
        with cancellable(token):
            try:
                return answer(*args)
            finally:
                release_memory()

    async def run_ask(image=None, question=None, arr_coc=None, budget=None, adaptive=None, method=None, encode=None,
                      layer=None, compare_layer=None, compare_encode=None, gist=None, margin=None, periphery=None,
                      video=None, looks=None, threshold=None, request: gr.Request = None):
        # every input optional for an API client (the handler reads None as the page's default): issue 49
        token = CancelToken()
        job = asyncio.get_running_loop().run_in_executor(
            workers, work, token, (image, question, arr_coc, budget, adaptive, method, encode, layer, compare_layer,
                                   compare_encode, gist, margin, periphery, video, looks, threshold))
        watcher = asyncio.create_task(lifetime.watch(demo, lifetime.current_event_id(),
                                                     getattr(request, "session_hash", None), token, WATCH_EVERY_S))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            token.cancel("the client cancelled")
            try:   # the work stops at its next step boundary; its memory is freed before the slot is
                await asyncio.wait_for(asyncio.shield(job), STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - nobody is waiting for this answer (admission still counts it)
                pass
            logger.info("request cancelled by its client; its work stopped after %s",
                        token.stopped_at or "its end" if job.done() else "(still stopping)")
            raise
        finally:
            watcher.cancel()

    run_ask.__annotations__["request"] = gr.Request   # resolved here: this module imports gradio lazily
    return run_ask


def _introduction(scope: Microscope) -> str:
    """The Markdown at the top of the page: what the page compares, with which model and layers."""
    return (
        "# ARR-COC microscope\n"
        "Ask a question about an image. The **baseline** VLM reads every visual token; **config A** (ARR-COC "
        "by default) and **config B** (ARR-COC with another layer or encoding) keep only the tokens their "
        "relevance ranks highest for this question, and with *encode before* the vision tower encodes only "
        f"those. Every answer comes from the same model (`{scope.model_name}`), one instrumented run each"
        + (f"; a clip's from the model made for clips (`{scope.clip_model_name}`)" if scope.clip_vlms else "")
        + f". ARR-COC layers: {', '.join(scope.layers)}."
    )


def _build_config_inputs(scope: Microscope) -> dict[str, Any]:
    """Config A's method, encode mode and layer, and config B's encode mode and layer (in the current
    context); returned by `_Inputs` field name."""
    import gradio as gr

    method = _hand_raw_values_to_the_handler(gr.Dropdown(
        choices=scope.methods, value="arr_coc", label="config A: method", elem_id="method",
        info="arr_coc, or a method registered with arr_coc.pipeline.register_selector"))
    layers = list(scope.layers)
    b_layer, b_encode = scope.default_compare
    encode = _hand_raw_values_to_the_handler(gr.Radio(
        list(ENCODE_CHOICES), value="after", label="config A: encode", elem_id="encode",
        info="after: the vision tower encodes every patch, then the method selects; before: it "
             "selects, then the tower encodes only the chosen cells"))
    layer = _hand_raw_values_to_the_handler(gr.Dropdown(
        choices=layers, value=layers[0], label="config A: ARR-COC layer", elem_id="layer"))
    compare_encode = _hand_raw_values_to_the_handler(gr.Radio(
        list(ENCODE_CHOICES), value=b_encode, label="config B (ARR-COC, same budget): encode",
        elem_id="compare-encode"))
    compare_layer = _hand_raw_values_to_the_handler(gr.Dropdown(
        choices=[OFF, *layers], value=b_layer, label="config B: ARR-COC layer (off: no config B)",
        elem_id="compare-layer", info="the layers this server was given (--arr-coc, --compare-arr-coc)"))
    return dict(method=method, encode=encode, layer=layer, compare_encode=compare_encode, compare_layer=compare_layer)


def _build_before_settings() -> dict[str, Any]:
    """The "encode before" accordion (gist, margin, periphery, looks, threshold; in the current context);
    returned by `_Inputs` field name."""
    import gradio as gr

    from arr_coc.saccade import THRESHOLD_INIT

    with gr.Accordion("encode before: gist, margin, periphery, looks (A and B)", open=False,
                      elem_id="before-settings"):
        gist = _hand_raw_values_to_the_handler(gr.Slider(
            0.0, MAX_GIST, value=0.0, step=0.05, label="gist: share of the tokens", elem_id="gist",
            info="the tower first encodes a downscaled copy for the selector; 0: none (the selector "
                 "reads the texture and the question only)"))
        margin = _hand_raw_values_to_the_handler(gr.Slider(
            0, MAX_MARGIN, value=0, step=1, label="margin: rings of context cells", elem_id="margin",
            info="encoded around every chosen cell at full resolution, not read by the LM"))
        periphery = gr.Checkbox(value=False, label="periphery", elem_id="periphery",
                                info="the LM also reads the gist tokens of the regions not encoded "
                                     "at full resolution (needs a gist)")
        looks = _hand_raw_values_to_the_handler(gr.Slider(
            1, MAX_LOOKS, value=1, step=1, label="looks: passes of the tower", elem_id="looks",
            info="1: one look; more: while the first answer token's uncertainty is above the "
                 "threshold, look again at cells not encoded yet and answer again"))
        threshold = _hand_raw_values_to_the_handler(gr.Number(
            value=THRESHOLD_INIT, minimum=THRESHOLD_RANGE[0], maximum=THRESHOLD_RANGE[1], step=0.01,
            label="look-again threshold", elem_id="threshold",
            info="uncertainty = 1 - (p1 - p2) of the two likeliest first tokens; -1: always look again, "
                 "1 or more: never"))
    return dict(gist=gist, margin=margin, periphery=periphery, looks=looks, threshold=threshold)


def _build_input_column(scope: Microscope, examples: list[dict]) -> _Inputs:
    """The input column's contents (in the current context, a gr.Column): the image or clip, the question,
    the controls of configs A and B, the "Ask" button and the examples."""
    import gradio as gr

    from arr_coc.budget import DEFAULT_BUDGET

    image = _hand_raw_uploads_to_the_handler(gr.Image(
        label="image", type="filepath", image_mode=None, format="png", sources=["upload", "clipboard"],
        elem_id="image", height=340))
    with gr.Accordion("video clip (replaces the image)", open=False, elem_id="video-box"):
        # a file input, not gr.Video: that one converts uploads with a system ffmpeg, which the
        # project does not need (PyAV decodes the clip, arr_coc.video)
        video = gr.File(label="video (mp4, webm, avi, mkv, mov, gif)", file_count="single", type="filepath",
                        file_types=[".mp4", ".webm", ".avi", ".mkv", ".mov", ".gif"], elem_id="video",
                        height=120)
    question = _hand_raw_values_to_the_handler(gr.Textbox(
        label="question", placeholder="What color is the circle?", lines=1, max_lines=4,
        elem_id="question"))
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
    configs = _build_config_inputs(scope)
    before = _build_before_settings()
    run = gr.Button("Ask both models", variant="primary", elem_id="run")
    if examples:
        gr.Examples(examples=[[e["image"], e["question"]] for e in examples], inputs=[image, question],
                    elem_id="examples", cache_examples=False,
                    label="Examples: ShapesVQA scenes (incl. hard cases) and photographs")
    return _Inputs(image=image, video=video, question=question, arr_toggle=arr_toggle, adaptive=adaptive,
                   budget=budget, run=run, **configs, **before)


def _build_output_column() -> dict[str, Any]:
    """The output column's contents (in the current context, a gr.Column): the three answers, the error,
    the stats table, the resolution maps, the heatmap, the layer's weights and the trace; returned by
    `_Outputs` field name."""
    import gradio as gr

    with gr.Row():
        answer_base = gr.Textbox(label="baseline answer (all visual tokens)", elem_id="answer-baseline",
                                 interactive=False, lines=2)
        answer_arr = gr.Textbox(label="config A answer (pruned visual tokens)", elem_id="answer-arr",
                                interactive=False, lines=2)
        answer_compare = gr.Textbox(label="config B answer (pruned visual tokens)",
                                    elem_id="answer-compare", interactive=False, lines=2)
    error = gr.Markdown(elem_id="error")
    stats = gr.Dataframe(headers=STATS_HEADERS, elem_id="stats", interactive=False, wrap=True,
                         label="tokens, time and FLOPs (whole prefill = vision tower + ARR-COC's "
                               "own work + LM prefill)", column_widths=["31%", "23%", "23%", "23%"],
                         max_height=1200)
    with gr.Row(equal_height=False):
        resolution_a = gr.Image(label="A: encoded at which resolution", elem_id="resolution-a",
                                format="png", type="filepath", interactive=False, height=480)
        resolution_b = gr.Image(label="B: encoded at which resolution", elem_id="resolution-b",
                                format="png", type="filepath", interactive=False, height=480)
    with gr.Row(equal_height=False):
        heatmap = gr.Image(label="A: relevance + kept tokens (green)", elem_id="heatmap", format="png",
                           type="pil", interactive=False, height=420)
        with gr.Column():
            weights = gr.Markdown(elem_id="weights")
            trace = gr.File(label="trace (JSON)", elem_id="trace", interactive=False)
    return dict(answer_base=answer_base, answer_arr=answer_arr, answer_compare=answer_compare, error=error,
                stats=stats, resolution_a=resolution_a, resolution_b=resolution_b, heatmap=heatmap,
                weights=weights, trace=trace)


def _build_galleries() -> dict[str, Any]:
    """The two galleries under the columns (in the current context, the Blocks): config A's scorer maps
    and its texture channels; returned by `_Outputs` field name."""
    import gradio as gr

    maps = gr.Gallery(label="A: scorer maps and the balanced relevance", elem_id="maps", columns=4, height=300,
                      format="png", interactive=False, object_fit="contain")
    channels = gr.Gallery(label="A: texture channels (one cell per visual token, fixed [0, 1] scale)",
                          elem_id="channels", columns=7, height="auto", format="png", interactive=False,
                          object_fit="contain")
    return dict(maps=maps, channels=channels)


def _clear_if_set(value: Any) -> Any:
    """The other visual's box: emptied when this one was given a file, left as it is when this one was cleared."""
    import gradio as gr

    return gr.update(value=None) if value else gr.update()


def _wire_events(scope: Microscope, shown: _Inputs, results: _Outputs, run_ask: Callable, concurrency: int) -> None:
    """The page's events (in the current context, the Blocks): the layer swaps on a change of encode mode
    or gist, and `ask` (api_name="ask") on the button or on submitting the question."""
    import gradio as gr

    # Switching a config's encode mode (or the gist) swaps the shipped layer for the one trained for that mode.
    # The swaps run one at a time in the order they were triggered (one queue slot of their own): unqueued, a
    # quick "encode before" then "gist 0.25" could land out of order and leave the before-mode layer selected
    # with a gist. In order, the last swap wins, and for the shipped pair it depends on the mode and gist only.
    for mode_box, layer_box in ((shown.encode, shown.layer), (shown.compare_encode, shown.compare_layer)):
        gr.on([mode_box.change, shown.gist.change], lambda mode, name, share: gr.update(
                  value=layer_for_mode(scope, name, mode, share)),
              inputs=[mode_box, layer_box, shown.gist], outputs=layer_box, concurrency_limit=1,
              concurrency_id="layer-for-mode", api_visibility="private")
    # What is asked about is what the page shows (issue 49): choosing an image (an upload, an example) clears the
    # clip box, and uploading a clip clears the image, so a clip left behind never answers for a new image.
    shown.image.change(_clear_if_set, inputs=shown.image, outputs=shown.video, queue=False, api_visibility="private")
    shown.video.change(_clear_if_set, inputs=shown.video, outputs=shown.image, queue=False, api_visibility="private")
    outputs = results.in_order()
    assert len(outputs) == len(OUTPUT_NAMES)
    inputs = shown.in_api_order()
    assert inputs.index(shown.video) == CLIP_INPUT
    gr.on([shown.run.click, shown.question.submit], run_ask, inputs=inputs, outputs=outputs,
          js=slider_max_as_text(len(inputs), inputs.index(shown.budget)),
          api_name="ask", concurrency_limit=concurrency)


def build_demo(scope: Microscope, concurrency: int = DEFAULT_CONCURRENCY,
               examples: list[dict] | None = None) -> gr.Blocks:
    """The page: the inputs (left) and outputs (right) columns, the galleries under them, and the events."""
    import gradio as gr

    examples = read_examples() if examples is None else examples
    with gr.Blocks(title="ARR-COC microscope", delete_cache=(3600, 3600)) as demo:
        run_ask = _make_request_runner(scope, demo)
        gr.Markdown(_introduction(scope))
        with gr.Row(equal_height=False):
            with gr.Column(scale=4, min_width=320):
                shown = _build_input_column(scope, examples)
            with gr.Column(scale=7, min_width=480):
                panels = _build_output_column()
        results = _Outputs(**panels, **_build_galleries())
        _wire_events(scope, shown, results, run_ask, concurrency)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=concurrency)
    return _take_requests_as_the_api_describes_them(demo)
