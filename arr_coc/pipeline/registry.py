"""Backends by model type: the front door (`arr_coc.ARRCOC.from_pretrained`) picks one by the checkpoint's
`config.model_type`.

    register_backend(BackendEntry("mine", ("my_vl",), load))   # load(model, device=, dtype=, attn_implementation=)
    backend_entry("qwen2_vl")                                    # -> the entry that loads it

Built in: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`arr_coc.qwen`). A package of your own adds a family through the entry
point group `arr_coc.backends` (in its pyproject: `[project.entry-points."arr_coc.backends"] my_vl =
"my_package.backend:ENTRY"`, ENTRY a `BackendEntry`), read the first time a model type is not known, the same
mechanism lmms-eval uses to find this project's model. docs/DESIGN.md, "Adding a backend", shows one.

A family may also build models of itself from scratch (`FromScratch`, `BackendEntry.scratch`): the ShapesVQA test
bed's embedded model, its training and the bench's random models ask `scratch_kit(model_type)` for it, so they
import no backend.

Reading a checkpoint's model type is here too, with the hub's errors said once for every family: a local folder is
read with `local_files_only`, a hub id as transformers reads it (`HubUnreachable` when it cannot be).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from .backend import VLMBackend

if TYPE_CHECKING:
    import torch

    from ..encode import EncodeConfig

ENTRY_POINT_GROUP = "arr_coc.backends"


@runtime_checkable
class FromScratch(Protocol):
    """A family's models built from scratch, outside any checkpoint: the ShapesVQA test bed's embedded model (a
    word-level tokenizer, its training, a video fine-tune of a checkpoint) and the bench's random models."""

    image_token: str   # the prompt's placeholder of an image's tokens
    end_token: str     # what closes a turn (the token after an answer)

    def word_tokenizer(self, words: Sequence[str]) -> Any:
        """A word-level tokenizer over `words` with the family's special tokens and chat template."""

    def image_processor(self, min_pixels: int, max_pixels: int) -> Any:
        """The image processor of a `word_model` within these pixel limits."""

    def word_model(self, words: Sequence[str], vision: Mapping[str, Any], text: Mapping[str, Any],
                   min_pixels: int, max_pixels: int, seed: int = 0,
                   attn_implementation: str = "sdpa") -> tuple[Any, Any]:
        """(model, processor): an untrained model over `word_tokenizer(words)`, its tower and language model
        configured by `vision` / `text`."""

    def random_model(self, seed: int, dtype: torch.dtype, max_pixels: int | None, attn_implementation: str,
                     text_config: Mapping[str, Any], vision_config: Mapping[str, Any]) -> tuple[Any, Any]:
        """(model, processor): random weights, these config parts over the family's tiny defaults, frozen."""

    def backend(self, model: Any, processor: Any) -> VLMBackend:
        """The pipeline's backend over a model this kit built or loaded."""

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse (ValueError) an encoding this family cannot run, before any model is built."""

    def load(self, path: str | os.PathLike, device: Any = "cpu", dtype: Any = "auto") -> tuple[Any, Any]:
        """(model, processor) of a checkpoint, the model trainable as loaded (not a backend: training it)."""

    def render_prompt(self, processor: Any, images: int, question: str) -> str:
        """The chat text of one user turn: `images` image placeholders, then `question`."""

    def encode_prompts(self, processor: Any, visuals: Sequence[Sequence[Any]], questions: Sequence[str]
                       ) -> dict[str, torch.Tensor]:
        """The processor's tensors for a batch (what the model's forward takes), left-padded."""

    def visual_tokens(self, model: Any, processor: Any, images: Sequence[Any]
                      ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Per image, the tower's tokens [h * w, D] (differentiable) and its grid (h, w) of cells."""


@dataclass(frozen=True)
class BackendEntry:
    """One backend: its name (how errors name it), the model types it serves, and how it loads one.

    load(model_id_or_path, device=..., dtype=..., attn_implementation=..., **kwargs) -> a `VLMBackend`
    check_adapter(adapter)  refuses, before the model loads, adapters that are not there (None: no check)
    scratch(model_type)     the family's `FromScratch` (None: it builds nothing from scratch)"""

    name: str
    model_types: tuple[str, ...]
    load: Callable[..., VLMBackend]
    check_adapter: Callable[[Any], Any] | None = None
    scratch: Callable[[str], FromScratch] | None = None


_BUILTIN = {   # model type -> the module whose ENTRY serves it (imported on first use)
    "qwen2_vl": "arr_coc.qwen.loading",
    "qwen2_5_vl": "arr_coc.qwen.loading",
    "qwen3_vl": "arr_coc.qwen.loading",
}
_BACKENDS: dict[str, BackendEntry] = {}
_entry_points_read = False


