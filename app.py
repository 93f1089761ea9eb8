"""ARR-COC microscope: the baseline VLM and the ARR-COC VLM side by side, and why ARR-COC kept what it kept.

One question about one image runs through the same `ARRCOCQwen` wrapper twice,
one instrumented `generate()` each: method="none" (every visual token, the
baseline) and the chosen method (ARR-COC by default). The page shows both
answers, token counts and latencies, the relevance heatmap with the kept tokens
outlined, the three scorer maps with the balancer's weights, every texture
channel by name, and the trace as JSON.

    python app.py                                   # embedded ShapesVQA model, http://127.0.0.1:7860
    python app.py --model Qwen/Qwen2-VL-2B-Instruct --device cuda --port 7861

Nothing is loaded at import time. The main event is `ask` (see docs/APP.md for its
inputs and outputs and a gradio_client example).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("GRADIO_ANALYTICS_ENABLED", "False"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

logger = logging.getLogger("arr_coc.app")

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES_DIR = os.path.join(HERE, "assets", "examples")
# Each request writes its pictures and trace into its own folder here; Gradio copies them into its cache
# atomically. (Returning PIL images instead makes Gradio rewrite one content-addressed cache file in place for
# identical pictures, so a client still downloading it from a concurrent request can get a truncated file.)
OUTPUT_ROOT = os.path.join(tempfile.gettempdir(), "arr_coc_app")
OUTPUT_MAX_AGE_S = 3600

DEFAULT_BUDGET = 0.25
MIN_BUDGET = 0.02
MAX_QUESTION_CHARS = 1000
MIN_SIDE_PX = 28                     # one merged visual token of Qwen2-VL / 2.5-VL
MAX_ASPECT = 200                     # Qwen-VL's smart_resize refuses more extreme aspect ratios
MAX_DECODE_PIXELS = 80_000_000       # refused before decoding (PIL warns of decompression bombs at 89 MP)
MAX_INPUT_PIXELS = 2048 * 2048       # larger images are downscaled to this before anything else
MAX_UPLOAD = "25mb"
QUEUE_SIZE = 32
DEFAULT_CONCURRENCY = 2              # model calls are serialised by a lock; the second slot overlaps I/O and drawing
STATS_HEADERS = ["", "baseline", "ARR-COC"]
OUTPUT_NAMES = ("answer_baseline", "answer_arr", "stats", "heatmap", "maps", "weights", "channels", "trace", "error")

NO_IMAGE = "No image: upload an image (PNG, JPEG, WebP, BMP, GIF) or click one of the examples."


class InputError(ValueError):
    """A problem with the user's input; its message is shown in the page as it is."""


# ----------------------------------------------------------------------------- start-up


