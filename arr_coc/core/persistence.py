"""Saving and loading a trained layer like a checkpoint: a folder or a Hugging Face hub repository.

A saved layer is a folder (or a hub repository laid out the same way):

    config.json          the ARRCOCConfig (JSON round-trips exactly)
    model.safetensors    the weights
    README.md            the model card (`LayerCard`): what it was trained against and on, what it measured

`ARRCOCLayer.from_pretrained` takes a folder or a hub id ("owner/name", with `revision`, or "owner/name@revision"
where only a string can be passed: `arr_coc=`, `--arr-coc`); a hub id is
fetched with huggingface_hub into the usual cache (HF_HOME, or `cache_dir`) and, offline (HF_HUB_OFFLINE=1
or `local_files_only=True`), read from that cache, with an error that says what to do when it is not there.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


class SavedLayer(Protocol):
    """What the model card reads of a layer (`ARRCOCLayer` is one; it mixes `LayerPersistence` in)."""

    config: Any
    channel_names: list[str]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CARD_NAME = "README.md"
LAYER_FILES = (CONFIG_NAME, WEIGHTS_NAME)   # what a layer needs; the card is read by people
HUB_FILES = LAYER_FILES + (CARD_NAME,)
OPTIONAL_PREFIXES = ("participatory.token_proj.", "participatory.context.", "participatory.pair_query.",
                     "participatory.pair_out.")  # weights added later, zero-initialised (see from_pretrained)


@dataclass
class LayerCard:
    """What a shared layer's README says beyond its config: enough to know whether it fits your VLM."""

    vlm: str = "unknown"            # the frozen VLM it was trained against (hub id or folder)
    encode: str = "after"           # "after": reads the encoded tokens; "before": texture + question only
    data: list[str] = field(default_factory=list)      # training data (JSONL paths or data set names)
    training: str = ""              # recipe in one line (stages, steps, seed) or a pointer to it
    results: list[str] = field(default_factory=list)   # measured results, one Markdown line each


def model_card(layer: SavedLayer, card: LayerCard) -> str:
    """The README.md written beside a saved layer (Hugging Face model-card front matter + Markdown)."""
    cfg = layer.config
    att = cfg.attending
    mode = "mean" if att.spread_tau > 0 else "exact"
    lines = [
        "---", "library_name: arr-coc", "tags:", "- arr-coc", "- visual-token-pruning", "- qwen-vl",
        f"base_model: {card.vlm}" if looks_like_hub_id(card.vlm) and not os.path.exists(card.vlm) else
        f"# base model: {card.vlm} (not a hub id)",
        "---", "",
        "# ARR-COC layer", "",
        "A query-aware visual-token allocator for a frozen Qwen-VL (the ARR-COC-VIS project: load this folder or "
        "repository with `ARRCOCLayer.from_pretrained`, or pass it as `arr_coc=` to `ARRCOC.from_pretrained`): "
        "it scores every merged visual token from a texture array of the "
        "image and the question, and keeps a budget of them at their original M-RoPE positions.", "",
        "```python", "from arr_coc import ARRCOC",
        f'vlm = ARRCOC.from_pretrained("{card.vlm}", arr_coc="<this repository or folder>")',
        f'answer, trace = vlm.generate(image, "What color is the star?", budget=0.1, encode="{card.encode}")',
        "```", "",
        "| | |", "|---|---|",
        f"| trained against | {card.vlm} (question embeddings of width {cfg.knowing.query_dim}) |",
        f"| selects | {'before the vision tower: reads the texture array and the question only' if card.encode == 'before' else 'after the vision tower: reads the encoded visual tokens too'} |",
        f"| texture groups | {', '.join(cfg.texture.groups)} ({len(layer.channel_names)} channels) |",
        f"| default budget mode | {mode}" + (f" (scale by the {att.spread_source}, reference {att.spread_reference:.3g}, "
                                             f"clipped to [{att.spread_min:g}, {att.spread_max:g}])" if mode == "mean" else "")
        + " |",
        f"| training data | {', '.join(card.data) or 'not recorded'} |",
        f"| training | {card.training or 'not recorded'} |",
        "",
    ]
    if card.results:
        lines += ["## Results", ""] + card.results + [""]
    return "\n".join(lines)