class HubUnreachable(OSError):
    """A hub id could not be fetched (offline, no network, or not on the hub); the message says what to do."""


def register_backend(entry: BackendEntry, overwrite: bool = False) -> BackendEntry:
    """Serve `entry.model_types` with `entry` (ValueError if one is served by another entry, unless `overwrite`)."""
    for model_type in entry.model_types:
        known = _BACKENDS.get(model_type)
        if known is not None and known is not entry and not overwrite:
            raise ValueError(f"model type {model_type!r} is already served by backend {known.name!r}; pass "
                             "overwrite=True to replace it")
    for model_type in entry.model_types:
        _BACKENDS[model_type] = entry
    return entry


def backend_entry(model_type: str | None) -> BackendEntry:
    """The entry serving `model_type`: registered, built in, or from the `arr_coc.backends` entry points."""
    if model_type not in _BACKENDS and model_type in _BUILTIN:
        register_backend(importlib.import_module(_BUILTIN[model_type]).ENTRY)
    if model_type not in _BACKENDS:
        _read_entry_points()
    if model_type not in _BACKENDS:
        raise ValueError(f"no ARR-COC backend serves model_type={model_type!r}; served: "
                         f"{', '.join(known_model_types())}. Add one with arr_coc.pipeline.registry.register_backend "
                         f"or the {ENTRY_POINT_GROUP!r} entry point group (docs/DESIGN.md, 'Adding a backend')")
    return _BACKENDS[model_type]


def scratch_kit(model_type: str) -> FromScratch:
    """The `FromScratch` of the backend serving `model_type`; ValueError saying what is missing when it has none."""
    entry = backend_entry(model_type)
    if entry.scratch is None:
        raise ValueError(f"backend {entry.name!r} (model type {model_type!r}) builds no model from scratch: its "
                         "BackendEntry has no `scratch` (a FromScratch), which the ShapesVQA test bed and the bench's "
                         "random models need; use a family that has one, e.g. 'qwen2_vl'")
    return entry.scratch(model_type)


def known_model_types() -> list[str]:
    """Every model type a backend serves (built in, registered, or from installed packages)."""
    _read_entry_points()
    return sorted(set(_BUILTIN) | set(_BACKENDS))


def _read_entry_points() -> None:
    """Register what installed packages offer under `arr_coc.backends` (once): a `BackendEntry`, or a function
    returning one."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry = point.load()
        register_backend(entry() if callable(entry) and not isinstance(entry, BackendEntry) else entry)


def model_type_of(model_id_or_path: str | os.PathLike) -> str | None:
    """The checkpoint's `config.model_type`: a local folder's config.json read as it is (a family transformers does
    not know is served too), a hub id's through transformers; OSError for a folder without a readable config.json,
    `HubUnreachable` for a hub id that cannot be fetched."""
    path = os.fspath(model_id_or_path)
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise OSError(f"{path!r} holds no model config.json that can be read ({exc})") from exc
        return config.get("model_type") if isinstance(config, dict) else None
    from transformers import AutoConfig

    try:
        return getattr(AutoConfig.from_pretrained(path), "model_type", None)
    except OSError as exc:
        raise hub_error(path, exc) from exc


def hub_error(model_id: str, exc: BaseException) -> HubUnreachable:
    """What to say when a hub id could not be fetched."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE is set, so the hub was not asked" if offline else "the Hugging Face hub could not be reached"
    return HubUnreachable(
        f"could not load {model_id!r}: it is not a local folder and {why} ({first}). Pass a local model "
        f"folder (--model PATH), or go online{' and unset HF_HUB_OFFLINE' if offline else ''} to download it once "
        "(it is cached afterwards).")


def load_backend(model_id_or_path: str | os.PathLike, adapter: Any = None, **kwargs: Any) -> VLMBackend:
    """The backend for a checkpoint, picked by its model type (`backend_entry`) and loaded by it; `adapter` is
    checked to be there before the model loads (the entry's `check_adapter`), and loaded by the front door."""
    entry = backend_entry(model_type_of(model_id_or_path))
    if adapter is not None and entry.check_adapter is not None:
        entry.check_adapter(adapter)
    return entry.load(model_id_or_path, **kwargs)


__all__ = ["BackendEntry", "ENTRY_POINT_GROUP", "FromScratch", "HubUnreachable", "backend_entry", "hub_error",
           "known_model_types", "load_backend", "model_type_of", "register_backend", "scratch_kit"]