def default_host() -> str:
    """Loopback, unless GRADIO_SERVER_NAME names an interface or this runs on a Hugging Face Space
    (SPACE_ID is set there), whose proxy reaches the app on 0.0.0.0."""
    return os.environ.get("GRADIO_SERVER_NAME") or ("0.0.0.0" if os.environ.get("SPACE_ID") else "127.0.0.1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ARR-COC microscope: baseline vs. ARR-COC side by side")
    p.add_argument("--model", default=None,
                   help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL hub id or local folder (default: the embedded model "
                        "in checkpoints/shapes-qwen2vl)")
    p.add_argument("--arr-coc", dest="arr_coc", default=None,
                   help="trained ARR-COC layer folder, or 'untrained' (default: the trained layer shipped under "
                        "checkpoints/ for the embedded model, else untrained)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument("--host", default=default_host(),
                   help="interface to listen on (default 127.0.0.1; 0.0.0.0 on a Hugging Face Space or when "
                        "GRADIO_SERVER_NAME says so)")
    p.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)))
    p.add_argument("--share", action="store_true", help="create a public Gradio link (off by default)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                   help="requests handled at once (model calls still run one at a time)")
    return p.parse_args(argv)


@dataclass
class Microscope:
    """What the handlers share: read-only after `load()` (the lock only serialises model calls)."""

    wrapper: Any                     # arr_coc.model.ARRCOCQwen
    model_name: str
    methods: list[str]               # SELECTORS at start-up, "arr_coc" first
    max_new_tokens: int = 32
    layer_name: str = "untrained"    # which ARR-COC scorer weights: "trained (<folder>)" or "untrained"
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cell_px(self) -> int:
        """Pixels per merged visual token side (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        from arr_coc.processing import image_processor_of

        return int(image_processor_of(self.wrapper.processor).patch_size) * int(self.wrapper.merge)


def _register_anchor_methods() -> None:
    """Import arr_coc.methods if it exists, so its anchors register in SELECTORS before the dropdown is built."""
    import importlib

    try:
        importlib.import_module("arr_coc.methods")
    except ModuleNotFoundError as exc:
        if exc.name not in ("arr_coc.methods", "arr_coc"):
            logger.warning("arr_coc.methods could not be imported (%s); listing the built-in methods only", exc)
    except Exception as exc:  # noqa: BLE001 - a broken anchor must not take the app down
        logger.warning("arr_coc.methods failed to import (%s: %s); listing the built-in methods only",
                       type(exc).__name__, exc)


def load(model: str | None = None, device: str = "auto", arr_coc: str | None = None,
         max_new_tokens: int = 32, retries: int = 3) -> Microscope:
    """Load the VLM (default: the embedded checkpoint) into a `Microscope`.

    A local folder is retried a few times: the embedded checkpoint may be being re-saved
    by a training run at the moment it is read.
    """
    import torch

    from arr_coc.paths import resolve_layer
    from arr_coc.embedded import DEFAULT_CHECKPOINT
    from arr_coc.model import SELECTORS, ARRCOCQwen

    path = model or DEFAULT_CHECKPOINT
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    attempts = max(1, retries) if os.path.isdir(path) else 1
    for attempt in range(attempts):
        try:
            layer_path = resolve_layer(path, arr_coc)
            wrapper = ARRCOCQwen.from_pretrained(path, arr_coc=layer_path, device=device)
            break
        except Exception:
            if attempt == attempts - 1:
                raise
            logger.warning("loading %s failed (attempt %d of %d); retrying", path, attempt + 1, attempts)
            time.sleep(2.0)
    try:
        wrapper.arr_coc_layer  # built now, not racily on a first request
    except Exception as exc:  # noqa: BLE001 - requests then fall back to the baseline with a notice
        logger.warning("the ARR-COC layer could not be built (%s); ARR-COC requests will fall back", exc)
    _register_anchor_methods()
    methods = ["arr_coc"] + sorted(m for m in SELECTORS if m != "arr_coc")
    name = "embedded ShapesVQA Qwen2-VL (checkpoints/shapes-qwen2vl)" if model is None else str(model)
    layer = f"trained ({os.path.relpath(layer_path)})" if layer_path else "untrained"
    return Microscope(wrapper=wrapper, model_name=name, methods=methods, max_new_tokens=int(max_new_tokens),
                      layer_name=layer)


# ----------------------------------------------------------------------------- input checks


def check_question(question: Any) -> str:
    text = "" if question is None else str(question).replace("\x00", "").strip()
    if not text:
        raise InputError("The question is empty: type a question about the image, e.g. \"What color is the circle?\"")
    if len(text) > MAX_QUESTION_CHARS:
        raise InputError(f"The question is {len(text):,} characters long; the limit is {MAX_QUESTION_CHARS:,}. "
                         "Ask one short question about the image.")
    return text


def check_budget(budget: Any) -> float:
    if budget is None:
        return DEFAULT_BUDGET
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise InputError(f"The budget {budget!r} is not a number; pass a share of tokens in ({MIN_BUDGET}, 1].")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise InputError(f"The budget {value} is outside (0, 1]; it is the share of visual tokens ARR-COC keeps.")
    return value


def check_method(method: Any) -> str:
    from arr_coc.model import SELECTORS

    name = "arr_coc" if method in (None, "") else str(method)
    if name not in SELECTORS:
        raise InputError(f"Unknown method {name!r}; choose one of {', '.join(sorted(SELECTORS))}.")
    return name


@dataclass
class ImageInfo:
    """What happened to the upload on its way to the model (for the page and the trace)."""

    original_size: tuple[int, int] | None = None
    used_size: tuple[int, int] | None = None
    mode: str | None = None
    format: str | None = None
    frames: int = 1
    notes: list[str] = field(default_factory=list)


class Unreadable(str):
    """Marker for an upload the Image component itself could not decode (the message is the reason)."""


def read_image(value: Any) -> tuple[Any, ImageInfo]:
    """An upload (path, PIL image or array) -> (8-bit RGB PIL image within the pixel cap, ImageInfo).

    Raises InputError with a message for the page when the image cannot be used.
    """
    import numpy as np
    from PIL import Image

    if value is None or (isinstance(value, str) and not value.strip()):
        raise InputError(NO_IMAGE)
    if isinstance(value, Unreadable):
        raise InputError(f"Could not read the file as an image ({value}). Upload a PNG, JPEG, WebP, BMP or GIF file.")
    if isinstance(value, Image.Image):
        return _normalise_image(value)
    if isinstance(value, np.ndarray):
        try:
            return _normalise_image(Image.fromarray(value))
        except (TypeError, ValueError) as exc:
            raise InputError(f"Could not use the array as an image ({exc}); pass HxW or HxWx3 uint8 values.")
    path = os.fspath(value)
    if not os.path.isfile(path):
        raise InputError(NO_IMAGE)
    try:
        with open(path, "rb") as f:
            try:
                im = Image.open(f)
            except Image.DecompressionBombError as exc:
                raise InputError(f"The image is far too large to decode safely ({exc}). Downscale it and upload again.")
            except Exception as exc:  # noqa: BLE001 - PIL raises many kinds for non-images
                raise InputError(f"Could not read the file as an image ({_reason(exc)}). "
                                 "Upload a PNG, JPEG, WebP, BMP or GIF file.")
            return _normalise_image(im)  # fully decoded before the file closes
    except OSError as exc:
        raise InputError(f"Could not open the uploaded file ({_reason(exc)}). Upload it again.")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _normalise_image(im: Any) -> tuple[Any, ImageInfo]:
    import numpy as np
    from PIL import Image, ImageOps

    w, h = im.size
    info = ImageInfo(original_size=(w, h), mode=im.mode, format=im.format)
    if w * h > MAX_DECODE_PIXELS:
        raise InputError(f"The image is {w}x{h} px ({w * h / 1e6:.0f} megapixels): too large to decode here "
                         f"(limit {MAX_DECODE_PIXELS / 1e6:.0f} MP). Downscale it and upload again.")
    if min(w, h) < MIN_SIDE_PX:
        raise InputError(f"The image is {w}x{h} px: too small to show anything. Upload an image at least "
                         f"{MIN_SIDE_PX}x{MIN_SIDE_PX} px (one visual token covers {MIN_SIDE_PX}x{MIN_SIDE_PX} px).")
    if max(w, h) / min(w, h) > MAX_ASPECT:
        raise InputError(f"The image is {w}x{h} px: an aspect ratio beyond {MAX_ASPECT}:1, which Qwen-VL cannot "
                         "take. Crop it closer to the region of interest.")
    frames = int(getattr(im, "n_frames", 1) or 1)
    if frames > 1:
        info.frames = frames
        info.notes.append(f"Animated image ({frames} frames): only the first frame is used.")
        im.seek(0)
    deep = im.mode.startswith("I;16") or im.mode in ("I", "F") or any(
        ";16" in str(getattr(t, "args", "")) for t in (getattr(im, "tile", None) or []))
    if w * h > MAX_INPUT_PIXELS and getattr(im, "format", None) == "JPEG":
        im.draft("RGB", (max(1, w // 2), max(1, h // 2)))  # decode at reduced scale: less memory for huge JPEGs
    try:
        im.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data
        raise InputError(f"The image file is truncated or damaged ({_reason(exc)}). Re-save it and upload again.")
    try:
        im = ImageOps.exif_transpose(im)
    except Exception:  # noqa: BLE001 - a broken EXIF block is no reason to refuse the picture
        pass
    mode = im.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(im, dtype=np.float64)
        if mode.startswith("I;16"):
            arr = arr / 257.0
        else:
            lo, hi = float(arr.min()), float(arr.max())
            arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        im = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "L")
    if deep:
        info.notes.append(f"{'16' if mode != 'F' else '32'}-bit image ({info.mode}): converted to 8 bits per channel.")
    if mode == "CMYK":
        info.notes.append("CMYK image: converted to RGB (colours may shift a little without its colour profile).")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (mode == "P" and "transparency" in im.info)
    if has_alpha:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, rgba)
        info.notes.append(f"Image with transparency ({info.mode}): flattened onto a white background.")
    try:
        im = im.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - exotic modes (LAB, HSV, ...)
        raise InputError(f"Could not convert the {mode} image to RGB ({_reason(exc)}). Save it as an RGB PNG or JPEG.")
    w2, h2 = im.size
    if w2 * h2 > MAX_INPUT_PIXELS:
        scale = math.sqrt(MAX_INPUT_PIXELS / (w2 * h2))
        size = (max(MIN_SIDE_PX, int(w2 * scale)), max(MIN_SIDE_PX, int(h2 * scale)))
        im = im.resize(size, Image.LANCZOS)
        info.notes.append(f"Large image ({w}x{h} px, {w * h / 1e6:.1f} MP): downscaled to {size[0]}x{size[1]} "
                          f"(cap {MAX_INPUT_PIXELS / 1e6:.1f} MP); the model resizes to its own input size anyway.")
    info.used_size = im.size
    return im, info


# ----------------------------------------------------------------------------- the handler


@dataclass
class Run:
    """One instrumented generate() call."""

    answer: str
    trace: Any                     # arr_coc.model.Trace


@dataclass
class Result:
    """Everything one request shows; `outputs()` orders it as the `ask` event returns it."""

    answer_baseline: str = ""
    answer_arr: str = ""
    stats: list[list[str]] = field(default_factory=list)
    heatmap: str | None = None     # PNG path (pictures are files: see OUTPUT_ROOT)
    maps: list[tuple[str, str]] = field(default_factory=list)        # (PNG path, caption)
    weights: str = ""
    channels: list[tuple[str, str]] = field(default_factory=list)    # (PNG path, channel name)
    trace: str | None = None       # path of the JSON trace
    error: str = ""
    record: dict[str, Any] | None = None   # the trace's content (direct callers and tests)

    def outputs(self) -> tuple:
        return tuple(getattr(self, name) for name in OUTPUT_NAMES)


def _generate(scope: Microscope, image: Any, question: str, method: Any, budget: Any) -> Run:
    with scope.lock:
        answer, trace = scope.wrapper.generate(image, question, budget=budget, method=method,
                                               max_new_tokens=scope.max_new_tokens)
    return Run(answer=str(answer).strip(), trace=trace)


def ask(scope: Microscope, image: Any, question: Any, arr_coc: bool = True, budget: Any = DEFAULT_BUDGET,
        adaptive: bool = False, method: Any = "arr_coc") -> Result:
    """The `ask` event: never raises; problems come back as `Result.error` (shown in the page)."""
    try:
        return _ask(scope, image, question, bool(arr_coc), budget, bool(adaptive), method)
    except InputError as exc:
        return Result(error=f"**Error:** {exc}")
    except Exception as exc:  # noqa: BLE001 - keep serving, say what happened
        logger.exception("ask failed")
        return Result(error=f"**Error:** the request failed ({_reason(exc)}). Try another image or question; "
                            "if it keeps failing, restart the app and report the trace in the server log.")


def _ask(scope: Microscope, image: Any, question: Any, arr_on: bool, budget: Any, adaptive: bool,
         method: Any) -> Result:
    from arr_coc import viz

    question = check_question(question)
    budget = check_budget(budget)
    method = check_method(method)
    picture, info = read_image(image)
    notes = list(info.notes)

    try:
        base = _generate(scope, picture, question, "none", 1.0)
    except Exception as exc:  # noqa: BLE001
        logger.exception("baseline generate failed")
        raise InputError(f"The model could not answer on this input ({_reason(exc)}).")

    arr: Run | None = None
    arr_failed: str | None = None
    if arr_on:
        from arr_coc.model import select_arr_coc_adaptive

        selector, arr_budget = method, budget
        if adaptive and method == "arr_coc":
            selector, arr_budget = select_arr_coc_adaptive, None
        elif adaptive:
            notes.append(f"Adaptive budgets belong to ARR-COC; method {method!r} used the fixed share {budget:.2f}.")
        try:
            arr = _generate(scope, picture, question, selector, arr_budget)
            if selector is select_arr_coc_adaptive:
                arr.trace.budget = "adaptive"
                arr.trace.method = "arr_coc"
        except Exception as exc:  # noqa: BLE001 - ARR-COC must never cost the user the answer
            logger.exception("ARR-COC generate failed; falling back to the baseline")
            arr_failed = _reason(exc)
            notes.append(f"ARR-COC failed ({arr_failed}): the ARR-COC column shows the baseline answer "
                         f"(all {base.trace.total_tokens} visual tokens).")
        if arr is not None:
            fb = [f for f in arr.trace.fallback if f]
            if "keep_all" in fb or arr.trace.error:
                why = arr.trace.error or "keep_all"
                notes.append(f"ARR-COC fell back to the baseline path for this image ({why}): "
                             f"it kept all {arr.trace.total_tokens} visual tokens.")
            elif "grid" in fb:
                notes.append("Low-structure image: ARR-COC spread its tokens over an even grid instead of top-k.")

    # Pictures, on the image exactly as the processor resized it (one cell per merged token).
    out = arr.trace.arr_coc if arr is not None else None
    heatmap, maps, channels, weights_md = None, [], [], ""
    if arr is not None:
        grid = arr.trace.grid_hw[0]
        shown = picture.resize((grid[1] * scope.cell_px, grid[0] * scope.cell_px))
        if out is not None and getattr(out, "relevance", None) is not None and out.information is not None:
            heatmap = viz.overlay_heatmap(shown, out)
            maps = viz.scorer_maps(out)
            weights_md = _weights_markdown(viz.balancer_weights(out))
        else:
            heatmap = viz.outline_kept(shown, arr.trace.kept_indices[0], grid)
        if out is not None and out.texture is not None:
            channels = viz.texture_gallery(out)
        if out is None and method != "none":
            notes.append(f"Method {method!r} has no relevance maps: the heatmap shows its kept tokens only.")

    answer_arr = arr.answer if arr is not None else (base.answer if arr_failed else "")
    record = trace_record(scope, question, info, method, budget, adaptive, arr_on, base, arr, arr_failed, notes)
    folder = request_folder()
    return Result(
        answer_baseline=base.answer,
        answer_arr=answer_arr if arr_on else "(ARR-COC is off: only the baseline ran)",
        stats=stats_rows(base, arr),
        heatmap=_save_png(heatmap, folder, "heatmap") if heatmap is not None else None,
        maps=[(_save_png(im, folder, f"map_{k}_{cap.split()[0]}"), cap) for k, (im, cap) in enumerate(maps)],
        weights=weights_md,
        channels=[(_save_png(im, folder, f"channel_{k:02d}_{name}"), name) for k, (im, name) in enumerate(channels)],
        trace=write_trace(record, folder),
        error="\n\n".join(f"**Note:** {n}" for n in notes),
        record=record,
    )


def _weights_markdown(weights: dict[str, float]) -> str:
    if not weights:
        return ""
    rows = "\n".join(f"| {name} | {w:.3f} |" for name, w in weights.items())
    return ("**Balancer weights** (relevance = sum of weight x map / 3)\n\n| scorer | weight |\n| --- | --- |\n" + rows)


def _ms(seconds: float) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{1000 * seconds:.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a and b and math.isfinite(a) and math.isfinite(b) and b > 0 else "-"


def _kept_per_budget(t: Any) -> str:
    """1.00x, or how the trained layer scaled this question's budget (more cells relevant, more tokens)."""
    from arr_coc.budget import resolve_count

    if isinstance(t.budget, bool) or not isinstance(t.budget, (int, float)) or not t.total_tokens:
        return "-"  # adaptive: no budget to compare with
    return f"{t.kept_tokens / resolve_count(t.budget, t.total_tokens):.2f}x"


def stats_rows(base: Run, arr: Run | None) -> list[list[str]]:
    b = base.trace
    a = arr.trace if arr is not None else None
    col = (lambda f: f(a)) if a is not None else (lambda f: "-")
    return [
        ["method", "none (all tokens)", col(lambda t: str(t.method))],
        ["budget", "1.0", col(lambda t: str(t.budget))],
        ["visual tokens (total)", str(b.total_tokens), col(lambda t: str(t.total_tokens))],
        ["visual tokens (kept)", str(b.kept_tokens),
         col(lambda t: f"{t.kept_tokens} ({100 * t.kept_ratio:.0f}%)")],
        ["kept / budget", "-", col(_kept_per_budget)],
        ["prompt tokens", str(b.prompt_tokens), col(lambda t: str(t.prompt_tokens))],
        ["vision tower (ms)", _ms(b.vision_s), col(lambda t: _ms(t.vision_s))],
        ["selection (ms)", _ms(b.select_s), col(lambda t: _ms(t.select_s))],
        ["prefill (ms)", _ms(b.prefill_s), col(lambda t: _ms(t.prefill_s))],
        ["total (ms)", _ms(b.total_s), col(lambda t: _ms(t.total_s))],
        ["prefill speedup", "1.00x", col(lambda t: _ratio(b.prefill_s, t.prefill_s))],
        ["total speedup", "1.00x", col(lambda t: _ratio(b.total_s, t.total_s))],
        ["new tokens", str(b.new_tokens), col(lambda t: str(t.new_tokens))],
    ]


def _grid_list(t: Any, h: int, w: int) -> list[list[float]]:
    return [[round(float(x), 4) for x in row] for row in t[0, :h, :w].tolist()]


def trace_record(scope: Microscope, question: str, info: ImageInfo, method: str, budget: float, adaptive: bool,
                 arr_on: bool, base: Run, arr: Run | None, arr_failed: str | None, notes: list[str]) -> dict:
    """The downloadable trace: request, image handling, both runs, and ARR-COC's maps and decisions."""
    record: dict[str, Any] = {
        "model": scope.model_name,
        "arr_coc_layer": scope.layer_name,
        "question": question,
        "request": {"arr_coc": arr_on, "method": method, "budget": budget, "adaptive": adaptive},
        "image": {"original_size": list(info.original_size or ()), "used_size": list(info.used_size or ()),
                  "mode": info.mode, "format": info.format, "frames": info.frames},
        "notes": notes,
        "baseline": {"answer": base.answer, **base.trace.to_dict()},
        "arr_coc": None,
    }
    if arr_failed is not None:
        record["arr_coc"] = {"failed": arr_failed, "answer": base.answer, "fell_back_to": "baseline"}
    if arr is not None:
        t = arr.trace
        entry = {"answer": arr.answer, **t.to_dict(), "kept_indices": [k.tolist() for k in t.kept_indices]}
        out = t.arr_coc
        if out is not None and getattr(out, "relevance", None) is not None:
            h, w = out.grid_hw[0]
            maps = {name: _grid_list(getattr(out, name), h, w)
                    for name in ("relevance", "information", "perspectival", "participatory")
                    if getattr(out, name, None) is not None}
            from arr_coc import viz

            entry["layer"] = {"grid_hw": [h, w], "weights": viz.balancer_weights(out),
                              "channel_names": list(out.channel_names or []), "fallback": out.fallback[0],
                              "error": out.errors[0], "maps": maps}
        record["arr_coc"] = entry
    return record


def request_folder() -> str:
    """A fresh folder for one request's files under OUTPUT_ROOT; folders older than an hour are removed."""
    os.makedirs(OUTPUT_ROOT, exist_ok=True)
    now = time.time()
    try:
        for name in os.listdir(OUTPUT_ROOT):
            path = os.path.join(OUTPUT_ROOT, name)
            if now - os.path.getmtime(path) > OUTPUT_MAX_AGE_S:
                shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass  # another request is pruning at the same time
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=OUTPUT_ROOT)