class LayerPersistence:
    """`save_pretrained` / `from_pretrained` for `ARRCOCLayer` (mixed in)."""

    def save_pretrained(self, folder: str | os.PathLike, card: LayerCard | None = None) -> None:
        """Write config.json + model.safetensors + README.md (the model card) into `folder`."""
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            f.write(self.config.to_json())
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt", "arr_coc": "1"})
        if card is not None or not os.path.isfile(os.path.join(folder, CARD_NAME)):
            with open(os.path.join(folder, CARD_NAME), "w") as f:
                f.write(model_card(self, card or LayerCard()))

    @classmethod
    def from_pretrained(cls, name_or_folder: str | os.PathLike, *, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool | None = None,
                        token: str | bool | None = None, **overrides: Any) -> Any:
        """Load a folder written by `save_pretrained`, or a hub id ("owner/name", at `revision`) laid out
        the same way; `overrides` go to `ARRCOCConfig.replace` (e.g. `attending={"budget": 0.1}`)."""
        from safetensors.torch import load_file

        from .config import ARRCOCConfig

        folder = resolve_layer_folder(name_or_folder, revision, cache_dir, local_files_only, token)
        with open(os.path.join(folder, CONFIG_NAME)) as f:
            config = ARRCOCConfig.from_json(f.read())
        if overrides:
            config = config.replace(**overrides)
        layer = cls(config)
        weights = os.path.join(folder, WEIGHTS_NAME)
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder!s}; save the layer with save_pretrained first")
        missing, unexpected = layer.load_state_dict(load_file(weights), strict=False)
        # Layers saved before the participatory scorer gained its token projection, context conv and
        # pair MLP lack those weights; at their zero initialisation the layer scores exactly as they did.
        missing = [k for k in missing if not k.startswith(OPTIONAL_PREFIXES)]
        if layer.extent is None:  # loaded to count cells by perplexity (an override): its extent head goes unused
            unexpected = [k for k in unexpected if not k.startswith("extent.")]
        if missing or unexpected:
            raise RuntimeError(f"{weights} does not fit this ARR-COC config: missing {missing}, unexpected {unexpected}")
        return layer


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(name: str) -> bool:
    """'owner/name' (one slash, letters, digits, '-', '_', '.'), optionally '@revision': what the hub's
    repository ids look like."""
    repo = name.split("@", 1)[0]
    return bool(_HUB_ID.match(repo)) and ".." not in repo


def resolve_layer_folder(name_or_folder: str | os.PathLike, revision: str | None = None,
                         cache_dir: str | os.PathLike | None = None, local_files_only: bool | None = None,
                         token: str | bool | None = None) -> str:
    """The local folder holding a layer: `name_or_folder` itself, or a hub repository's snapshot in the cache."""
    name = os.fspath(name_or_folder)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, CONFIG_NAME)):
            raise FileNotFoundError(f"no {CONFIG_NAME} in {name}; expected a folder written by ARRCOCLayer.save_pretrained")
        return name
    if not looks_like_hub_id(name):
        raise FileNotFoundError(f"{name!r} is not a folder; pass the folder ARRCOCLayer.save_pretrained wrote, or a "
                                "Hugging Face hub id such as 'owner/arr-coc-layer' (or 'owner/arr-coc-layer@v2')")
    folder = hub_snapshot(name, revision, cache_dir, local_files_only, token, list(HUB_FILES), "ARR-COC layer",
                          f"python -c \"from arr_coc import ARRCOCLayer; ARRCOCLayer.from_pretrained('{name}')\"")
    if not os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        raise FileNotFoundError(f"hub repository {name!r} holds no {CONFIG_NAME}: it is not an ARR-COC layer "
                                "(expected config.json + model.safetensors, as save_pretrained writes)")
    return folder


def hub_snapshot(name: str, revision: str | None, cache_dir: str | os.PathLike | None, local_files_only: bool | None,
                 token: str | bool | None, patterns: list[str], what: str, download: str) -> str:
    """The snapshot folder of hub id `name` ("owner/name", optionally "@revision") holding `patterns`, fetched into
    the Hugging Face cache when online and read from it offline (HF_HUB_OFFLINE=1 or `local_files_only`); a
    FileNotFoundError that says what to do otherwise. `what` names the thing in errors ("ARR-COC layer"),
    `download` is the command that fetches it once online. One owner for layers and adapters."""
    if "@" in name:          # 'owner/name@revision': the revision inside the id (what --arr-coc and arr_coc= take)
        name, at = name.split("@", 1)
        if revision is not None and revision != at:
            raise ValueError(f"two revisions for {name!r}: {at!r} in the id and revision={revision!r}; give one")
        revision = at
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache_dir, token=token,
                                 local_files_only=bool(local_files_only) or offline, allow_patterns=patterns)
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "local_files_only=True" if local_files_only else \
            "the hub could not be reached"
        raise FileNotFoundError(
            f"{what} {name!r}{f' at revision {revision!r}' if revision else ''} is not in the Hugging Face cache "
            f"and {why}; download it once online ({download}), or pass a local folder") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise FileNotFoundError(f"no {what} {name!r}{f' at revision {revision!r}' if revision else ''} on the "
                                f"hub ({type(exc).__name__}); check the id, or pass token= for a private one") from exc


__all__ = ["LayerCard", "LayerPersistence", "hub_snapshot", "model_card", "resolve_layer_folder"]
