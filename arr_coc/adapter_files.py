"""An adapter's files, whatever the model: peft's LoRA format, found and read before any model loads.

A saved adapter is a folder (or a hub repository, or the `adapter/` folder beside a saved layer):

    adapter_config.json         peft's LoraConfig
    adapter_model.safetensors   peft's LoRA weights
    arr_coc_adapter.json        the base model it was trained on, its targets, its training
    README.md                   the model card

`adapter_folder` finds one and refuses (one line, `AdapterError`) a missing folder and files that cannot be read;
whether the adapter fits a model is the backend's to say (`arr_coc.qwen.adapter.check_adapter` for Qwen-VL).
The target groups name the parts of a VLM an adapter trains (a backend maps them onto its modules).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .core.persistence import hub_snapshot, looks_like_hub_id

TARGET_GROUPS = ("tower_attn", "tower_mlp", "lm_attn", "lm_mlp")
DEFAULT_TARGETS = ("tower_attn", "tower_mlp", "lm_attn")
CONFIG_FILE, WEIGHTS_FILE, BASE_FILE, CARD_FILE = ("adapter_config.json", "adapter_model.safetensors",
                                                    "arr_coc_adapter.json", "README.md")
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, BASE_FILE, CARD_FILE)
SUBFOLDER = "adapter"                 # where a saved layer keeps its adapter, beside the layer's files
NAME = "default"                      # peft's adapter name


class AdapterError(ValueError):
    """An adapter that cannot be used with this model; the message says what to do (one line)."""


@dataclass
class AdapterCard:
    """What the adapter's README says: what it was trained on and how."""

    vlm: str = "unknown"
    layer: str = ""
    encode: str = "before"
    training: str = ""
    results: list[str] = field(default_factory=list)


def adapter_folder(name_or_folder: str | os.PathLike, revision: str | None = None,
                   cache_dir: str | os.PathLike | None = None) -> str:
    """The local folder holding an adapter: the folder itself or its `adapter/` (a layer folder saved by
    `ARRCOC.save_pretrained`), or a hub repository's snapshot (the cache offline); AdapterError otherwise."""
    name = os.fspath(name_or_folder)
    how = (f"pass a folder written by train-adapter or ARRCOC.save_pretrained ({CONFIG_FILE} + {WEIGHTS_FILE}) "
           "or a hub id ('owner/name')")
    if not os.path.exists(name) and looks_like_hub_id(name):
        try:
            name = hub_snapshot(name, revision, cache_dir, None, None, list(ADAPTER_FILES) + [f"{SUBFOLDER}/*"],
                                "adapter", f"python -m arr_coc ask --adapter {name} ...")
        except FileNotFoundError as exc:
            raise AdapterError(f"no adapter at {name!r}: no such folder, and as a hub id: {exc}") from None
    if not os.path.isdir(name):
        raise AdapterError(f"no adapter at {name!r} ({'a file, not a folder' if os.path.exists(name) else 'no such folder'}); {how}")
    for folder in (name, os.path.join(name, SUBFOLDER)):
        if all(os.path.isfile(os.path.join(folder, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)):
            read_config(folder), weight_shapes(folder)      # unreadable files: said here, before any model loads
            if os.path.isfile(os.path.join(folder, BASE_FILE)):
                read_json(folder, BASE_FILE)
            return folder
    raise AdapterError(f"no adapter at {name!r} (no {CONFIG_FILE} + {WEIGHTS_FILE} in it or in {SUBFOLDER}/); {how}")


RESAVE = "save it again (train-adapter or ARRCOC.save_pretrained) or copy the folder again"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def read_json(folder: str, name: str) -> dict[str, Any]:
    """One of the adapter's JSON files as an object; AdapterError naming the file otherwise."""
    path = os.path.join(folder, name)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"{path} is not readable JSON ({_first_line(exc)}); {RESAVE}") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path} holds a JSON {type(data).__name__}, not an object; {RESAVE}")
    return data


def read_config(folder: str) -> dict[str, Any]:
    """adapter_config.json: a LoRA config with a rank >= 1; AdapterError naming the file otherwise."""
    config = read_json(folder, CONFIG_FILE)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} holds a {config.get('peft_type')} adapter; ARR-COC loads LoRA adapters only")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{os.path.join(folder, CONFIG_FILE)}: the LoRA rank 'r' is {rank!r}, not a whole number "
                           f">= 1; {RESAVE}")
    return config


def weight_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in adapter_model.safetensors, read from its header (the file's length is checked
    against it: a copy cut short is refused); AdapterError naming the file otherwise."""
    from safetensors import safe_open

    path = os.path.join(folder, WEIGHTS_FILE)
    try:
        with safe_open(path, "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors' SafetensorError, OSError: a file that is not whole
        raise AdapterError(f"{path} is not a complete safetensors file ({_first_line(exc)}); {RESAVE}") from None


__all__ = ["ADAPTER_FILES", "AdapterCard", "AdapterError", "BASE_FILE", "CARD_FILE", "CONFIG_FILE", "DEFAULT_TARGETS",
           "NAME", "RESAVE", "SUBFOLDER", "TARGET_GROUPS", "WEIGHTS_FILE", "adapter_folder", "read_config", "read_json",
           "weight_shapes"]