def _save_png(image: Any, folder: str, stem: str) -> str:
    path = os.path.join(folder, f"{stem}.png")
    image.save(path, format="PNG")
    return path


def write_trace(record: dict, folder: str) -> str:
    path = os.path.join(folder, "arr_coc_trace.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


# ----------------------------------------------------------------------------- the page


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


def _hand_raw_uploads_to_the_handler(image: Any) -> Any:
    """Make this gr.Image instance pass the uploaded file's path to the handler unopened.

    The stock preprocess opens the upload with PIL before the handler runs and fails with a generic
    error on anything PIL cannot identify; the handler reads and checks it itself and says what is wrong.
    Patched on this one instance (a subclass would make Gradio write an app.pyi stub next to app.py).
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
            return Unreadable(_reason(exc))

    image.preprocess = preprocess
    return image


def _maybe_gpu(fn: Any) -> Any:
    """On a Hugging Face ZeroGPU Space, run the handler under spaces.GPU; elsewhere unchanged."""
    try:
        import spaces  # type: ignore
    except ImportError:
        return fn
    return spaces.GPU(duration=120)(fn)


def build_demo(scope: Microscope, concurrency: int = DEFAULT_CONCURRENCY, examples: list[dict] | None = None):
    import gradio as gr

    examples = read_examples() if examples is None else examples

    def run_ask(image, question, arr_coc, budget, adaptive, method):
        try:
            return ask(scope, image, question, arr_coc, budget, adaptive, method).outputs()
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
                budget = gr.Slider(MIN_BUDGET, 1.0, value=DEFAULT_BUDGET, step=0.01, elem_id="budget",
                                   label="budget: share of visual tokens kept",
                                   info="the trained layer keeps it on average: more for a question about many "
                                        "objects, fewer for one about one")
                method = gr.Dropdown(choices=scope.methods, value="arr_coc", label="method (pruned column)",
                                     elem_id="method",
                                     info="arr_coc, or an anchor registered in arr_coc.model.SELECTORS")
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

        gr.on([run.click, question.submit], run_ask,
              inputs=[image, question, arr_toggle, budget, adaptive, method],
              outputs=[answer_base, answer_arr, stats, heatmap, maps, weights, channels, trace, error],
              api_name="ask", concurrency_limit=concurrency)
    demo.queue(max_size=QUEUE_SIZE, default_concurrency_limit=concurrency)
    return demo


def serve(demo: Any, host: str = "127.0.0.1", port: int = 7860, share: bool = False, **kwargs: Any):
    """Launch with the page's theme/CSS and file settings (Gradio 6 takes them in launch())."""
    import gradio as gr

    return demo.launch(server_name=host, server_port=port, share=share, css=CSS, theme=gr.themes.Soft(),
                       allowed_paths=[EXAMPLES_DIR], max_file_size=MAX_UPLOAD, ssr_mode=False, max_threads=8,
                       footer_links=["api", "gradio", "settings"], **kwargs)


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    """glibc through ctypes, or None (other C libraries have no mallopt/malloc_trim)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def limit_malloc_arenas(n: int = 2) -> bool:
    """Cap glibc's malloc arenas for this process (what MALLOC_ARENA_MAX=n does, set at run time).

    Gradio runs handlers on a pool of worker threads and glibc gives each thread its own arena,
    so resident memory creeps up request after request. Measured on the embedded model, RSS after
    105 requests vs. after the first: +19% by default, +10% with 2 arenas, +6% with 2 arenas and
    `release_memory()` after each request.
    """
    libc = _glibc()
    return bool(libc.mallopt(-8, int(n))) if libc is not None else False  # -8: M_ARENA_MAX


def release_memory() -> None:
    """Give the heap's free pages back to the OS (glibc malloc_trim) after a request."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio polling itself at start-up
    limit_malloc_arenas()
    try:
        scope = load(args.model, device=args.device, arr_coc=args.arr_coc, max_new_tokens=args.max_new_tokens)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"could not load a Qwen-VL model from {args.model or 'checkpoints/shapes-qwen2vl'!r} "
                         f"({_reason(exc)}); pass --model with a local Qwen2-VL/2.5-VL/3-VL folder or a hub id")
    serve(build_demo(scope, concurrency=args.concurrency), host=args.host, port=args.port, share=args.share)


if __name__ == "__main__":
    main()
