"""The evaluation loop: accuracy vs. visual-token budget, ARR-COC beside the anchor methods.

Every method runs on the same model, the same batches and the same code path
(`ARRCOCQwen.prepare` -> prefill -> greedy `generate_pruned`), one (method, budget) after the
other inside each batch, so machine drift hits all of them alike. Per (method, budget):

- accuracy: each record's metric (`arr_coc.data.score_record`: exact match after normalisation unless
  the record asks for "vqa" accuracy or POPE's "yesno"), overall and per type;
- coverage: share of the cells under the JSONL boxes (the objects the answer depends on) that
  the method kept, mean over items with boxes (None for `downscale`, which keeps every region
  at a lower resolution, and when no item has boxes);
- kept / total visual tokens, against the ORIGINAL image's token count (so `downscale` reports
  its smaller image's tokens out of the original's);
- prefill FLOPs (`flops.py`): the LM prefill of each item's pruned prompt (alone, no padding,
  logits of the last position only, as `generate` does), plus the selector's own work per item
  (FastV's partial prefill, VisionZip's attention weights, the ARR-COC layer, ...). **The vision
  tower is not included**: it is the same for every method except `downscale`, whose smaller
  image also costs the vision tower less (its latency shows that). A selector whose FLOPs cannot
  be counted makes the row's FLOPs unknown (null), never 0;
- latency: wall time per item of processor + vision tower + selection + input rewrite + LM
  prefill (time to first token), the batch's time divided by its size; median over batches;
- fallbacks: items that kept every token because the method failed on them ("keep_all") and
  items of low structure that the allocator covered with a grid ("grid").

Strict mode (the default of `python -m arr_coc eval`): a row whose selector raised, or fell back
to keeping every token, is reported as **failed**, with the error, not as that method's accuracy
(the library's keep-all fallback is right for users, wrong for a benchmark). A budget that keeps
every token of every image (1.0) prunes nothing: such rows run no selector and repeat `none`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import statistics
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

from ..budget import Budget, BudgetMode, resolve_count
from ..data import VQARecord
from ..qwen.encoding import EncodeConfig
from .flops import count_flops
from .plans import MethodPlan

if TYPE_CHECKING:
    from ..qwen import ARRCOCQwen
    from ..training.distributed import Processes

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("method", "budget", "accuracy", "coverage", "kept_tokens_mean", "total_tokens_mean",
                 "prefill_flops_mean", "latency_s_median", "per_type", "status")


def resolve_methods(spec: str, arr_coc_weights: str | None = None) -> tuple[list[str], dict[str, str]]:
    """'all' or 'a,b' -> (methods to run in order, {skipped method: why})."""
    from ..methods import METHODS
    from ..selection import available_methods

    names = list(METHODS) if spec.strip() == "all" else [m.strip() for m in spec.split(",") if m.strip()]
    known = set(METHODS) | set(available_methods())
    unknown = [m for m in names if m not in known]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {sorted(known)} or 'all'")
    skipped = {}
    if "arr_coc_trained" in names and not arr_coc_weights:
        skipped["arr_coc_trained"] = ("no --arr-coc-weights PATH given; pass the folder of trained ARR-COC weights "
                                      "(config.json + model.safetensors) to evaluate them")
    names = [m for m in dict.fromkeys(names) if m not in skipped]
    if not names:
        raise ValueError("no method left to run; pick methods with --methods")
    return names, skipped


def load_wrapper(model: str, device: str = "cpu", seed: int = 0, attempts: int = 3, dtype: str = "auto",
                 attn_implementation: str | None = None, arr_coc: str | None = None) -> ARRCOCQwen:
    """ARRCOCQwen.from_pretrained with a clear error; retries a moment later if a checkpoint is mid-save.

    arr_coc: the ARR-COC layer the wrapper builds (a folder, a hub id; None: the untrained layer).
    device / dtype / attn_implementation: `arr_coc.runtime`'s names (a wrong one raises RuntimeChoiceError
    at once, before anything loads; it is never retried).
    """
    from ..qwen import ARRCOCQwen, HubUnreachable
    from ..runtime import Runtime, RuntimeChoiceError

    run = Runtime.resolve(device, dtype, attn_implementation)
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) is not None   # org/name, e.g. Qwen/Qwen2.5-VL-7B-Instruct
    if (os.path.sep in model or model.startswith(".")) and not hub_id:
        if not os.path.isdir(model):
            raise SystemExit(f"eval: no model folder at {model}; train the embedded model with "
                             "`python -m arr_coc train-vlm --out checkpoints/shapes-qwen2vl` or pass --model PATH")
    for attempt in range(attempts):
        try:
            wrapper = ARRCOCQwen.from_pretrained(model, arr_coc=arr_coc, device=run.device, dtype=run.dtype,
                                                 attn_implementation=run.attn_implementation)
            break
        except (HubUnreachable, RuntimeChoiceError):   # retrying changes neither
            raise
        except Exception as exc:  # noqa: BLE001 - a training job may be rewriting the folder right now
            if attempt == attempts - 1:
                raise
            logger.warning("loading %s failed (%s); retrying in 5 s", model, exc)
            time.sleep(5)
    wrapper.seed = seed
    return wrapper


@dataclasses.dataclass
class _Rows:
    """Per-item measurements of one (method, budget)."""

    correct: list[float] = dataclasses.field(default_factory=list)
    answers: list[str] = dataclasses.field(default_factory=list)
    coverage: list[float | None] = dataclasses.field(default_factory=list)  # per item; None: no boxes (or downscale)
    types: list[str] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)      # per item: visual tokens the LM read
    encoded: list[int] = dataclasses.field(default_factory=list)   # per item: cells encoded at full resolution
    total: list[int] = dataclasses.field(default_factory=list)
    prefill_flops: list[float | None] = dataclasses.field(default_factory=list)    # None: unknown
    selector_flops: list[float | None] = dataclasses.field(default_factory=list)   # None: unknown
    vision_flops: list[int] = dataclasses.field(default_factory=list)      # per item: gist + tower, as run
    latency: list[float] = dataclasses.field(default_factory=list)   # per item, one entry per batch
    fallback: list[str | None] = dataclasses.field(default_factory=list)   # per item: None | "grid" | "keep_all"
    looks: list[int] = dataclasses.field(default_factory=list)       # per item: passes it took (1: no saccade)
    errors: list[str] = dataclasses.field(default_factory=list)      # distinct failures of the method

    def extend(self, other: _Rows) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))


def configs_for(methods: Sequence[str], budgets: Sequence[Budget]) -> list[tuple[str, Budget]]:
    """(method, budget) pairs: `none` once at 1.0, every other method at every budget."""
    out: list[tuple[str, Budget]] = []
    for m in methods:
        if m == "none":
            out.append((m, 1.0))
        else:
            out.extend((m, b) for b in budgets)
    return out


def evaluate(wrapper: ARRCOCQwen, records: Sequence[VQARecord], methods: Sequence[str], budgets: Sequence[Budget],
             batch_size: int = 8, seed: int = 0, max_new_tokens: int = 8, fastv_layer: int = 2,
             arr_coc_weights: str | None = None, progress: bool = True, strict: bool = True,
             budget_mode: BudgetMode | None = None, encode: EncodeConfig | None = None,
             processes: Processes | None = None) -> dict[str, Any]:
    """Run every (method, budget) on `records`; returns {"n", "results", ...} (see the module docstring).

    `processes` (several, under a launcher: `arr_coc.training.distributed`): each process runs a contiguous
    share of the batches (the same batches one process runs, so every item's outcome is the same: selection
    is content-seeded, decoding greedy), and every process returns the whole report.
    """
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    torch.manual_seed(seed)
    wrapper.seed = seed
    plans = {m: MethodPlan(m, wrapper, fastv_layer, arr_coc_weights) for m in methods}
    configs = configs_for(methods, budgets)
    rows: dict[tuple[str, Budget], _Rows] = {c: _Rows() for c in configs}
    failed: dict[tuple[str, Budget], str] = {}
    batches = [list(records[i:i + batch_size]) for i in range(0, len(records), batch_size)]
    if processes is not None:
        batches = batches[processes.share(len(batches))]
        progress = progress and processes.is_main
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches) * len(configs), desc="eval", unit="run", dynamic_ncols=True)
    encode = encode or EncodeConfig()
    flops_memo: dict[Any, int] = {}   # LM prefill FLOPs depend only on the prompt length, the tower's on the grid
    t_start = time.perf_counter()
    for batch in batches:
        images = [rec.load_image() for rec in batch]
        t0 = time.perf_counter()
        inputs = wrapper.build_inputs([[im] for im in images], [rec.question for rec in batch])
        build_s = time.perf_counter() - t0
        grids = [(int(h) // wrapper.merge, int(w) // wrapper.merge) for _, h, w in inputs["image_grid_thw"].tolist()]
        everything: _Rows | None = None  # a budget that keeps every token IS `none`: run once, shared
        for config in configs:
            method, budget = config
            if bar is not None:
                bar.set_postfix_str(f"{method} @ {budget}")
            if config in failed:
                pass
            elif all(resolve_count(budget, h * w) >= h * w for h, w in grids):
                if everything is None:
                    everything = run_one(wrapper, plans["none"] if "none" in plans else MethodPlan("none", wrapper),
                                         batch, images, inputs, build_s, 1.0, grids, max_new_tokens, flops_memo)
                    # every token kept: the stock full encoding, whatever the mode
                rows[config].extend(everything)
            else:
                got = run_one(wrapper, plans[method], batch, images, inputs, build_s, budget, grids, max_new_tokens,
                              flops_memo, strict=strict, budget_mode=budget_mode, encode=encode)
                rows[config].extend(got)
                if strict and got.errors:
                    failed[config] = got.errors[0]
                    logger.warning("eval: %s @ %s failed (%s); its row is reported as failed", method, budget,
                                   got.errors[0])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if processes is not None and processes.world > 1:  # the shares in rank order are the batches in order
        shares = processes.gather((rows, failed))
        rows, failed = {c: _Rows() for c in configs}, {}
        for their_rows, their_failed in shares:
            for c in configs:
                rows[c].extend(their_rows[c])
            for c, error in their_failed.items():
                failed.setdefault(c, error)  # the first failure in batch order, as one process reports it
    results = [summarise(method, budget, rows[(method, budget)], failed.get((method, budget)),
                         encode.mode if plans[method].selects_before and budget != 1.0 else "after")
               for method, budget in configs]
    return {
        "n": len(records), "ids": [rec.id for rec in records], "results": results,
        "methods": list(methods), "budgets": list(budgets),
        "seed": seed, "batch_size": batch_size, "fastv_layer": fastv_layer, "strict": strict,
        "budget_mode": budget_mode,
        "encode": dataclasses.asdict(encode),
        "seconds": round(time.perf_counter() - t_start, 2),
        "notes": {
            "prefill_flops_mean": "FlopCounterMode: LM prefill of the item's pruned prompt (no padding, last-position "
                                  "logits) + the selector's own FLOPs per item; vision tower excluded; null when the "
                                  "selector's FLOPs could not be counted",
            "vision_flops_mean": "the vision tower as the row ran it: every patch (encode after) or the gist plus the "
                                 "encoded cells (encode before); attention included",
            "e2e_flops_mean": "vision_flops_mean + prefill_flops_mean: the whole prefill (vision tower, selector, LM)",
            "latency_s_median": "per item: processor + vision tower + selection + rewrite + LM prefill; median "
                                "over batches. passes > 1: up to the final answer's first token (every earlier "
                                "look in full, its decoding included)",
            "passes_mean": "encode before with passes > 1: looks per item (1: no saccade); saccade_share: items "
                           "that looked more than once; each look's tower and LM prefill are in the FLOPs",
            "coverage": "share of the JSONL boxes' cells kept, mean over items with boxes; null for downscale",
            "full_coverage": "share of the items with boxes whose box cells were all kept; null for downscale",
            "total_tokens_mean": "visual tokens of the ORIGINAL image (downscale reports its smaller image's "
                                 "tokens as kept)",
            "keep_all": "a budget that keeps every token of every image runs no selector: that row repeats none",
            "status": "ok, or failed (strict mode: the selector raised or kept every token of an item; see error)",
        },
    }


def run_one(wrapper: ARRCOCQwen, plan: MethodPlan, batch: Sequence[VQARecord], images: Sequence[Any],
            inputs: dict[str, Any], build_s: float, budget: Budget, grids: Sequence[tuple[int, int]],
            max_new_tokens: int, flops_memo: dict[Any, int], strict: bool = False,
            budget_mode: BudgetMode | None = None, encode: EncodeConfig | None = None) -> _Rows:
    """One (method, budget) on one batch: per-item measurements (or the failure, in strict mode)."""
    import torch

    from ..data import score_record
    from ..geometry import box_cell_set
    from ..methods import downscale
    from ..qwen import SelectorFailed
    from .vision_cost import vision_flops

    rows = _Rows()
    t0 = time.perf_counter()
    run = plan.for_batch(wrapper, batch, images, inputs, build_s, budget, grids)
    prep_s = run.prep_s if run.inputs is inputs else time.perf_counter() - t0
    if encode is not None and encode.passes > 1 and plan.selects_before and run.method != "none":
        return run_looks(wrapper, run, batch, images, prep_s, budget, grids, max_new_tokens, flops_memo, strict,
                         budget_mode, encode)
    t1 = time.perf_counter()
    try:
        with run.around, torch.no_grad():
            pruned, traces = wrapper.prepare(run.inputs, budget=None if run.method == "none" else budget,
                                             method=run.method, budget_mode=budget_mode, strict=strict,
                                             encode=encode if plan.selects_before and run.method != "none" else None)
    except SelectorFailed as exc:
        rows.errors.append(str(exc))
        return rows
    if strict and any(fb == "keep_all" for tr in traces for fb in tr.fallback):
        rows.errors.append(next(tr.error for tr in traces if "keep_all" in tr.fallback) or "kept every token")
        return rows
    t2 = time.perf_counter()
    wrapper.prefill(pruned, logits_to_keep=1)
    t3 = time.perf_counter()
    rows.latency.append((prep_s + (t2 - t1) + (t3 - t2)) / len(batch))

    select_flops = run.counted.flops() if run.counted is not None else 0
    vision = vision_flops(wrapper, run.inputs, traces, (encode or EncodeConfig()).gist, flops_memo)
    sequences, _ = wrapper.generate_pruned(pruned, max_new_tokens=max_new_tokens)
    answers = wrapper.tokenizer.batch_decode(sequences[:, pruned.input_ids.shape[1]:], skip_special_tokens=True)
    unit = downscale.pixel_unit(getattr(wrapper.processor, "image_processor", wrapper.processor))
    for b, (rec, tr) in enumerate(zip(batch, traces)):
        rows.looks.append(1)
        rows.correct.append(score_record(answers[b].strip(), rec))
        rows.answers.append(answers[b].strip())
        rows.coverage.append(None)
        rows.types.append(rec.type or "other")
        rows.kept.append(int(tr.kept_tokens))
        rows.encoded.append(sum(int(c.numel()) for c in tr.encoded_cells) if tr.encoded_cells else int(tr.total_tokens))
        rows.total.append(int(grids[b][0] * grids[b][1]))
        rows.fallback.append(next((fb for fb in tr.fallback if fb), None))
        length = int(pruned.attention_mask[b].sum())
        if length not in flops_memo:
            flops_memo[length] = count_flops(wrapper.prefill, pruned.rows([b]), logits_to_keep=1)[1]
        per_item = None if select_flops is None else select_flops / len(batch)
        rows.prefill_flops.append(None if per_item is None else flops_memo[length] + per_item)
        rows.selector_flops.append(per_item)
        rows.vision_flops.append(vision[b])
        if plan.name != "downscale" and rec.boxes:
            h, w = grids[b]
            cells = box_cell_set(rec.boxes, (h, w), (w * unit, h * unit), images[b].size)
            if cells:
                kept = set(int(i) for i in tr.kept_indices[0].tolist())
                rows.coverage[-1] = len(kept & cells) / len(cells)
    return rows


def run_looks(wrapper: ARRCOCQwen, run: Any, batch: Sequence[VQARecord], images: Sequence[Any], prep_s: float,
              budget: Budget, grids: Sequence[tuple[int, int]], max_new_tokens: int, flops_memo: dict[Any, int],
              strict: bool, budget_mode: BudgetMode | None, encode: EncodeConfig) -> _Rows:
    """`run_one` for encode="before" with passes > 1 (`arr_coc.qwen.saccades.look`): every look's tower and LM
    prefill is counted for the items that took it; latency is the time to the final answers' first token."""
    import torch

    from ..data import score_record
    from ..geometry import box_cell_set
    from ..methods import downscale
    from ..qwen import SelectorFailed
    from ..qwen.saccades import look
    from .vision_cost import vision_flops

    rows = _Rows()
    try:
        with run.around, torch.no_grad():
            looked = look(wrapper, run.inputs, budget, run.method, budget_mode, strict, encode,
                          max_new_tokens=max_new_tokens)
    except SelectorFailed as exc:
        rows.errors.append(str(exc))
        return rows
    traces = looked.traces
    if strict and any(fb == "keep_all" for tr in traces for fb in tr.fallback):
        rows.errors.append(next(tr.error for tr in traces if "keep_all" in tr.fallback) or "kept every token")
        return rows
    rows.latency.append((prep_s + looked.ttft_s) / len(batch))
    select_flops = run.counted.flops() if run.counted is not None else 0
    vision = vision_flops(wrapper, run.inputs, traces, encode.gist, flops_memo)
    answers = wrapper.tokenizer.batch_decode(looked.new_tokens, skip_special_tokens=True)
    unit = downscale.pixel_unit(getattr(wrapper.processor, "image_processor", wrapper.processor))
    for b, (rec, tr) in enumerate(zip(batch, traces)):
        prefill = 0
        for p in looked.passes:                               # every prompt this item was prefilled with
            if b in p.rows:
                length = p.pruned.lengths[p.rows.index(b)]
                if length not in flops_memo:
                    flops_memo[length] = count_flops(wrapper.prefill, p.pruned.rows([p.rows.index(b)]),
                                                     logits_to_keep=1)[1]
                prefill += flops_memo[length]
        per_item = None if select_flops is None else select_flops / len(batch)
        rows.looks.append(len(tr.looks))
        rows.correct.append(score_record(answers[b].strip(), rec))
        rows.answers.append(answers[b].strip())
        rows.coverage.append(None)
        rows.types.append(rec.type or "other")
        rows.kept.append(int(tr.kept_tokens))
        rows.encoded.append(sum(int(c.numel()) for c in tr.encoded_cells))
        rows.total.append(int(grids[b][0] * grids[b][1]))
        rows.fallback.append(next((fb for fb in tr.fallback if fb), None))
        rows.prefill_flops.append(None if per_item is None else prefill + per_item)
        rows.selector_flops.append(per_item)
        rows.vision_flops.append(vision[b])
        if rec.boxes:
            h, w = grids[b]
            cells = box_cell_set(rec.boxes, (h, w), (w * unit, h * unit), images[b].size)
            if cells:
                rows.coverage[-1] = len(set(int(i) for i in tr.kept_indices[0].tolist()) & cells) / len(cells)
    return rows


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _known_mean(xs: Sequence[float | None]) -> float | None:
    """Mean, or None when any value is unknown (a partial sum would read as a cheaper method)."""
    return None if any(x is None for x in xs) else _mean(xs)  # type: ignore[arg-type]


