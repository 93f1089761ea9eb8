"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: every way the three families differ for the pruning, in one entry each.

What is the same is written once (`arr_coc.qwen.backend`); what differs is a field here, read where it matters:

| field           | Qwen2-VL | Qwen2.5-VL | Qwen3-VL | where it matters |
|---|---|---|---|---|
| windows         | no  | yes (112 px windows in 28 of 32 blocks) | no  | `encoding.py`: windows assigned on the full grid; whole windows as context |
| position_table  | no  | no  | yes (learned, interpolated) | `encoding.py`: the table's indices and weights gathered from the full grid |
| deepstack       | no  | no  | yes | `rewrite.py`: deepstack features travel with the kept tokens |
| tower_memory    | yes | no (window order) | yes | a later look attends to earlier looks' keys (`tower_memory.py`) |
| timestamps      | no  | no  | yes (`<t seconds>` per temporal group) | `processing.py`: a video's prompt |
| patch           | 14 px | 14 px | 16 px | the merged cell: 28 or 32 px |
| tower_mlp       | fc1, fc2 | gate_proj, up_proj, down_proj | linear_fc1, linear_fc2 | `adapter.py`: LoRA targets |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..encode import EncodeConfig

# Where a saved checkpoint of any of the three families holds its language model's input embedding (transformers
# 4.5x and 5.x save the first; older Qwen2-VL checkpoints the others): read row by row where no model is loaded
# (the vLLM plugin's processor, `arr_coc.serving.vllm.checkpoint`).
EMBEDDING_TENSORS = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight",
                     "language_model.model.embed_tokens.weight")


@dataclass(frozen=True)
class Family:
    """One Qwen-VL family (module docstring)."""

    name: str                   # the checkpoint's config.model_type
    model_class: str            # its transformers class
    windows: bool               # the tower attends within windows in most blocks
    position_table: bool        # a learned position table, interpolated to the grid
    deepstack: bool             # the tower feeds features into early LM layers as well
    tower_memory: bool          # full attention in every block: a later look can attend to earlier looks' keys
    timestamps: bool            # a video's prompt has a '<t seconds>' block per temporal group
    patch: int                  # pixels per patch side
    tower_mlp: tuple[str, ...]  # the linear layers of a vision block's MLP (`adapter.py`'s LoRA targets)

    def check_encode(self, encode: EncodeConfig) -> None:
        """Refuse what this family's tower cannot do (before any work): whole windows need windows."""
        if encode.windows and not self.windows:
            raise ValueError(f"windows=True (--whole-windows) applies to Qwen2.5-VL only, whose vision tower "
                             f"attends within windows; this model ({self.name}) has no window attention. Use "
                             "margin=1 (--margin 1) to encode a ring of context cells around the chosen ones instead")


QWEN2_VL = Family("qwen2_vl", "Qwen2VLForConditionalGeneration", windows=False, position_table=False,
                  deepstack=False, tower_memory=True, timestamps=False, patch=14,
                  tower_mlp=("fc1", "fc2"))
QWEN2_5_VL = Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", windows=True, position_table=False,
                    deepstack=False, tower_memory=False, timestamps=False, patch=14,
                    tower_mlp=("gate_proj", "up_proj", "down_proj"))
QWEN3_VL = Family("qwen3_vl", "Qwen3VLForConditionalGeneration", windows=False, position_table=True,
                  deepstack=True, tower_memory=True, timestamps=True, patch=16,
                  tower_mlp=("linear_fc1", "linear_fc2"))

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL)}


def family_of(model_or_name: Any) -> Family:
    """The family of a model (its config's model_type) or of a model_type; ValueError naming the three else."""
    name = model_or_name if isinstance(model_or_name, str) else \
        getattr(getattr(model_or_name, "config", None), "model_type", None)
    if name not in FAMILIES:
        raise ValueError(f"ARRCOCQwen wraps {sorted(FAMILIES)} models; got model_type={name!r}. "
                         "Load a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint.")
    return FAMILIES[name]


__all__ = ["FAMILIES", "Family", "QWEN2_5_VL", "QWEN2_VL", "QWEN3_VL", "family_of"]
