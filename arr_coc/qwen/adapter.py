"""LoRA adapters for the frozen Qwen-VL, in peft's own format, active only for pruned requests.

The VLM was trained on whole images; an adapter teaches it to read what ARR-COC keeps (docs/TRAINING.md, "Adapters
(stage 2 and 3)"). It is a peft LoRA (`LoraConfig` + `get_peft_model` / `PeftModel.from_pretrained`) on

    tower_attn   every vision block's attention: qkv, proj
    tower_mlp    every vision block's MLP: the family's linears (`Family.tower_mlp`)
    lm_attn      every language-model layer's attention: q_proj, k_proj, v_proj, o_proj
    lm_mlp       every language-model layer's MLP: gate_proj, up_proj, down_proj (not a default)

peft injects the LoRA layers into the model in place (the backend keeps calling the model it had) and its layers
start **disabled**: `Adapter.active(True)` enables them for one call, and they are disabled again after it. A disabled
LoRA layer runs its base layer alone, so a request that keeps every token is the stock model bit for bit. Where the
switch is decided: `arr_coc.pipeline.look` (docs/DESIGN.md, "Adapters").

The switch flips the flag peft's own switch flips (`enable_adapter_layers` / `disable_adapter_layers`, what
`PeftModel.disable_adapter()` toggles) on the tuner layers found once at construction. peft's switch walks every
module of the model and resets every LoRA weight's requires_grad on each call (1.8 ms per on + off on the embedded
model, more with a real one's hundreds of layers; a pruned request switches twice), and its requires_grad is
reset to the adapter's own setting right after anyway. A peft whose tuner layers do not keep that flag, or an adapter
with other peft wrappers, gets peft's switch (`_fast_switch`); tests/test_adapter.py holds the two switches to the
same state and the same logits.

A saved adapter is a folder (or a hub repository, or the `adapter/` folder beside a saved layer):

    adapter_config.json         peft's LoraConfig
    adapter_model.safetensors   peft's LoRA weights
    arr_coc_adapter.json        the base model it was trained on (family, widths, depths), its targets, its training
    README.md                   the model card

Before peft reads a folder, `check_adapter` refuses (one line, `AdapterError`) a missing folder, files that cannot
be read (a JSON file that is not an object, a weights file cut short or not safetensors: `adapter_folder` reads
them before any model loads), an adapter for another base model (family, widths, depths) and weights whose shapes
or rank do not fit this model.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..adapter_files import (  # noqa: F401 - re-exported: the adapter's files are read where any backend reads them
    ADAPTER_FILES, BASE_FILE, CARD_FILE, CONFIG_FILE, DEFAULT_TARGETS, NAME, RESAVE, SUBFOLDER, TARGET_GROUPS,
    WEIGHTS_FILE, AdapterCard, AdapterError, _first_line, adapter_folder, read_config, read_json, weight_shapes)
from .families import family_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel

def target_pattern(model: PreTrainedModel, targets: Sequence[str] = DEFAULT_TARGETS) -> str:
    """peft's `target_modules` as one regular expression (full match on module names) for this model's family."""
    unknown = [t for t in targets if t not in TARGET_GROUPS]
    if unknown or not targets:
        raise AdapterError(f"unknown adapter targets {unknown or list(targets)}; choose from {', '.join(TARGET_GROUPS)}")
    family = family_of(model)
    names = {"tower_attn": r"model\.visual\.blocks\.\d+\.attn\.(qkv|proj)",
             "tower_mlp": r"model\.visual\.blocks\.\d+\.mlp\.(" + "|".join(family.tower_mlp) + ")",
             "lm_attn": r"model\.language_model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
             "lm_mlp": r"model\.language_model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)"}
    return "(" + "|".join(names[t] for t in targets) + ")"


def base_identity(model: PreTrainedModel) -> dict[str, Any]:
    """What an adapter must match: the family and the widths and depths of the tower and the language model."""
    cfg = model.config
    text, vision = cfg.text_config, cfg.vision_config
    keys_text = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    keys_vision = ("depth", "embed_dim", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size")
    return {"model_type": cfg.model_type,
            "text": {k: getattr(text, k) for k in keys_text if getattr(text, k, None) is not None},
            "vision": {k: getattr(vision, k) for k in keys_vision if getattr(vision, k, None) is not None}}


class Adapter:
    """A LoRA adapter injected into a model (peft), disabled except inside `active(True)`."""

    def __init__(self, peft_model: Any, name: str, targets: Sequence[str], card: AdapterCard | None = None,
                 trainable: bool = False):
        self.peft_model = peft_model
        self.name = name                     # its folder or hub id ("" for a fresh one), as traces report it
        self.targets = tuple(targets)
        self.card = card or AdapterCard()
        self.trainable = trainable           # whether its LoRA weights take gradients (train-adapter)
        self._lora = [p for n, p in self.model.named_parameters() if ".lora_" in n]   # peft injected them already
        self._tuners = _fast_switch(self.model)   # the layers peft's switch flips, or None: peft's switch
        self._on = True
        self._switch(False)
        self.dropout(False)                  # peft's new modules start in training mode: answers must not be random

    def dropout(self, on: bool) -> None:
        """LoRA dropout on (train-adapter's steps) or off (inference, validation); the VLM itself stays in eval."""
        for name, module in self.model.named_modules():
            if name.split(".")[-1] == "lora_dropout" or ".lora_dropout." in f"{name}.":
                module.train(on)

    @property
    def model(self) -> PreTrainedModel:
        return self.peft_model.base_model.model

    @property
    def rank(self) -> int:
        return int(self.peft_model.peft_config[NAME].r)

    def _switch(self, on: bool) -> None:
        """The tuner layers' flag (module docstring), else peft's switch, which also sets the LoRA weights'
        requires_grad: that is the adapter's own business, set back to `trainable`."""
        if on == self._on:
            return
        if self._tuners is not None:
            for layer in self._tuners:
                layer._disable_adapters = not on
        else:
            (self.peft_model.base_model.enable_adapter_layers if on else
             self.peft_model.base_model.disable_adapter_layers)()
        self._on = on
        for p in self.parameters():
            p.requires_grad_(self.trainable)

    @contextmanager
    def active(self, on: bool = True) -> Iterator[None]:
        """Inside, the LoRA layers run when `on`, the base layers alone otherwise (peft's enable / disable switch);
        the state before is restored after. Outside any such context the model is stock."""
        before = self._on
        self._switch(on)
        try:
            yield
        finally:
            self._switch(before)

    def lora_layers(self) -> Iterator[tuple[str, Any]]:
        from peft.tuners.lora import LoraLayer

        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and NAME in getattr(module, "r", {}):
                yield name, module

    def flops_per_token(self) -> tuple[int, int]:
        """The adapter's extra FLOPs for one token through every adapted linear: (per vision-tower patch row, per
        language-model token). LoRA on a linear d_in -> d_out of rank r is x A^T B^T: 2 r (d_in + d_out)."""
        tower = lm = 0
        for name, module in self.lora_layers():
            base = module.get_base_layer()
            flops = 2 * int(module.r[NAME]) * (int(base.in_features) + int(base.out_features))
            if ".visual." in f".{name}.":
                tower += flops
            else:
                lm += flops
        return tower, lm

    def parameters(self) -> list[Any]:
        """The LoRA weights (what training moves), found once at construction (not per switch: a request switches
        the adapter on and off several times)."""
        return list(self._lora)

    def save_pretrained(self, folder: str | os.PathLike, card: AdapterCard | None = None) -> None:
        """peft's files + the base model's identity + the model card."""
        folder = os.fspath(folder)
        self.peft_model.save_pretrained(folder)
        with open(os.path.join(folder, BASE_FILE), "w") as f:
            json.dump({"base": base_identity(self.model), "targets": list(self.targets),
                       "card": asdict(card or self.card)}, f, indent=1)
        with open(os.path.join(folder, CARD_FILE), "w") as f:
            f.write(adapter_card(self, card or self.card))


def _fast_switch(model: PreTrainedModel) -> list[Any] | None:
    """The modules peft's switch visits (`BaseTuner._enable_adapter_layers`: its tuner layers and auxiliary
    wrappers), when all of them are tuner layers holding peft's `_disable_adapters` flag; else None."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    visited = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    if all(isinstance(m, BaseTunerLayer) and isinstance(m.__dict__.get("_disable_adapters"), bool) for m in visited):
        return visited
    return None


def attach_adapter(model: PreTrainedModel, rank: int = 16, alpha: float = 32.0,
                   targets: Sequence[str] = DEFAULT_TARGETS, dropout: float = 0.0, seed: int = 0) -> Adapter:
    """A fresh LoRA on `model` (in place, trainable; B = 0, so it starts as the stock model even when active)."""
    import torch
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise AdapterError(f"rank must be at least 1, got {rank}")
    config = LoraConfig(r=int(rank), lora_alpha=float(alpha), lora_dropout=float(dropout), bias="none",
                        target_modules=target_pattern(model, targets))
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)     # transformers' rename, asked by peft
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    return Adapter(peft_model, "", targets, trainable=True)


def layer_adapter(layer: Any, model: PreTrainedModel, model_name: str) -> str | None:
    """The adapter a trained layer's folder holds (`layer/adapter/`, as `ARRCOC.save_pretrained` and
    train-adapter write it), when it was trained for this base model: its arr_coc_adapter.json names the same
    base (family, widths, depths) and its card the same model (folder or hub id). -> the layer folder to load it
    from (`load_adapter` finds adapter/ in it); None when there is none or it is for another model (the layer
    then runs alone). A file there that cannot be read is AdapterError: a default is never silently dropped."""
    if not isinstance(layer, (str, os.PathLike)):
        return None
    folder = os.path.join(os.fspath(layer), SUBFOLDER)
    if not all(os.path.isfile(os.path.join(folder, f)) for f in (CONFIG_FILE, WEIGHTS_FILE, BASE_FILE)):
        return None
    saved = read_json(folder, BASE_FILE)
    if _first_difference(saved.get("base", {}), base_identity(model)):
        return None
    from ..paths import shown_path

    return shown_path(layer) if _same_model(str(saved.get("card", {}).get("vlm", "")), model_name) else None


def _same_model(a: str, b: str) -> bool:
    """Two names of one model: the same folder (a card's relative folder is the repository's) or hub id."""
    from ..paths import REPO_ROOT

    def where(name: str) -> str:
        for path in (name, os.path.join(REPO_ROOT, name)):
            if name and os.path.isdir(path):
                return os.path.realpath(path)
        return name.rstrip("/")
    return bool(a) and where(a) == where(b)


def check_adapter(model: PreTrainedModel, folder: str) -> dict[str, Any]:
    """Refuse (AdapterError, one line) an adapter that does not fit `model`, before peft or the model runs.
    -> its adapter_config.json."""
    config = read_config(folder)
    if os.path.isfile(os.path.join(folder, BASE_FILE)):
        saved = read_json(folder, BASE_FILE).get("base", {})
        mine = base_identity(model)
        diff = _first_difference(saved, mine)
        if diff:
            raise AdapterError(f"the adapter in {folder} was trained for another base model ({diff}); load it with the "
                               f"model it was trained on ({config.get('base_model_name_or_path') or 'see its README'})")
    _check_shapes(model, folder, config["r"])
    return config


def _first_difference(saved: dict[str, Any], mine: dict[str, Any], at: str = "") -> str:
    for key in sorted(set(saved) | set(mine)):
        a, b = saved.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = _first_difference(a, b, f"{at}{key}.")
            if found:
                return found
        elif a != b:
            return f"{at}{key}: adapter {a!r}, model {b!r}"
    return ""


def _check_shapes(model: PreTrainedModel, folder: str, rank: int) -> None:
    """Every LoRA matrix names a linear of this model and has its shape at the config's rank."""
    modules = dict(model.named_modules())
    for key, shape in weight_shapes(folder).items():
        match = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if match is None:
            raise AdapterError(f"{folder}: weight {key!r} is not a LoRA matrix; ARR-COC loads LoRA adapters only")
        name, which = match.groups()
        module = modules.get(name)
        base = getattr(module, "base_layer", module)
        if base is None or not hasattr(base, "in_features"):
            raise AdapterError(f"{folder}: the adapter adapts {name!r}, which this model does not have as a linear "
                               "layer: it was trained for another base model")
        want = (rank, base.in_features) if which == "A" else (base.out_features, rank)
        if shape != want:
            raise AdapterError(f"{folder}: {key} has shape {list(shape)} where this model at rank {rank} needs "
                               f"{list(want)} (another rank or another base model); retrain it for this model")


