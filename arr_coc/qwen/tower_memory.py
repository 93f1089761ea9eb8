"""A saccade's tower pass that attends to what earlier looks encoded, without encoding it again.

Measured on the validation split (docs/RESULTS.md, "Saccades"): when a second look encodes its cells in
a tower segment of their own, they never see the first look's cells, and their tokens are worse than the
same cells encoded together (count questions, 64 items: 25 right against 35 for the union encoded at
once). So, as a language model extends its KV cache, the tower keeps every full-attention block's keys
and values of the cells it encoded (`TowerMemory`, per image), and a later look's queries attend to
those keys and values and to its own (`attending`). Cells already encoded are never run again: their
tokens stay as the first look made them, and only the new cells pay for the tower (their attention reads
K_old + K_new keys). With one vision block the new cells' tokens equal the stock encoding of the union
exactly (tests/test_saccades.py); deeper, the earlier cells' keys are the ones their own look computed.

Qwen2-VL and Qwen3-VL towers (full attention in every block). Qwen2.5-VL's window blocks attend within
windows of the packed sequence's order, so for that family a later look keeps a segment of its own
(`supports`), and says so in its docstring.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from .families import FAMILIES

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def supports(model: PreTrainedModel) -> bool:
    """Whether a later look's tower can attend to earlier looks' keys (`families.Family.tower_memory`)."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    return family is not None and family.tower_memory


def _rotary(model: PreTrainedModel):
    return importlib.import_module(type(model.model.visual).__module__).apply_rotary_pos_emb_vision


class TowerMemory:
    """Per image, per vision block: the keys and values [rows, heads, head_dim] (rotary applied) of every
    patch row the tower encoded for it so far, in the order they were encoded."""

    def __init__(self) -> None:
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def add(self, image: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        old = self.kv.get(image)
        self.kv[image] = layer_kv if old is None else [
            (torch.cat([ok, k]), torch.cat([ov, v])) for (ok, ov), (k, v) in zip(old, layer_kv)]


def _split_qkv(attn: Any, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = qkv.shape[0]
    return qkv.reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)


@contextmanager
def remembering(model: PreTrainedModel, memory: TowerMemory, images: Sequence[int] | None) -> Iterator[None]:
    """Record the keys and values of the LAST tower pass run inside (its segments are `images`, in order; None:
    segment j is image j) into `memory`. Hooks only read: the pass's results are unchanged."""
    visual = model.model.visual
    rotary = _rotary(model)
    seen: dict[str, Any] = {}

    def start(module, args, kwargs):               # a new tower pass: keep only the last one
        seen.clear()
        seen["cu"], seen["pe"], seen["qkv"] = kwargs["cu_seqlens"], kwargs["position_embeddings"], []

    def keep(module, args, output):
        if "qkv" in seen:
            seen["qkv"].append(output)

    hooks = [visual.blocks[0].register_forward_pre_hook(start, with_kwargs=True)]
    hooks += [blk.attn.qkv.register_forward_hook(keep) for blk in visual.blocks]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    if not seen.get("qkv"):
        return
    cos, sin = seen["pe"]
    bounds = seen["cu"].tolist()
    per_layer = []
    for blk, qkv in zip(visual.blocks, seen["qkv"]):
        q, k, v = _split_qkv(blk.attn, qkv)
        _, k = rotary(q, k, cos, sin)
        per_layer.append((k, v))
    for j in range(len(bounds) - 1):
        a, b = bounds[j], bounds[j + 1]
        memory.add(j if images is None else images[j], [(k[a:b], v[a:b]) for k, v in per_layer])


@contextmanager
def attending(model: PreTrainedModel, memory: TowerMemory, images: Sequence[int]) -> Iterator[None]:
    """Inside, every tower block's attention lets the queries of segment j (image `images[j]`) attend to that
    image's remembered keys and values as well as to its own; the new keys and values are remembered too."""
    visual = model.model.visual
    rotary = _rotary(model)
    new: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def make(layer: int, attn: Any):
        def forward(hidden_states, cu_seqlens, position_embeddings=None, **kwargs):
            q, k, v = _split_qkv(attn, attn.qkv(hidden_states))
            cos, sin = position_embeddings
            q, k = rotary(q, k, cos, sin)
            bounds = cu_seqlens.tolist()
            out, mine = [], []
            for j, image in enumerate(images):
                a, b = bounds[j], bounds[j + 1]
                old_k, old_v = memory.kv[image][layer]
                keys, values = torch.cat([old_k, k[a:b]]), torch.cat([old_v, v[a:b]])
                o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                                   values.transpose(0, 1)[None], scale=attn.scaling)
                out.append(o[0].transpose(0, 1).reshape(b - a, -1))
                mine.append((k[a:b], v[a:b]))
            new.append(mine)
            return attn.proj(torch.cat(out).to(hidden_states.dtype))
        return forward

    for layer, blk in enumerate(visual.blocks):
        blk.attn.forward = make(layer, blk.attn)
    try:
        yield
    finally:
        for blk in visual.blocks:
            del blk.attn.forward                   # the class's forward again
    if new:
        for j, image in enumerate(images):
            memory.add(image, [layer[j] for layer in new])
