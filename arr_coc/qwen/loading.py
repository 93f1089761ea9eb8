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
from ..pipeline.registry import BackendEntry, HubUnreachable, hub_error, model_type_of  # noqa: F401 - HubUnreachable
from ..runtime import Runtime, check_supported
from .families import FAMILIES, family_of
from .processing import load_processor
from .scratch import QwenScratch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODEL_CLASSES = {name: family.model_class for name, family in FAMILIES.items()}

def load_vlm(
    model_id_or_path: str | os.PathLike, device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = "auto", attn_implementation: str | None = None, **kwargs: Any,
) -> tuple[PreTrainedModel, Any]:
    """(model, processor) for any of the three families, from a hub id or a local folder.

    device, dtype and attn_implementation mean what `arr_coc.runtime` says (dtype None: auto).
    """
    import transformers

    run = Runtime.resolve(device, dtype, attn_implementation)  # wrong names fail before any loading
    check_supported(run)
    path = os.fspath(model_id_or_path)
    local = os.path.isdir(path)
    if local:
        kwargs.setdefault("local_files_only", True)
    family = model_type_of(path)
    if family not in MODEL_CLASSES:
        raise ValueError(f"{path!r} is a {family!r} model; the Qwen backend serves {sorted(MODEL_CLASSES)}")
    model_cls = getattr(transformers, MODEL_CLASSES[family])
    load_kw: dict[str, Any] = {"dtype": run.dtype}
    if run.attn_implementation is not None:
        load_kw["attn_implementation"] = run.attn_implementation
    try:
        model = model_cls.from_pretrained(path, **load_kw, **kwargs).to(run.device)
    except OSError as exc:
        if local:
            raise
        raise hub_error(path, exc) from exc
    return model, load_processor(path, family=family)


def load_backend(model_id_or_path: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str | None = "auto", attn_implementation: str | None = None, **kwargs: Any):
    """A `QwenBackend` over the checkpoint (`load_vlm`), for the backend registry."""
    from .backend import QwenBackend

    model, processor = load_vlm(model_id_or_path, device, dtype, attn_implementation, **kwargs)
    return QwenBackend(model.eval().requires_grad_(False), processor)


def check_adapter(adapter: Any) -> None:
    """An adapter folder or hub id that is not there, refused before the model loads (AdapterError)."""
    from .adapter import Adapter, adapter_folder

    if not isinstance(adapter, Adapter):
        adapter_folder(adapter)


def scratch(model_type: str) -> QwenScratch:
    """This family's models built from scratch (the registry's `FromScratch`)."""
    return QwenScratch(family_of(model_type), load_vlm)


ENTRY = BackendEntry("qwen", tuple(FAMILIES), load_backend, check_adapter, scratch)
