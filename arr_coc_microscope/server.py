"""Start-up: the command line, loading the model into a `Microscope`, and serving the page.

    python app.py                                   # embedded ShapesVQA model, http://127.0.0.1:7860
    python app.py --model Qwen/Qwen2-VL-2B-Instruct --device cuda --port 7861
    python app.py --model Qwen/Qwen2.5-VL-7B-Instruct --device cuda:0 --dtype bfloat16 --attn-implementation sdpa

Only a local folder (the embedded model included) runs with the hub offline; a hub id is downloaded
as usual, and when the hub cannot be reached the error says so and what to do instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import time
from typing import TYPE_CHECKING, Any

from arr_coc.runtime import add_arguments as add_runtime
from arr_coc.runtime import add_fast_argument as add_fast
from arr_coc.validation.limits import LIMITS
from arr_coc_microscope.admission import Admission
from arr_coc_microscope.configs import add_layers
from arr_coc_microscope.handler import Microscope
from arr_coc_microscope.inputs import reason
from arr_coc_microscope.memory import limit_malloc_arenas
from arr_coc_microscope.page import CSS, DEFAULT_CONCURRENCY, EXAMPLES_DIR, build_demo

if TYPE_CHECKING:
    import gradio as gr

logger = logging.getLogger("arr_coc.app")

EMBEDDED_NAME = "embedded ShapesVQA Qwen2-VL (checkpoints/shapes-qwen2vl)"
HUB_EXAMPLE = "Qwen/Qwen2-VL-2B-Instruct"
# The app's defaults; a variable already set in the environment wins.
APP_ENVIRONMENT = (("GRADIO_ANALYTICS_ENABLED", "False"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                   ("TOKENIZERS_PARALLELISM", "false"))
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class LoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to do."""


# ----------------------------------------------------------------------------- the command line


