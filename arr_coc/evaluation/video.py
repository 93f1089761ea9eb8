"""`eval` on ShapesVQA-video: every video method at the same budgets, accuracy against whole-prefill FLOPs.

For each batch of clips and each (method, budget, encode) the wrapper prepares the pruned prompt and the
language model answers; what it cost is counted off the clock with the FLOP counter around the same calls:
`prepare` (the vision tower on what it encoded, ARR-COC's own work, the packing) plus the LM prefill of each
item's pruned prompt. So `cost` is the whole prefill, vision tower included, as a share of the full model's.
Accuracy is exact match against the record's answers; `agree` is the share of items where the answer equals
the full model's own answer (what pruning should not change, whatever the model knows); paired 95% intervals
of the accuracy difference against the full model are normal approximations over items.

    python -m arr_coc eval --video-data data/shapes_video/test.jsonl --n 300 --methods none,arr_coc,evs,...
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from ..data.metrics import score_record
from .flops import count_flops

# (method, encode) pairs a video eval runs; "oracle" keeps the cells under the answer's boxes in each group.
VIDEO_METHODS = ("none", "arr_coc", "arr_coc@before", "evs", "uniform_frames", "random", "oracle")


def read_video_records(path: str | os.PathLike, n: int | None = None) -> list[dict[str, Any]]:
    """A ShapesVQA-video JSONL (`gen-data --video`) -> its records, each with `clip_path` resolved."""
    folder = os.path.dirname(os.fspath(path))
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "video" not in rec or "boxes_over_time" not in rec:
                raise ValueError(f"{path} is not a ShapesVQA-video split (records need 'video' and "
                                 "'boxes_over_time'); write one with: python -m arr_coc gen-data --video ...")
            rec["clip_path"] = os.path.join(folder, rec["video"])
            out.append(rec)
            if n is not None and len(out) >= n:
                break
    return out


def load_record_clip(rec: dict[str, Any]) -> Any:
    from ..shapes.video import load_clip_frames
    from ..video import load_clip

    return load_clip(load_clip_frames(rec["clip_path"]), frame_rate=float(rec.get("fps", 2)))


def oracle_cells(rec: dict[str, Any], grid_hw: tuple[int, int], size: tuple[int, int], groups: int,
                 temporal_patch: int = 2) -> list[torch.Tensor]:
    """Per temporal group, the cells under the answer's boxes in its frames (boxes in the record's frame size,
    `size` the processor's resized frame); one centre cell where the group has none."""
    from ..geometry import box_cell_set

    h, w = grid_hw
    out = []
    for g in range(groups):
        cells: set[int] = set()
        for f in range(g * temporal_patch, min(len(rec["boxes_over_time"]), (g + 1) * temporal_patch)):
            if rec["boxes_over_time"][f]:
                cells |= box_cell_set(rec["boxes_over_time"][f], (h, w), size, tuple(rec["size"]))
        out.append(torch.tensor(sorted(cells) or [(h // 2) * w + w // 2]))
    return out


@dataclass
class Row:
    correct: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)     # kept share of the clip's visual tokens
    flops: list[int] = field(default_factory=list)      # whole prefill: prepare (tower + selection) + LM prefill
    seconds: float = 0.0


def _configs(methods: Sequence[str], budgets: Sequence[float]) -> list[tuple[str, str, float]]:
    out = []
    for m in methods:
        name, _, encode = m.partition("@")
        if name == "none" or name == "oracle":   # the oracle encodes only its cells: its own (low) cost
            out.append((name, "after" if name == "none" else "before", 1.0 if name == "none" else 0.0))
            continue
        out.extend((name, encode or ("before" if name == "uniform_frames" else "after"), b) for b in budgets)
    return out


@torch.no_grad()
def evaluate_video(wrapper: Any, records: Sequence[dict[str, Any]], methods: Sequence[str] = VIDEO_METHODS,
                   budgets: Sequence[float] = (0.05, 0.1), batch_size: int = 4, max_new_tokens: int = 4,
                   progress: bool = True) -> dict[str, Any]:
    configs = _configs(methods, budgets)
    rows = {c: Row() for c in configs}
    batches = [list(records[i:i + batch_size]) for i in range(0, len(records), batch_size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(batches) * len(configs), desc="eval video", unit="run", dynamic_ncols=True)
    flops_memo: dict[tuple, int] = {}
    for batch in batches:
        clips = [load_record_clip(r) for r in batch]
        inputs = wrapper.build_inputs([[c] for c in clips], [r["question"] for r in batch])
        for config in configs:
            method, encode, budget = config
            t0 = time.perf_counter()
            kept_indices = None
            if method == "oracle":
                kept_indices = _oracle(wrapper, inputs, batch)
            run = dict(budget=None if method in ("none", "oracle") else budget,
                       method="none" if method == "oracle" else method, kept_indices=kept_indices,
                       encode=None if method == "none" else encode)
            (pruned, traces), prep_flops = count_flops(wrapper.prepare, inputs, **run)
            sequences, _ = wrapper.generate_pruned(pruned, max_new_tokens=max_new_tokens)
            answers = wrapper.tokenizer.batch_decode(sequences[:, pruned.input_ids.shape[1]:], skip_special_tokens=True)
            row = rows[config]
            row.seconds += time.perf_counter() - t0
            for b, (rec, tr) in enumerate(zip(batch, traces)):
                row.correct.append(score_record(answers[b].strip(), rec))
                row.answers.append(answers[b].strip())
                row.kept.append(tr.kept_tokens / max(1, tr.total_tokens))
                length = int(pruned.attention_mask[b].sum())
                if length not in flops_memo:
                    flops_memo[length] = _prefill_flops(wrapper, pruned, b)
                row.flops.append(prep_flops // len(batch) + flops_memo[length])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return summarise(rows, records)


def _oracle(wrapper: Any, inputs: dict[str, torch.Tensor], batch: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """Every unit's oracle cells (clips only: the batch holds one clip per record)."""
    from ..qwen.units import visual_units

    merge = wrapper.merge
    units = visual_units(inputs["mm_token_type_ids"], inputs["attention_mask"], inputs.get("image_grid_thw"),
                         inputs["video_grid_thw"], merge)
    patch = int(wrapper.processor.image_processor.patch_size)
    kept = []
    for v, members in enumerate(units.clips):
        _, gh, gw = units.grid_thw[members[0]].tolist()
        kept.extend(oracle_cells(batch[v], (gh // merge, gw // merge), (gw * patch, gh * patch), len(members)))
    return kept


def _prefill_flops(wrapper: Any, pruned: Any, b: int) -> int:
    """The LM prefill of row b alone (no padding, last-position logits), as `eval` counts it."""
    return count_flops(wrapper.prefill, pruned.rows([b]), logits_to_keep=1)[1]


def summarise(rows: dict[tuple[str, str, float], Row], records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    full = rows.get(("none", "after", 1.0))
    full_flops = float(np.mean(full.flops)) if full else float("nan")
    out = []
    types = sorted({r["qtype"] for r in records})
    for (method, encode, budget), row in rows.items():
        acc = float(np.mean(row.correct))
        entry: dict[str, Any] = {"method": method, "encode": encode, "budget": budget, "n": len(row.correct),
                                 "accuracy": round(acc, 4), "kept_share": round(float(np.mean(row.kept)), 4),
                                 "cost": round(float(np.mean(row.flops)) / full_flops, 4) if full else None,
                                 "flops_mean": float(np.mean(row.flops)), "seconds": round(row.seconds, 2)}
        if full is not None:
            diff = np.asarray(row.correct) - np.asarray(full.correct)
            half = 1.96 * float(diff.std(ddof=1)) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
            entry["vs_full"] = [round(float(diff.mean()) - half, 4), round(float(diff.mean()) + half, 4)]
            entry["agree"] = round(float(np.mean([a == f for a, f in zip(row.answers, full.answers)])), 4)
            entry["relative"] = round(acc / max(1e-9, float(np.mean(full.correct))), 4)
        entry["by_type"] = {t: round(float(np.mean([c for c, r in zip(row.correct, records) if r["qtype"] == t])), 4)
                            for t in types}
        entry["correct"] = [float(c) for c in row.correct]      # per clip, in `ids` order: what pairing needs
        out.append(entry)
    return {"n": len(records), "ids": [r.get("id") for r in records], "qtypes": [r["qtype"] for r in records],
            "results": out,
            "notes": {"cost": "whole prefill FLOPs (vision tower on what was encoded + ARR-COC's own work + packing + "
                              "LM prefill) as a share of the full model's",
                      "agree": "share of items answered as the full model answers them",
                      "vs_full": "paired 95% interval of the accuracy difference against the full model (normal)",
                      "seconds": "wall time of the row over all batches, FLOP counting included (not a latency)"}}


def table(report: dict[str, Any]) -> str:
    lines = ["| method | encode | budget | kept | cost (whole prefill) | accuracy | vs full (95%) | agree |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['method']} | {r['encode']} | {r['budget']} | {r['kept_share']:.3f} | "
                     f"{r['cost']:.3f} | {r['accuracy']:.3f} | {r.get('vs_full')} | {r.get('agree')} |")
    return "\n".join(lines)


__all__ = ["VIDEO_METHODS", "evaluate_video", "load_record_clip", "oracle_cells", "read_video_records", "summarise",
           "table"]