def summarise(method: str, budget: Budget, r: _Rows, error: str | None = None,
              encode: str = "after") -> dict[str, Any]:
    """The report row of one (method, budget); a failed row reports its error and no accuracy."""
    if error is not None:
        return {"method": method, "budget": budget, "encode": encode, "status": "failed", "error": error,
                "accuracy": None, "vision_flops_mean": None, "e2e_flops_mean": None,
                "coverage": None, "full_coverage": None, "kept_tokens_mean": None, "total_tokens_mean": None,
                "prefill_flops_mean": None, "latency_s_median": None, "per_type": {}, "kept_share": None,
                "selector_flops_mean": None, "n": 0, "n_with_boxes": 0, "fallbacks": {}, "correct": [],
                "answers": [], "item_coverage": [], "item_kept": [], "item_encoded": [], "item_total": [],
                "passes_mean": None, "saccade_share": None, "per_type_looks": {}, "item_looks": []}
    by_type: dict[str, list[float]] = defaultdict(list)
    looks_by_type: dict[str, list[int]] = defaultdict(list)
    for t, c, n in zip(r.types, r.correct, r.looks):
        by_type[t].append(c)
        looks_by_type[t].append(n)
    kept, total = _mean(r.kept), _mean(r.total)
    covered = [c for c in r.coverage if c is not None]  # the items with boxes
    return {
        "method": method,
        "budget": budget,
        "encode": encode,
        "status": "ok",
        "accuracy": _mean(r.correct),
        "coverage": _mean(covered) if method != "downscale" else None,
        # share of items with boxes whose answer cells were ALL kept
        "full_coverage": _mean([float(c == 1.0) for c in covered]) if method != "downscale" else None,
        "kept_tokens_mean": kept,
        "total_tokens_mean": total,
        "prefill_flops_mean": _known_mean(r.prefill_flops),
        "vision_flops_mean": _mean(r.vision_flops),
        "e2e_flops_mean": _known_mean([None if p is None else p + v for p, v in zip(r.prefill_flops, r.vision_flops)]),
        "latency_s_median": float(statistics.median(r.latency)) if r.latency else None,
        "per_type": {t: _mean(v) for t, v in sorted(by_type.items())},
        # passes > 1: mean looks per item and the share of items that made a saccade, overall and per type
        "passes_mean": _mean(r.looks),
        "saccade_share": _mean([float(n > 1) for n in r.looks]),
        "per_type_looks": {t: {"passes_mean": _mean(v), "saccade_share": _mean([float(n > 1) for n in v])}
                           for t, v in sorted(looks_by_type.items())},
        "kept_share": kept / total if kept is not None and total else None,
        "selector_flops_mean": _known_mean(r.selector_flops),
        "n": len(r.correct),
        "n_with_boxes": len(covered),
        "fallbacks": {k: r.fallback.count(k) for k in ("grid", "keep_all") if k in r.fallback},
        # per item, in the report's `ids` order: what paired comparisons between methods need
        "correct": [int(c) if c in (0, 1) else c for c in r.correct],   # VQA accuracy gives 0.3, 0.6, 0.9
        "answers": list(r.answers),              # what the VLM generated (stripped), as scored
        "item_coverage": list(r.coverage),  # share of the item's box cells kept; null without boxes
        "item_kept": list(r.kept),          # visual tokens the LM read (what the cost at another width needs)
        "item_encoded": list(r.encoded),    # cells the tower encoded at full resolution (after: the whole grid)
        "item_total": list(r.total),        # the full grid's merged cells
        "item_looks": list(r.looks),        # looks the item took (1: no saccade)
    }