def default_host() -> str:
    """Loopback, unless GRADIO_SERVER_NAME names an interface or this runs on a Hugging Face Space
    (SPACE_ID is set there), whose proxy reaches the app on 0.0.0.0."""
    return os.environ.get("GRADIO_SERVER_NAME") or ("0.0.0.0" if os.environ.get("SPACE_ID") else "127.0.0.1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ARR-COC microscope: baseline vs. ARR-COC side by side")
    p.add_argument("--model", default=None,
                   help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL hub id or local folder (default: the embedded model "
                        "in checkpoints/shapes-qwen2vl). A local folder runs offline; a hub id is downloaded")
    p.add_argument("--arr-coc", dest="arr_coc", default=None,
                   help="trained ARR-COC layer folder, or 'untrained' (default: the trained layer shipped under "
                        "checkpoints/ for the embedded model, else untrained)")
    p.add_argument("--compare-arr-coc", dest="compare_arr_coc", action="append", default=[], metavar="PATH",
                   help="another ARR-COC layer folder (or 'untrained') the page offers for config A and B, to compare "
                        "checkpoints side by side; repeat for more (config B defaults to the first)")
    p.add_argument("--adapter", default=None,
                   help="LoRA adapters for the image model (a folder written by train-adapter, a layer folder holding "
                        "adapter/, or a hub id): they run for configurations that prune tokens, never for the "
                        "baseline; each run's trace says whether they ran")
    p.add_argument("--video-model", dest="video_model", default="auto",
                   help="the model that answers clips: a folder or hub id, 'same' (--model answers clips too), or "
                        "'auto' (default: the embedded model's video fine-tune, checkpoints/shapes-qwen2vl-video, when "
                        "--model is the embedded model; else --model)")
    p.add_argument("--flops", action=argparse.BooleanOptionalAction, default=True,
                   help="count each run's FLOPs (vision tower, selector, LM prefill) off the clock (default on; "
                        "--no-flops for a large model on a CPU, where counting costs a second prefill)")
    add_runtime(p)  # --device, --dtype, --attn-implementation: the same names and meaning as every command
    add_fast(p)     # --fast auto|on|off, as ask, eval and bench take it
    p.add_argument("--warm-up", dest="warm_up", action=argparse.BooleanOptionalAction, default=True,
                   help="answer one generated question at start-up, so the first user's request is as fast as the "
                        "next (default on)")
    p.add_argument("--host", default=default_host(),
                   help="interface to listen on (default 127.0.0.1; 0.0.0.0 on a Hugging Face Space or when "
                        "GRADIO_SERVER_NAME says so)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    p.add_argument("--share", action="store_true", help="create a public Gradio link (off by default)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help="requests handled at once (model calls still run one at a time)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the model


def set_environment(model_path: str | None = None) -> None:
    """The app's environment defaults, set before torch, transformers or gradio is imported.

    A local model folder also sets HF_HUB_OFFLINE=1: everything is on disk, so nothing should wait
    on the network. A hub id leaves HF_HUB_OFFLINE to the environment, so it can be downloaded.
    A variable the environment already sets is never changed.
    """
    for key, value in APP_ENVIRONMENT:
        os.environ.setdefault(key, value)
    if model_path is not None and os.path.isdir(model_path):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")


def model_path(model: str | None) -> str:
    """The folder or hub id to load: `model`, or the embedded model. LoadError when there is neither."""
    from arr_coc.paths import EMBEDDED_MODEL, default_model_path

    if model is None:
        path = default_model_path()
        if path is None:
            raise LoadError(f"no embedded model under {EMBEDDED_MODEL}; pass --model with a local Qwen2-VL/2.5-VL/"
                            f"3-VL folder, or a hub id such as {HUB_EXAMPLE} when online")
        return path
    if not os.path.exists(model) and not _HUB_ID.match(model):
        raise LoadError(f"no model folder at {model!r}; pass --model with a local Qwen2-VL/2.5-VL/3-VL folder "
                        f"or a hub id such as {HUB_EXAMPLE}")
    return str(model)


def _offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_unreachable(exc: BaseException) -> bool:
    """True when loading failed because the hub could not be asked (offline mode, no network, a timeout)
    and the files were not in the local cache either, rather than for a reason the hub gave."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)) or type(e).__name__ in (
                "LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "ReadTimeout"):
            return True
        if "couldn't connect to" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def load_failure(model: str, exc: BaseException) -> str:
    """What went wrong loading `model` (a folder or a hub id) and what to do next."""
    if os.path.isdir(model) or not hub_unreachable(exc):
        return (f"could not load a Qwen-VL model from {model!r} ({reason(exc)}); pass --model with a local "
                f"Qwen2-VL/2.5-VL/3-VL folder or a hub id")
    if _offline_mode():
        why, fix = ("the Hugging Face hub is switched off (HF_HUB_OFFLINE is set)",
                    "unset HF_HUB_OFFLINE on a machine that is online to download it")
    else:
        why, fix = "the Hugging Face hub could not be reached", "go online to download it"
    return (f"could not load {model!r}: {why} and the model is not in the local cache ({reason(exc)}). To use it, "
            f"{fix}, or pass --model with a local folder that holds it (e.g. one written by "
            f"`hf download {model} --local-dir DIR` on a machine that is online)")


def shipped_before_layer(scope: Microscope, args: argparse.Namespace) -> list[str]:
    """[the layer trained for encode="before"] when the page serves the embedded model with its shipped layer
    (config B then defaults to it, encoding before); [] otherwise. Marks it on the scope."""
    from arr_coc.paths import default_layer_path, is_embedded_model
    from arr_coc_microscope.configs import layer_label

    folder = default_layer_path("before")
    if args.arr_coc is not None or folder is None or not is_embedded_model(model_path(args.model)):
        return []
    scope.before_layer = layer_label(folder)
    return [folder]


def load(model: str | None = None, device: str = "auto", arr_coc: str | None = None,
         max_new_tokens: int = 32, retries: int = 3, concurrency: int = DEFAULT_CONCURRENCY,
         dtype: str = "auto", attn_implementation: str | None = None, fast: str = "off",
         adapter: str | None = None) -> Microscope:
    """Load the VLM (default: the embedded checkpoint) into a `Microscope`; LoadError says what to do.

    device / dtype / attn_implementation mean what they mean on every command (`arr_coc.runtime`);
    a wrong name, or cuda without a GPU, is a LoadError with runtime's message, before anything loads.
    A local folder is retried a few times: the embedded checkpoint may be being re-saved by a
    training run at the moment it is read.
    """
    path = model_path(model)
    set_environment(path)
    from arr_coc import ARRCOC
    from arr_coc.errors import InputError
    from arr_coc.validation.requests import check_max_new_tokens
    from arr_coc.paths import LayerNotFound, resolve_layer
    from arr_coc.adapter_files import AdapterError
    from arr_coc.runtime import check_supported
    from arr_coc.runtime import Runtime, RuntimeChoiceError
    from arr_coc.pipeline.selection import available_methods

    try:
        run = Runtime.resolve(device, dtype, attn_implementation)
        check_supported(run)
        max_new_tokens = check_max_new_tokens(max_new_tokens)   # issue 39: else every request would fail
    except (RuntimeChoiceError, InputError) as exc:
        raise LoadError(str(exc)) from None
    try:  # issue 39: --arr-coc naming a folder that is not there is refused before the model loads
        layer_path = resolve_layer(path, arr_coc)
    except LayerNotFound as exc:
        raise LoadError(f"--arr-coc: {exc}") from None
    attempts = max(1, retries) if os.path.isdir(path) else 1
    for attempt in range(attempts):
        try:
            vlm = ARRCOC.from_pretrained(path, arr_coc=layer_path, device=run.device, dtype=run.dtype,
                                         attn_implementation=run.attn_implementation, fast=fast, adapter=adapter)
            break
        except Exception as exc:
            if isinstance(exc, AdapterError):      # retrying does not change it
                raise LoadError(f"--adapter: {exc}") from None
            if attempt == attempts - 1:
                if isinstance(exc, (OSError, ValueError)):
                    raise LoadError(load_failure(path, exc)) from exc
                raise
            logger.warning("loading %s failed (attempt %d of %d); retrying", path, attempt + 1, attempts)
            time.sleep(2.0)
    try:
        vlm.layer  # built now, not racily on a first request
    except Exception as exc:  # noqa: BLE001 - every request would keep every token: refuse to start instead
        raise LoadError(f"--arr-coc: the ARR-COC layer {layer_path or 'untrained'!r} could not be built for this "
                        f"model ({reason(exc)}); pass a layer trained for this model, or 'untrained'") from exc
    # every registered method (built-in modules load on first use), ARR-COC first; adaptive is a checkbox
    methods = ["arr_coc"] + [m for m in available_methods() if m not in ("arr_coc", "arr_coc_adaptive")]
    logger.info("loaded %s on %s", path, vlm.runtime.describe())
    layer = f"trained ({os.path.relpath(layer_path)})" if layer_path else "untrained"
    # Admission: twice the requests Gradio runs at once (the rest are still unwinding after a cancel), and
    # two of the largest images the validator decodes.
    return Microscope(vlm=vlm, model_name=EMBEDDED_NAME if model is None else str(model), methods=methods,
                      max_new_tokens=int(max_new_tokens), layer_name=layer, limits=vlm.input_limits(),
                      admission=Admission(max_requests=2 * max(1, int(concurrency)),
                                          max_pixels=2 * LIMITS.max_decode_pixels))


def clip_model_path(video_model: str | None, model: str | None) -> str | None:
    """The model that answers clips: None when --model answers them too ('same', or 'auto' with a model of the
    user's own: one made for both)."""
    from arr_coc.paths import default_model_path

    if video_model in (None, "same"):
        return None
    if video_model == "auto":
        found = default_model_path(video=True)
        return found if model is None and found != default_model_path() else None
    return video_model


def add_clip_model(scope: Microscope, path: str | None) -> None:
    """Load the clip model (issue 49: a clip is answered by the model made for clips, and the page says which):
    one vlm per layer the server offers, each with that layer, on the clip model. LoadError when it cannot."""
    if path is None:
        return
    from arr_coc import ARRCOC
    from arr_coc.paths import shown_path
    from arr_coc.pipeline.backend import SharesWeights, require

    try:
        first = ARRCOC.from_pretrained(path, arr_coc=scope.vlm.layer, device=scope.vlm.device,
                                       dtype=scope.vlm.runtime.dtype)
        require(first.backend, SharesWeights, "answer clips beside the image model's layers (--video-model)")
        scope.clip_vlms = {name: ARRCOC(first.backend.sibling(), arr_coc=w.layer, seed=w.seed, name=first.name,
                                        execution=w.execution)
                           for name, w in scope.layers.items()}
    except (OSError, ValueError) as exc:
        raise LoadError(f"--video-model: {load_failure(path, exc)}") from exc
    scope.clip_model_name = shown_path(path)           # as every other model and layer: no server path
    logger.info("clips are answered by %s", path)


def warm_up(scope: Microscope) -> float:
    """Answer one generated ShapesVQA question with the page's defaults before serving (what a first request
    would otherwise pay: lazy builds, allocator growth, and on the fast path each stage's compile for that
    bucket). Returns the seconds it took; a failure is logged, never fatal."""
    from arr_coc_shapes import make_item
    from arr_coc_microscope.handler import ask

    t0 = time.perf_counter()
    image, record, _ = make_item(0, "warm-up", 0)
    result = ask(scope, image, record["question"])
    seconds = time.perf_counter() - t0
    if result.error:
        logger.warning("warm-up request failed (%s); the first request pays its start-up", result.error)
    else:
        logger.info("warmed up in %.1f s (%s)", seconds, scope.vlm.execution.label)
    return seconds


# ----------------------------------------------------------------------------- serving


def serve(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False, **kwargs: Any):
    """Launch with the page's theme/CSS and file settings (Gradio 6 takes them in launch())."""
    import gradio as gr
    from starlette.middleware import Middleware

    from arr_coc_microscope.lifetime import ResetMeansCancel

    kwargs.setdefault("app_kwargs", {"middleware": [Middleware(ResetMeansCancel, blocks=demo)]})
    return demo.launch(server_name=host, server_port=port, share=share, css=CSS, theme=gr.themes.Soft(),
                       allowed_paths=[EXAMPLES_DIR], max_file_size=LIMITS.max_file_bytes, ssr_mode=False, max_threads=8,
                       footer_links=["api", "gradio", "settings"], **kwargs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_environment()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio polling itself at start-up
    limit_malloc_arenas()
    try:
        scope = load(args.model, device=args.device, arr_coc=args.arr_coc, max_new_tokens=args.max_new_tokens,
                     concurrency=args.concurrency, dtype=args.dtype, attn_implementation=args.attn_implementation,
                     fast=args.fast, adapter=args.adapter)
    except LoadError as exc:
        raise SystemExit(str(exc)) from None
    try:
        add_layers(scope, shipped_before_layer(scope, args) + args.compare_arr_coc)
        add_clip_model(scope, clip_model_path(args.video_model, args.model))
    except (ValueError, LoadError) as exc:
        raise SystemExit(str(exc)) from None
    scope.count_flops = args.flops
    if args.warm_up:
        warm_up(scope)
    serve(build_demo(scope, concurrency=args.concurrency), host=args.host, port=args.port, share=args.share)