def load_adapter(model: PreTrainedModel, name_or_folder: str | os.PathLike, trainable: bool = False) -> Adapter:
    """An adapter saved in peft's format, checked against `model` (`check_adapter`), injected into it in place."""
    from peft import PeftModel

    folder = adapter_folder(name_or_folder)
    check_adapter(model, folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            peft_model = PeftModel.from_pretrained(model, folder, adapter_name=NAME, is_trainable=trainable)
        except (TypeError, ValueError, KeyError, OSError, RuntimeError) as exc:   # e.g. a config peft cannot read
            raise AdapterError(f"peft could not load the adapter in {folder} ({type(exc).__name__}: "
                               f"{_first_line(exc)}); {RESAVE}") from None
    targets, card = DEFAULT_TARGETS, AdapterCard()
    if os.path.isfile(os.path.join(folder, BASE_FILE)):
        saved = read_json(folder, BASE_FILE)
        targets = tuple(saved.get("targets", targets))
        card = AdapterCard(**{k: v for k, v in saved.get("card", {}).items() if k in AdapterCard.__dataclass_fields__})
    return Adapter(peft_model, os.fspath(name_or_folder), targets, card, trainable=trainable)


def adapter_card(adapter: Adapter, card: AdapterCard) -> str:
    """The README.md written beside the adapter's weights."""
    n = sum(p.numel() for p in adapter.parameters())
    total = sum(p.numel() for n_, p in adapter.model.named_parameters() if ".lora_" not in n_)
    lines = ["---", "library_name: peft", "tags:", "- arr-coc", "- lora", "- visual-token-pruning", "---", "",
             "# ARR-COC adapter", "",
             "LoRA adapters (peft) that teach a frozen Qwen-VL to read the visual tokens an ARR-COC layer keeps. They "
             "are active only when tokens are pruned: with every token kept the model is the stock one.", "",
             "```python", "from arr_coc import ARRCOC",
             f'vlm = ARRCOC.from_pretrained("{card.vlm}", arr_coc="{card.layer or "<the layer>"}", '
             'adapter="<this folder or repository>")',
             f'answer, trace = vlm.generate(image, "What color is the star?", budget=0.05, encode="{card.encode}")',
             "```", "", "| | |", "|---|---|",
             f"| base model | {card.vlm} ({adapter.model.config.model_type}) |",
             f"| trained with the layer | {card.layer or 'not recorded'} (encode={card.encode}) |",
             f"| targets | {', '.join(adapter.targets)}, rank {adapter.rank} |",
             f"| LoRA parameters | {n:,} ({100 * n / max(1, total):.2f}% of the model's {total:,}) |",
             f"| training | {card.training or 'not recorded'} |", ""]
    if card.results:
        lines += ["## Results", ""] + card.results + [""]
    return "\n".join(lines)


__all__ = ["ADAPTER_FILES", "Adapter", "AdapterCard", "AdapterError", "DEFAULT_TARGETS", "SUBFOLDER", "TARGET_GROUPS",
           "layer_adapter",
           "adapter_card", "adapter_folder", "attach_adapter", "base_identity", "check_adapter", "load_adapter",
           "target_pattern"]
