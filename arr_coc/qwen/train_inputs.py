"""What training through the frozen Qwen-VL keeps of a prompt: each row's unpruned prompt as `soft_answer_loss` reads
it (`QwenBackend.answer_prompts`), and the content hash of the model a cache of features is keyed by."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch

from ..pipeline.prompt import IMAGE
from .processing import image_processor_of
from .prompt import PromptTokens, visual_units


def answer_prompts(inputs: Mapping[str, Any], tokens: PromptTokens, merge: int) -> list[dict[str, torch.Tensor]]:
    """Per batch row, on the host: {"input_ids": [1, S_b] the row without its padding, "image_grid_thw": [n_b, 3]
    the grids of its images, in order}. Images only (what the layer and the adapters train on)."""
    ids = inputs["input_ids"].cpu()
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.cpu()
    grids = inputs["image_grid_thw"].cpu()
    mm = inputs.get("mm_token_type_ids")
    mm = (ids == tokens.image).long() + 2 * (ids == tokens.video).long() if mm is None else mm.cpu()
    units = visual_units(mm, mask, grids, None, merge)
    image_rows = [row for (row, _, _), kind in zip(units.spans, units.kind) if kind == IMAGE]
    return [{"input_ids": ids[b][mask[b].bool()][None],
             "image_grid_thw": grids[[k for k, row in enumerate(image_rows) if row == b]]}
            for b in range(ids.shape[0])]


def fingerprint(model: Any, processor: Any) -> str:
    """sha256 of the model's weights, its image processor's settings, the chat template and the vocabulary.

    Hashing the weights takes about 0.8 s per GiB on a 2-core CPU (some 4 s for a 2B model in bf16)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())
    h.update(image_processor_of(processor).to_json_string().encode())
    h.update(str(getattr(processor, "chat_template", "")).encode())
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()


__all__ = ["answer_prompts", "fingerprint"]
