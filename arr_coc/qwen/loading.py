"""Loading a Qwen-VL checkpoint (hub id or local folder) and the ARR-COC layer that goes with it.

A local folder loads with `local_files_only=True`, so the embedded model never touches the network
whatever the environment says; a hub id loads as transformers loads it, and when the hub cannot be
reached the error says so and what to do. Nothing here sets HF_HUB_OFFLINE for anyone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from ..core.layer import LayerSpec, build_layer  # noqa: F401 - where the wrapper and older callers find them
from ..runtime import Runtime, RuntimeChoiceError
from .families import FAMILIES
from .processing import load_processor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODEL_CLASSES = {name: family.model_class for name, family in FAMILIES.items()}

class HubUnreachable(OSError):
    """A hub id could not be fetched (offline, no network, or not on the hub); the message says what to do."""


def _hub_error(model_id: str, exc: BaseException) -> HubUnreachable:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE is set, so the hub was not asked" if offline else "the Hugging Face hub could not be reached"
    return HubUnreachable(
        f"could not load {model_id!r}: it is not a local folder and {why} ({first}). Pass a local model "
        f"folder (--model PATH), or go online{' and unset HF_HUB_OFFLINE' if offline else ''} to download it once "
        "(it is cached afterwards).")


def check_supported(run: Runtime) -> None:
    """Refuse, before loading, a runtime transformers would refuse halfway (flash_attention_2 off a GPU, in
    float32, or without the flash-attn package), with what to pass instead."""
    if run.attn_implementation != "flash_attention_2":
        return
    if run.device.type != "cuda":
        raise RuntimeChoiceError(f"attention implementation 'flash_attention_2' runs on CUDA devices only, not "
                                 f"{run.device}; pass --device cuda, or --attn-implementation sdpa")
    if run.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeChoiceError("attention implementation 'flash_attention_2' needs --dtype bfloat16 or float16, "
                                 f"not {str(run.dtype).removeprefix('torch.')}; or pass --attn-implementation sdpa")
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise RuntimeChoiceError("attention implementation 'flash_attention_2' needs the flash-attn package, which is "
                                 "not installed; `pip install flash-attn --no-build-isolation` (on the CUDA machine), "
                                 "or pass --attn-implementation sdpa")


def load_vlm(
    model_id_or_path: str | os.PathLike, device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = "auto", attn_implementation: str | None = None, **kwargs: Any,
) -> tuple[PreTrainedModel, Any]:
    """(model, processor) for any of the three families, from a hub id or a local folder.

    device, dtype and attn_implementation mean what `arr_coc.runtime` says (dtype None: auto).
    """
    import transformers
    from transformers import AutoConfig

    run = Runtime.resolve(device, dtype, attn_implementation)  # wrong names fail before any loading
    check_supported(run)
    path = os.fspath(model_id_or_path)
    local = os.path.isdir(path)
    if local:
        kwargs.setdefault("local_files_only", True)
    try:
        config = AutoConfig.from_pretrained(path, **({"local_files_only": True} if local else {}))
    except OSError as exc:
        if local:
            raise OSError(f"{path!r} holds no model config.json that transformers can read ({exc})") from exc
        raise _hub_error(path, exc) from exc
    family = getattr(config, "model_type", None)
    if family not in MODEL_CLASSES:
        raise ValueError(f"{path!r} is a {family!r} model; ARRCOCQwen supports {sorted(MODEL_CLASSES)}")
    model_cls = getattr(transformers, MODEL_CLASSES[family])
    load_kw: dict[str, Any] = {"dtype": run.dtype}
    if run.attn_implementation is not None:
        load_kw["attn_implementation"] = run.attn_implementation
    try:
        model = model_cls.from_pretrained(path, **load_kw, **kwargs).to(run.device)
    except OSError as exc:
        if local:
            raise
        raise _hub_error(path, exc) from exc
    return model, load_processor(path, family=family)
