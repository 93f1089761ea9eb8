"""Full-depth FLOPs from the few layers `bench` ran: each layer's count scaled to the real depth.

`bench` counts every run with `flops.flop_counter` (the tower's attention kernel included) and keeps
the count of every module. A tower's FLOPs are its patch embedding, its blocks and its merger; blocks
of one kind (Qwen2.5-VL: windowed or full attention) cost the same on the same input, so

    full tower = counted tower - sum(counted blocks) + sum over the REAL blocks of the mean counted
                 block of that kind  (+ the merger's last linear rescaled to another shape's width),
    full LM    = counted LM - sum(counted layers) + real depth x one layer at the same prompt length.

A layer of another width (the 7B shapes' LMs) is counted on the meta device: the same counter and
the same decoder-layer class at that width, no weights and no arithmetic. Scaling is exact where
the maths is (tests: a 1-layer run scaled to 2 layers equals the 2-layer run's count).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


def module_totals(counter: Any) -> dict[str, int]:
    """FlopCounterMode -> {module name: FLOPs while it ran (children included)}; "Global" is everything."""
    return {name: int(sum(ops.values())) for name, ops in counter.get_flop_counts().items()}


def subtract(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    """Per-module a - b (what ran in `a`'s window apart from `b`'s nested one)."""
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}


@dataclass(frozen=True)
class TowerCount:
    """The vision tower's FLOPs as run (every call of one row summed)."""

    total: int                    # patch embedding + blocks + merger
    blocks: tuple[int, ...]       # per block that ran
    merger_out: int               # the merger's last linear (proportional to its output width)


@dataclass(frozen=True)
class LMCount:
    """The language model's prefill FLOPs as run."""

    total: int                    # everything the prefill counted (layers, final norm, head)
    layers: tuple[int, ...]       # per decoder layer that ran
    seq_len: int                  # the prompt length they ran at


def _root(totals: Mapping[str, int], tower_type: str) -> str | None:
    for name in totals:
        if name == tower_type or name.endswith(".visual"):
            return name
    return None


def tower_count(totals: Mapping[str, int], tower_type: str, n_blocks: int) -> TowerCount:
    """The tower's part of `totals` (module_totals of a window that ran it); zeros if it did not run."""
    root = _root(totals, tower_type)
    if root is None or totals.get(root, 0) == 0:
        return TowerCount(0, (0,) * n_blocks, 0)
    return TowerCount(totals[root], tuple(totals.get(f"{root}.blocks.{i}", 0) for i in range(n_blocks)),
                      totals.get(f"{root}.merger.mlp.2", 0))


def lm_count(totals: Mapping[str, int], n_layers: int, seq_len: int) -> LMCount:
    layers = {int(m.group(1)): v for k, v in totals.items()
              if (m := re.search(r"language_model\.layers\.(\d+)$", k))}
    if sorted(layers) != list(range(n_layers)):
        raise RuntimeError(f"the FLOP counter saw LM layers {sorted(layers)}, expected 0..{n_layers - 1}")
    return LMCount(totals["Global"], tuple(layers[i] for i in range(n_layers)), seq_len)


def full_tower_flops(count: TowerCount, kinds_run: Sequence[str], kinds_full: Sequence[str],
                     out_scale: float = 1.0) -> int:
    """The tower at full depth (`kinds_full`: one entry per real block), its merger output scaled by `out_scale`."""
    if count.total == 0:
        return 0
    per_kind: dict[str, list[int]] = {}
    for kind, flops in zip(kinds_run, count.blocks):
        per_kind.setdefault(kind, []).append(flops)
    missing = sorted(set(kinds_full) - set(per_kind))
    if missing:
        raise ValueError(f"no {missing} block ran, so the full tower cannot be scaled from this run")
    blocks = sum(sum(per_kind[k]) / len(per_kind[k]) for k in kinds_full)
    return round(count.total - sum(count.blocks) + blocks + count.merger_out * (out_scale - 1.0))


def full_lm_flops(count: LMCount, depth: int, layer_flops: float | None = None) -> int:
    """The LM prefill at `depth` layers of `layer_flops` (another width's layer at count.seq_len), by default of
    the mean layer that ran."""
    per_layer = sum(count.layers) / len(count.layers) if layer_flops is None else layer_flops
    return round(count.total - sum(count.layers) + depth * per_layer)


def lm_layer_flops(model: Any, text: Mapping[str, Any], seq_len: int) -> int:
    """FLOPs of one decoder layer of `model`'s LM class at the width `text` gives, on a prompt of `seq_len`
    tokens, counted on the meta device (no weights, no arithmetic; attention included)."""
    import torch

    from .flops import flop_counter

    layer_cls = type(model.model.language_model.layers[0])
    cfg = type(model.config.text_config)(**{k: v for k, v in text.items()})
    cfg._attn_implementation = "sdpa"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    with torch.device("meta"):
        layer = layer_cls(cfg, 0)
        x = torch.zeros(1, seq_len, cfg.hidden_size)
        cos = torch.zeros(1, seq_len, head_dim)
    with flop_counter() as counter:
        layer(x, attention_mask=None, position_embeddings=(cos, cos), position_ids=None)
    return int(counter.get_total_flops())
