"""The pruned runs of one request and the ARR-COC layers the server offers them.

A request runs the baseline (every visual token, encode "after") and up to two configurations:

    A   the method chosen in the page (ARR-COC by default), with an ARR-COC layer and an encoding mode;
    B   ARR-COC with a layer and an encoding mode of its own, to compare with: after vs. before on one
        layer, or two trained layers (compare checkpoints, not only methods). "off" runs no B.

Both read the same budget; the before mode's gist share, margin, periphery and looks (`SaccadeConfig.passes`,
with the look-again threshold) are shared too. Every
layer sits on its own `ARRCOC` over a sibling backend that shares the one VLM's weights (as `arr_coc_trained`
does in the evaluation), so a second layer costs its own weights only. The layers are the server's `--arr-coc`
(first) and every `--compare-arr-coc`, by the names the page lists (`layer_label`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from arr_coc.errors import InputError

from arr_coc_microscope.scope import Microscope, RunConfig, encode_text  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from arr_coc import ARRCOC
    from arr_coc.encode import EncodeConfig

ENCODE_CHOICES = ("after", "before")
OFF = "off"                       # config B's layer choice that runs no B
MAX_MARGIN = 4                    # rings of context cells; beyond a few the margin is the whole image
MAX_LOOKS = 3                     # looks (passes) of the before mode: the first one and up to two saccades
THRESHOLD_RANGE = (-1.0, 2.0)     # the look-again threshold: -1 looks again always, 1 or more never (uncertainty <= 1)


def layer_label(folder: str | None) -> str:
    """How the page names a layer: 'trained (<folder, relative>)', or 'untrained'."""
    return f"trained ({os.path.relpath(folder)})" if folder else "untrained"


def add_layers(scope: Microscope, folders: list[str] | None) -> None:
    """Offer more ARR-COC layers (`--compare-arr-coc`), each on a vlm sharing the scope's VLM.

    A folder must hold a layer trained for this VLM (config.json + model.safetensors, its question width
    the model's), or be 'untrained'. ValueError (the message says what to pass) when one cannot be built."""
    from arr_coc import ARRCOC
    from arr_coc.pipeline.backend import SharesWeights, require
    from arr_coc.paths import UNTRAINED, LayerNotFound, check_layer_folder

    for folder in folders or []:
        path = None if folder == UNTRAINED else folder
        name = layer_label(path)
        if name in scope.layers:
            continue
        try:
            path = path if path is None else check_layer_folder(path)
        except LayerNotFound as exc:
            raise ValueError(f"--compare-arr-coc: {exc}") from None
        backend = require(scope.vlm.backend, SharesWeights, "offer another layer (--compare-arr-coc)").sibling()
        vlm = ARRCOC(backend, arr_coc=path, seed=scope.vlm.seed, name=scope.vlm.name, execution=scope.vlm.execution)
        try:
            vlm.layer   # built now: a bad folder fails at start-up, not on a request
        except Exception as exc:  # noqa: BLE001 - say which folder and why
            raise ValueError(f"--compare-arr-coc {folder!r}: could not build the layer ({type(exc).__name__}: {exc}); "
                             "pass a layer trained for this model, or 'untrained'") from exc
        scope.more_layers[name] = vlm
        add_adapted(scope, name, vlm, path)


def add_adapted(scope: Microscope, name: str, vlm: ARRCOC, path: str | None) -> None:
    """A layer folder that holds its LoRA adapters (`adapter/`, written by train-adapter) is offered twice: alone,
    and as "<name> + adapter" (the same layer, the adapter on for its pruned runs), so configs A and B can show
    what the adapter changes side by side. Clips never get it (it was trained on the image model)."""
    from arr_coc import ARRCOC
    from arr_coc.adapter_files import SUBFOLDER
    from arr_coc.pipeline.backend import Adapts, SharesWeights, has

    if path is None or not os.path.isdir(os.path.join(path, SUBFOLDER)) or vlm.adapter_name \
            or not has(vlm.backend, Adapts) or not has(vlm.backend, SharesWeights):
        return
    try:
        scope.more_layers[f"{name} + adapter"] = ARRCOC(
            vlm.backend.sibling(), arr_coc=vlm.layer, seed=vlm.seed, name=vlm.name,
            execution=vlm.execution, adapter=path)
    except ValueError as exc:   # AdapterError: an adapter for another model; the layer alone is still offered
        logger.warning("the adapter in %s is not offered: %s", path, exc)


# ----------------------------------------------------------------------------- a request's configurations


def read_choice(value: Any, name: str, choices: list[str] | tuple[str, ...], default: str) -> str:
    """A dropdown or radio value as sent (None or "" is `default`); InputError naming the choices otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    if not isinstance(value, str) or value not in choices:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:55] + "...'"
        raise InputError(f"{name} {shown} is not one of: {', '.join(choices)}.", name)
    return value


def read_number(value: Any, name: str, default: float, low: float, high: float, integer: bool = False) -> float:
    """A slider value as sent (a number or its text; None is `default`), within [low, high]."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    whole = number == int(number) if number == number and abs(number) != float("inf") else False
    if not (low <= number <= high) or (integer and not whole):
        kind = "a whole number" if integer else "a number"
        raise InputError(f"{name} must be {kind} from {low:g} to {high:g}, not {str(value)[:40]!r}.", name)
    return int(number) if integer else number


def read_encode(mode: str, gist: float, margin: int, periphery: bool, looks: int = 1,
                threshold: float | None = None) -> EncodeConfig:
    """An EncodeConfig; its own refusals (periphery without a gist, ...) as InputError. The before mode's
    settings mean nothing after: an "after" run gets the plain EncodeConfig. One look (the default) is the
    one-pass before mode exactly; more looks add `SaccadeConfig(passes=looks, threshold=threshold)`, the
    library's defaults for the rest (saccade budget, target, signal, sharpness, tower memory)."""
    from arr_coc.pipeline.request import check_encode

    if mode == "after":
        return check_encode(None, "after")
    fields: dict[str, Any] = {"mode": "before", "gist": gist, "margin": margin, "periphery": periphery}
    if looks > 1:
        fields["saccade"] = {"passes": int(looks), **({} if threshold is None else {"threshold": float(threshold)})}
    try:
        return check_encode(None, fields)
    except InputError as exc:
        raise InputError(f"{exc}.", exc.code) from None   # the page's messages are sentences


def read_configs(scope: Microscope, method: str, encode: Any, layer: Any, compare_layer: Any, compare_encode: Any,
                 gist: Any, margin: Any, periphery: Any, looks: Any = None, threshold: Any = None, *,
                 notes: list[str]) -> list[RunConfig]:
    """[A] or [A, B] as the request asks (None: the page's defaults); notes say what was adjusted."""
    from arr_coc.saccade import THRESHOLD_INIT
    from arr_coc.pipeline.selection import get_selector, selects_before_encoding
    from arr_coc_microscope.inputs import read_flag

    names = list(scope.layers)
    b_layer, b_encode = scope.default_compare
    mode_a = read_choice(encode, "encode", ENCODE_CHOICES, "after")
    layer_a = read_choice(layer, "layer", names, layer_for_mode(scope, names[0], mode_a, gist or 0.0))
    layer_b = read_choice(compare_layer, "compare_layer", [OFF, *names], b_layer)
    mode_b = read_choice(compare_encode, "compare_encode", ENCODE_CHOICES, b_encode)
    share = read_number(gist, "gist", 0.0, 0.0, 0.95)
    rings = read_number(margin, "margin", 0, 0, MAX_MARGIN, integer=True)
    fovea = read_flag(periphery, "periphery", False)
    passes = read_number(looks, "looks", 1, 1, MAX_LOOKS, integer=True)
    bar = read_number(threshold, "threshold", THRESHOLD_INIT, *THRESHOLD_RANGE)
    uses_before = "before" in (mode_a, mode_b if layer_b != OFF else "after")
    if uses_before:   # refused only when a run would use them
        read_encode("before", share, rings, fovea, passes, bar)
    if mode_a == "before" and method != "none" and not selects_before_encoding(get_selector(method)):
        notes.append(f"Method {method!r} reads the encoded visual tokens, so it cannot choose before the vision "
                     "tower: config A ran with encode after.")
        mode_a = "after"
    looks_a = passes
    if mode_a == "before" and passes > 1 and not method.startswith("arr_coc"):
        notes.append(f"Method {method!r} has no relevance map to aim a saccade by: config A ran with one look.")
        looks_a = 1
    configs = [RunConfig("A", layer_a, method, read_encode(mode_a, share, rings, fovea, looks_a, bar))]
    if layer_b != OFF:
        configs.append(RunConfig("B", layer_b, "arr_coc", read_encode(mode_b, share, rings, fovea, passes, bar)))
    return configs


def layer_for_mode(scope: Microscope, layer: str, mode: str, gist: Any = 0.0) -> str:
    """The layer a config should show when its encode mode is switched to `mode`.

    The shipped pair trades places: the --arr-coc layer (trained reading the encoded tokens) gives way to
    the layer trained for encode="before" (texture and question only; with its adapter where it ships one, the
    default) when a config encodes before without a gist, and comes back when it encodes after. Any other
    choice is the user's and is kept.
    """
    main, before = next(iter(scope.layers)), scope.before_layer
    if before not in scope.layers:
        return layer
    adapted = f"{before} + adapter"
    if mode == "before" and gist_share_of(gist) <= 0.0 and layer == main:
        return adapted if adapted in scope.layers else before
    if (mode == "after" or gist_share_of(gist) > 0.0) and layer in (before, adapted):
        return main
    return layer


def gist_share_of(gist: Any) -> float:
    """The gist slider's value as a share (0.0 when it says nothing readable)."""
    try:
        return float(gist or 0.0)
    except (TypeError, ValueError):
        return 0.0
