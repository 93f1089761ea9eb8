"""Add texture channel groups to a trained layer without changing what it scores.

A layer's channel count is fixed by its config's `texture.groups`; three weights read the channels
(the information scorer's per-channel weights, the first convolutions of the perspectival CNN and of
the participatory cell projection). `widen_texture` appends groups to the config and copies every
weight, giving the new channels zero input weights (and a vanishing information weight), so the
widened layer scores as the old one did, up to float round-off, and training then learns what the new
channels add: `train --init LAYER --add-texture silhouette,orientation`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..core.layer import ARRCOCLayer
from ..core.texture import channel_names

# softplus(-30) ~ 1e-13: the information scorer's weight of a new channel, next to old weights of order 1
# (softplus keeps it positive, so it cannot start at exactly zero; its gradient is not zero either).
_NEW_INFORMATION_RAW = -30.0

# The weights whose input dimension is the texture channels: name -> that dimension.
CHANNEL_INPUTS = {
    "information.channel_weight_raw": 0,
    "perspectival.cnn.0.weight": 1,
    "participatory.cell_proj.0.weight": 1,
}


def widen_texture(layer: ARRCOCLayer, groups: Sequence[str]) -> ARRCOCLayer:
    """A new layer whose texture array also has `groups` (appended), scoring as `layer` does."""
    groups = tuple(groups)
    have = layer.config.texture.groups
    again = [g for g in groups if g in have]
    if again:
        raise ValueError(f"the layer's texture already has {again} (its groups: {list(have)}); add other groups")
    config = layer.config.replace(texture={"groups": have + groups})
    wide = ARRCOCLayer(config)
    n_old = len(channel_names(layer.config.texture))
    old_state = layer.state_dict()
    new_state = wide.state_dict()
    with torch.no_grad():
        for name, new in new_state.items():
            old = old_state[name]
            if name not in CHANNEL_INPUTS:
                if old.shape != new.shape:
                    raise RuntimeError(f"{name} changed shape {tuple(old.shape)} -> {tuple(new.shape)} with the "
                                       "texture channels; widen_texture must learn how to carry it over")
                new.copy_(old)
                continue
            dim = CHANNEL_INPUTS[name]
            new.fill_(_NEW_INFORMATION_RAW if name.startswith("information.") else 0.0)
            new.narrow(dim, 0, n_old).copy_(old)
    wide.load_state_dict(new_state)
    wide.train(layer.training)
    return wide
