"""The embedded model's checkpoint I/O: the shipped folder plus the resumable training state, and warm starts."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from .losses import DenseHead
from .vlm_config import VLMTrainConfig


def warm_start(model, head: DenseHead, init: str) -> int:
    """Load the weights of another run (its --state file, or a checkpoint folder such as the shipped
    model, whose dense head starts fresh) and return the first training item not used by that run."""
    if os.path.isdir(init):
        # The folder's keys are the saved (hub) layout; the model class maps them on load.
        loaded = type(model).from_pretrained(init)
        model.load_state_dict(loaded.state_dict())
        with open(os.path.join(init, "training_log.json")) as f:
            return json.load(f)["progress"]["item"]
    saved = torch.load(init, weights_only=True)
    model.load_state_dict(saved["model"])
    head.load_state_dict(saved["head"])
    return saved["progress"]["item"]  # fresh training items, never repeats of that run's


def save(model, processor, head, opt, state: dict, gen: torch.Generator, cfg: VLMTrainConfig) -> None:
    """Checkpoint folder (usable at any time) + resumable training state."""
    os.makedirs(cfg.out, exist_ok=True)
    lm = model.model.language_model
    trained_with = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")
    model.save_pretrained(cfg.out, safe_serialization=True)
    lm.set_attn_implementation(trained_with)
    processor.save_pretrained(cfg.out)
    os.makedirs(os.path.dirname(cfg.state) or ".", exist_ok=True)
    progress = dict(state, gen_state=gen.get_state())
    torch.save({"model": model.state_dict(), "head": head.state_dict(),
                "optimizer": opt.state_dict() if opt is not None else None,
                "progress": progress, "torch_rng": torch.get_rng_state()}, cfg.state + ".tmp")
    os.replace(cfg.state + ".tmp", cfg.state)
    cfg_dict = {k: v for k, v in asdict(cfg).items() if k != "log"}
    with open(os.path.join(cfg.out, "training_log.json"), "w") as f:
        json.dump({"config": cfg_dict, "progress": {k: v for k, v in state.items() if k != "log"}, "log": state["log"]}, f, indent=1)
