"""The checkpoint's input embedding, read row by row where no model is loaded (the plugin's processor).

Where the choice runs in the processor (Qwen3-VL clips, `settings.GROUPED_CLIP_FAMILIES`), the question's token
embeddings come from the checkpoint's safetensors, only the question's rows (`safe_open(...).get_slice(name)`),
cast to the dtype the server's model holds them in: the rows `embed_input_ids` would return (vLLM loads the
checkpoint's tensor into a parameter of the serving dtype, which is the same rounding as this cast). Pure Python and
torch, tested without vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch

from ...qwen.families import EMBEDDING_TENSORS as EMBEDDING_NAMES   # the families' checkpoints' tensor names


class CheckpointEmbedding:
    """[N, L] token ids -> [N, L, D] rows of the checkpoint's input embedding, in `dtype` (as `padded_questions`
    calls an embedding). Rows are read once each and kept."""

    def __init__(self, folder: str, dtype: torch.dtype):
        self.file, self.name = embedding_tensor(folder)
        self.dtype = dtype
        self.rows: dict[int, torch.Tensor] = {}

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        wanted = sorted(set(ids.reshape(-1).tolist()) - set(self.rows))
        if wanted:
            from safetensors import safe_open

            with safe_open(self.file, framework="pt") as f:
                table = f.get_slice(self.name)
                for i in wanted:
                    self.rows[i] = table[i:i + 1][0].to(self.dtype)
        if ids.numel() == 0:
            return torch.zeros((*ids.shape, self.width()), dtype=self.dtype)
        flat = torch.stack([self.rows[i] for i in ids.reshape(-1).tolist()])
        return flat.reshape(*ids.shape, -1)

    def width(self) -> int:
        from safetensors import safe_open

        with safe_open(self.file, framework="pt") as f:
            return int(f.get_slice(self.name).get_shape()[-1])


def embedding_tensor(folder: str, names: Sequence[str] = EMBEDDING_NAMES) -> tuple[str, str]:
    """(the safetensors file, the tensor name) of the language model's input embedding in a checkpoint folder:
    the index's entry (`model.safetensors.index.json`) where the weights are sharded, else `model.safetensors`."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weights = json.load(f)["weight_map"]
        for name in names:
            if name in weights:
                return os.path.join(folder, weights[name]), name
        raise ValueError(f"{index} lists none of {list(names)}: the plugin reads the question's embedding rows there "
                         "for Qwen3-VL clips; serve a checkpoint saved by transformers")
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"{folder} holds no model.safetensors(.index.json): the plugin reads the question's "
                         "embedding rows from the checkpoint's safetensors for Qwen3-VL clips; serve a checkpoint "
                         "saved as safetensors")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        keys = set(f.keys())
    for name in names:
        if name in keys:
            return single, name
    raise ValueError(f"{single} holds none of {list(names)}: the plugin reads the question's embedding rows there "
                     "for Qwen3-VL clips; serve a checkpoint saved by transformers")


def checkpoint_folder(model: str, revision: str | None = None) -> str:
    """The local folder of a served model: itself, or the hub's cached snapshot (vLLM downloaded it at start)."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.safetensors.index.json"])


__all__ = ["CheckpointEmbedding", "EMBEDDING_NAMES", "checkpoint_folder", "embedding_tensor"]
