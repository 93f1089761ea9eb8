"""Where the shipped checkpoints are, and which ARR-COC layer goes with which VLM.

The one owner of these paths: the CLI, the app, the evaluation and the training import them
from here. `checkpoints/` sits next to the `arr_coc` package, wherever a command runs from.
"""

from __future__ import annotations

import os
from typing import Any

from .core.persistence import LAYER_FILES, looks_like_hub_id, resolve_layer_folder   # light: no torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINTS = os.path.join(REPO_ROOT, "checkpoints")
EMBEDDED_MODEL = os.path.join(CHECKPOINTS, "shapes-qwen2vl")    # the embedded Qwen2-VL-architecture VLM
# EMBEDDED_MODEL fine-tuned on ShapesVQA-video clips (+ images), its vocabulary grown by the video words
# (`train-vlm --video`, docs/TRAINING.md): the same 192-d embeddings, so the shipped layers read it too
VIDEO_MODEL = os.path.join(CHECKPOINTS, "shapes-qwen2vl-video")
SHIPPED_LAYER = os.path.join(CHECKPOINTS, "arr-coc-shapes")     # ARR-COC trained against EMBEDDED_MODEL
# ARR-COC trained against EMBEDDED_MODEL for encode="before": it reads the texture array and the question only
# (what it gets before the vision tower), docs/TRAINING.md
SHIPPED_BEFORE_LAYER = os.path.join(CHECKPOINTS, "arr-coc-shapes-before")

UNTRAINED = "untrained"   # the value of --arr-coc that asks for the untrained layer


class LayerNotFound(FileNotFoundError):
    """A trained ARR-COC layer folder that is not there or cannot be read; the message says what to pass."""


def shown_path(path: str | os.PathLike | None) -> str:
    """A folder as cards and the page show it: relative to the working folder when it lies under it
    (checkpoints/...), as given otherwise (a hub id, a folder elsewhere); "-" for none."""
    if not path:
        return "-"
    text = os.fspath(path)
    full = os.path.abspath(text)
    return os.path.relpath(full) if os.path.exists(full) and full.startswith(os.getcwd() + os.sep) else text


def check_layer_folder(folder: str | os.PathLike) -> str:
    """The local folder of a trained ARR-COC layer that can be read, else LayerNotFound: `folder` itself, or,
    for a hub id ("owner/name") that is no local path, its snapshot in the Hugging Face cache (fetched
    there when online; `arr_coc.core.persistence`).

    Every caller that is given a layer checks it here before any model loads: `ask`, `eval`, the
    app at start and `ARRCOC` itself. A folder that is not there used to be found only at the first
    request, which then kept every token with a warning on stderr: the user believed they had pruned.
    """
    path = os.fspath(folder)
    how = (f"pass a folder written by ARRCOCLayer.save_pretrained ({' + '.join(LAYER_FILES)}) or a hub id "
           f"('owner/name'), or '{UNTRAINED}' (arr_coc=None in Python) for the untrained layer")
    if not os.path.exists(path) and looks_like_hub_id(path):
        try:
            path = resolve_layer_folder(path)
        except FileNotFoundError as exc:
            raise LayerNotFound(f"no trained ARR-COC layer at {path!r}: no such folder, and as a hub id: {exc}") from None
    if not os.path.isdir(path):
        why = "it is a file, not a folder" if os.path.exists(path) else "no such folder"
        raise LayerNotFound(f"no trained ARR-COC layer at {path!r} ({why}); {how}")
    for name in LAYER_FILES:
        file = os.path.join(path, name)
        why = None if os.path.isfile(file) else f"it has no {name}"
        try:
            if why is None:
                with open(file, "rb") as f:
                    f.read(1)
        except OSError as exc:
            why = f"its {name} cannot be read ({type(exc).__name__})"
        if why:
            raise LayerNotFound(f"no trained ARR-COC layer at {path!r} ({why}); {how}")
    return path


def default_model_path(video: bool = False) -> str | None:
    """The embedded VLM, if this checkout ships it; for a video (video=True), its video fine-tune when shipped."""
    for folder in ([VIDEO_MODEL] if video else []) + [EMBEDDED_MODEL]:
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    return None


def default_layer_path(encode: str = "after") -> str | None:
    """The trained ARR-COC layer shipped with the embedded VLM for this encoding mode, if this checkout has it."""
    folder = SHIPPED_BEFORE_LAYER if encode == "before" else SHIPPED_LAYER
    return folder if os.path.isfile(os.path.join(folder, "model.safetensors")) else None


def is_embedded_model(model: str | os.PathLike | None) -> bool:
    """True when `model` names a shipped embedded VLM folder, the image one or its video fine-tune (a hub id or
    another folder: False)."""
    if not (model and os.path.isdir(model)):
        return False
    return any(os.path.isdir(f) and os.path.samefile(model, f) for f in (EMBEDDED_MODEL, VIDEO_MODEL))


def layer_mode(encode: Any = "after") -> str:
    """Which shipped layer serves an encoding (a mode name or an EncodeConfig): "before" for encode="before"
    without a gist (the layer then reads the texture array and the question only, as it was trained),
    "after" otherwise (with a gist it reads tokens, as the after-mode layer does)."""
    mode = getattr(encode, "mode", encode)
    return "before" if mode == "before" and not getattr(encode, "gist", 0) > 0 else "after"


def resolve_layer(model: str | os.PathLike, arr_coc: str | None, encode: Any = "after") -> str | None:
    """The ARR-COC layer to load for `model`: `arr_coc` if given ("untrained" -> None, the untrained
    layer); by default the shipped trained layer for the encoding (`layer_mode`), but only for the
    embedded model it was trained against (its scorers read that model's 192-d embeddings); None
    otherwise. A folder given that holds no readable layer is LayerNotFound (`check_layer_folder`)."""
    if arr_coc == UNTRAINED:
        return None
    if arr_coc:
        return check_layer_folder(arr_coc)
    return default_layer_path(layer_mode(encode)) if is_embedded_model(model) else None
