"""The evaluation loop: accuracy vs. visual-token budget, ARR-COC beside the anchor methods, on images or clips.

Every method runs on the same model, the same batches and the same code path (the pipeline: `ARRCOC.answer`,
one look or several, then greedy decoding), one (method, budget) after the other inside each batch, so machine
drift hits all of them alike. A split of clips (`gen-data --video`) is a split like any other: its items are
clips, each a request whose units are its temporal groups. Per (method, budget):

- accuracy: each record's metric (`arr_coc.data.score_record`: exact match after normalisation unless the record
  asks for "vqa" accuracy or POPE's "yesno"), overall and per type; with a `none` row, `agree` (answered as the
  full model answers) and `vs_full` (the paired 95% interval of the difference);
- coverage (images): share of the cells under the JSONL boxes (the objects the answer depends on) that the method
  kept, mean over items with boxes (None for `downscale`, which keeps every region at a lower resolution);
- kept / total visual tokens, against the ORIGINAL visual's token count (so `downscale` reports its smaller
  image's tokens out of the original's; a clip counts every temporal group's);
- FLOPs per item (`cost.py`): the vision tower as the row ran it, the selector's own work, the LM prefill of the
  item's pruned prompt (every look's); `e2e_flops_mean` is their sum, `cost` its share of the `none` row's. A
  selector whose FLOPs cannot be counted makes the row's FLOPs unknown (null), never 0;
- latency: wall time per item of processor + vision tower + selection + input rewrite + LM prefill (time to
  first token), the batch's time divided by its size; median over batches;
- fallbacks: items that kept every token because the method failed on them ("keep_all") and items of low
  structure that the allocator covered with a grid ("grid").

Strict mode (the default of `python -m arr_coc eval`): a row whose selector raised, or fell back to keeping every
token, is reported as **failed**, with the error, not as that method's accuracy (the library's keep-all fallback
is right for users, wrong for a benchmark). A budget that keeps every token of every item (1.0) prunes nothing:
such rows run no selector and repeat `none`.
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

from ..budget import Budget, BudgetMode, count_of
from ..encode import EncodeConfig
from ..pipeline.selection import method_info, methods_where
from .items import Item, as_items
from .plans import MethodPlan, split_spec
from .report import paired_stats

if TYPE_CHECKING:
    from ..front import ARRCOC
    from ..distributed import Processes

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("method", "budget", "accuracy", "coverage", "kept_tokens_mean", "total_tokens_mean",
                 "prefill_flops_mean", "latency_s_median", "per_type", "status")


def resolve_methods(spec: str, arr_coc_weights: str | None = None, video: bool = False
                    ) -> tuple[list[str], dict[str, str]]:
    """'all' or 'a,b' (each `name` or `name@encode`) -> (methods to run in order, {skipped method: why}). `all` is
    every method of the registry that can be given this split's visuals (`Method.video` / `Method.images`)."""
    if spec.strip() == "all":
        names = methods_where(video=True, in_all=True) if video else methods_where(images=True, in_all=True)
    else:
        names = [m.strip() for m in spec.split(",") if m.strip()]
    unknown, skipped = [], {}
    for m in names:
        try:
            info = method_info(split_spec(m)[0])
        except ValueError:
            unknown.append(m)
            continue
        if video and not info.video:
            skipped[m] = ("it cannot run on a video split (it reads the unpruned prompt's layout, or changes the "
                          "image)")
        elif not video and not info.images:
            skipped[m] = "it prunes clips only (a video anchor)"
    if unknown:
        known = methods_where()
        raise ValueError(f"unknown method(s) {unknown}; choose from {known} (optionally name@after / "
                         "name@before) or 'all'")
    if any(split_spec(m)[0] == "arr_coc_trained" for m in names) and not arr_coc_weights:
        skipped["arr_coc_trained"] = ("no --arr-coc-weights PATH given; pass the folder of trained ARR-COC weights "
                                      "(config.json + model.safetensors) to evaluate them")
    names = [m for m in dict.fromkeys(names) if m not in skipped and split_spec(m)[0] not in skipped]
    if not names:
        raise ValueError("no method left to run; pick methods with --methods" +
                         (f" (skipped: {'; '.join(f'{k}: {v}' for k, v in skipped.items())})" if skipped else ""))
    return names, skipped


def load_vlm(model: str, device: str = "cpu", seed: int = 0, attempts: int = 3, dtype: str = "auto",
             attn_implementation: str | None = None, arr_coc: str | None = None, fast: str | bool = False,
             adapter: str | None = None) -> ARRCOC:
    """ARRCOC.from_pretrained (the checkpoint's backend) with a clear error; retries a moment later if a checkpoint
    is mid-save.

    arr_coc: the ARR-COC layer it builds (a folder, a hub id; None: the untrained layer). adapter: LoRA
    adapters for its pruned requests (`ARRCOC.from_pretrained(adapter=...)`; an unfit one is never retried).
    device / dtype / attn_implementation: `arr_coc.runtime`'s names (a wrong one raises RuntimeChoiceError
    at once, before anything loads; it is never retried). fast: `ARRCOC.from_pretrained`'s, or "buckets":
    the fast path's fixed shapes (each choice filled to its bucket, `arr_coc.buckets`) run eagerly, without
    compiling, so a report shows what the fill alone changes against `fast="off"`.
    """
    from ..adapter_files import AdapterError
    from ..front import ARRCOC
    from ..pipeline.registry import HubUnreachable
    from ..runtime import Runtime, RuntimeChoiceError

    run = Runtime.resolve(device, dtype, attn_implementation)
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", model) is not None   # org/name, e.g. Qwen/Qwen2.5-VL-7B-Instruct
    if (os.path.sep in model or model.startswith(".")) and not hub_id:
        if not os.path.isdir(model):
            raise SystemExit(f"eval: no model folder at {model}; train the embedded model with `python -m "
                             "arr_coc_shapes train-vlm --out checkpoints/shapes-qwen2vl` or pass --model PATH")
    for attempt in range(attempts):
        try:
            vlm = ARRCOC.from_pretrained(model, arr_coc=arr_coc, device=run.device, dtype=run.dtype,
                                         attn_implementation=run.attn_implementation,
                                         fast=False if fast == "buckets" else fast, adapter=adapter)
            break
        except (HubUnreachable, RuntimeChoiceError, AdapterError):   # retrying changes none of them
            raise
        except Exception as exc:  # noqa: BLE001 - a training job may be rewriting the folder right now
            if attempt == attempts - 1:
                raise
            logger.warning("loading %s failed (%s); retrying in 5 s", model, exc)
            time.sleep(5)
    if fast == "buckets":
        from ..buckets import Buckets
        from ..execution import Execution

        vlm.use(Execution(buckets=Buckets(), label="buckets (eager)"))
    vlm.seed = seed
    return vlm


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
    adapter_flops: list[int] = dataclasses.field(default_factory=list)     # per item: of vision + prefill, the adapter's
    latency: list[float] = dataclasses.field(default_factory=list)   # per item, one entry per batch
    fallback: list[str | None] = dataclasses.field(default_factory=list)   # per item: None | "grid" | "keep_all"
    looks: list[int] = dataclasses.field(default_factory=list)       # per item: passes it took (1: no saccade)
    notes: list[list[str]] = dataclasses.field(default_factory=list)  # per item: the trace's notes (a budget raised)
    errors: list[str] = dataclasses.field(default_factory=list)      # distinct failures of the method

    def extend(self, other: _Rows) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))


Config = tuple[str, Budget]


def configs_for(methods: Sequence[str], budgets: Sequence[Budget]) -> list[Config]:
    """(method, budget) pairs: `none` once at 1.0, every other method at every budget."""
    out: list[Config] = []
    for m in methods:
        if m == "none":
            out.append((m, 1.0))
        else:
            out.extend((m, b) for b in budgets)
    return out


@dataclasses.dataclass
class _Batch:
    """One batch of items as every (method, budget) of it reads them."""

    items: list[Item]
    visuals: list[Any]
    inputs: dict[str, Any]
    build_s: float
    cells: list[int]        # per item: its visual tokens (a clip: every temporal group's)


def _load(vlm: ARRCOC, items: list[Item]) -> _Batch:
    from ..pipeline.backend import visual_grids

    sampling = vlm.video_sampling()
    visuals = [it.load(sampling) for it in items]
    t0 = time.perf_counter()
    inputs = vlm.backend.build_inputs([[v] for v in visuals], [it.question for it in items])
    build_s = time.perf_counter() - t0
    cells = [g.cells for g in visual_grids(vlm.backend, inputs)]   # one visual per item
    return _Batch(items, visuals, inputs, build_s, cells)


@dataclasses.dataclass
class _Run:
    """What an evaluation holds fixed: the plans, the settings, the rows so far."""

    vlm: ARRCOC
    plans: dict[str, MethodPlan]
    configs: list[Config]
    max_new_tokens: int
    strict: bool
    budget_mode: BudgetMode | None
    cell_px: int | None = None      # the processed picture's pixels per cell side (box coverage); None: unknown
    memo: dict[Any, int] = dataclasses.field(default_factory=dict)   # FLOPs by shape: prompt length, grid, cells
    rows: dict[Config, _Rows] = dataclasses.field(default_factory=dict)
    failed: dict[Config, str] = dataclasses.field(default_factory=dict)

    def batch(self, batch: _Batch, bar: Any = None) -> None:
        """Every (method, budget) on one batch, in order."""
        everything: _Rows | None = None  # a budget that keeps every token IS `none`: run once, shared
        for config in self.configs:
            method, budget = config
            if bar is not None:
                bar.set_postfix_str(f"{method} @ {budget}")
            if config in self.failed:
                pass
            elif all(count_of(budget, n) >= n for n in batch.cells):
                if everything is None:
                    plan = self.plans.get("none") or MethodPlan("none", self.vlm)
                    everything = run_one(self, plan, batch, 1.0)
                self.rows[config].extend(everything)
            else:
                got = run_one(self, self.plans[method], batch, budget)
                self.rows[config].extend(got)
                if self.strict and got.errors:
                    self.failed[config] = got.errors[0]
                    logger.warning("eval: %s @ %s failed (%s); its row is reported as failed", method, budget,
                                   got.errors[0])
            if bar is not None:
                bar.update(1)


def evaluate(vlm: ARRCOC, records: Sequence[Any], methods: Sequence[str], budgets: Sequence[Budget],
             batch_size: int = 8, seed: int = 0, max_new_tokens: int = 8, fastv_layer: int = 2,
             arr_coc_weights: str | None = None, progress: bool = True, strict: bool = True,
             budget_mode: BudgetMode | None = None, encode: EncodeConfig | None = None,
             processes: Processes | None = None, adapter_for: str = "pruned") -> dict[str, Any]:
    """Run every (method, budget) on `records` (VQA records, clip records or items); returns {"n", "results", ...}
    (see the module docstring).

    adapter_for: which rows the model's adapter runs for, where a method's spec does not say (`+adapter`,
    `-adapter`): "pruned", every row that prunes (an adapter asked for with --adapter); "trained", only the rows
    of the trained layer (`arr_coc_trained`, from `arr_coc_weights`), whose folder holds the adapter (on by
    default).

    `processes` (several, under a launcher: `arr_coc.distributed`): each process runs a contiguous
    share of the batches (the same batches one process runs, so every item's outcome is the same: selection
    is content-seeded, decoding greedy), and every process returns the whole report.
    """
    import torch

    from ..pipeline.backend import CostsTower, require

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    require(vlm.backend, CostsTower, "count the vision tower's FLOPs (eval)")   # MissingCapability, before any work
    torch.manual_seed(seed)
    vlm.seed = seed
    items = as_items(records)
    encode = encode or EncodeConfig()
    plans = {m: MethodPlan(m, vlm, fastv_layer, arr_coc_weights, encode, adapter_for) for m in methods}
    run = _Run(vlm, plans, configs_for(methods, budgets), max_new_tokens, strict, budget_mode, _cell_px(vlm))
    run.rows = {c: _Rows() for c in run.configs}
    batches = [items[i:i + batch_size] for i in range(0, len(items), batch_size)]
    if processes is not None:
        batches = batches[processes.share(len(batches))]
        progress = progress and processes.is_main
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches) * len(run.configs), desc="eval", unit="run", dynamic_ncols=True)
    t_start = time.perf_counter()
    for batch in batches:
        run.batch(_load(vlm, batch), bar)
    if bar is not None:
        bar.close()
    if processes is not None and processes.world > 1:
        _gather(run, processes)
    return _report(run, items, budgets, seed, batch_size, fastv_layer, encode, time.perf_counter() - t_start)


def _cell_px(vlm: ARRCOC) -> int | None:
    """Pixels per cell side of the model's processed pictures (`LaysOutVisuals`), or None."""
    from ..pipeline.backend import LaysOutVisuals, has

    return vlm.backend.image_scale().cell_px if has(vlm.backend, LaysOutVisuals) else None


def _gather(run: _Run, processes: Processes) -> None:
    """Every process's rows, in rank order (the shares in rank order are the batches in order)."""
    shares = processes.gather((run.rows, run.failed))
    run.rows, run.failed = {c: _Rows() for c in run.configs}, {}
    for their_rows, their_failed in shares:
        for c in run.configs:
            run.rows[c].extend(their_rows[c])
        for c, error in their_failed.items():
            run.failed.setdefault(c, error)  # the first failure in batch order, as one process reports it


NOTES = {
    "prefill_flops_mean": "FlopCounterMode: LM prefill of the item's pruned prompt (no padding, last-position "
                          "logits) + the selector's own FLOPs per item; vision tower excluded; null when the "
                          "selector's FLOPs could not be counted",
    "vision_flops_mean": "the vision tower as the row ran it: every patch (encode after) or the gist plus the "
                         "encoded cells (encode before); attention included",
    "e2e_flops_mean": "vision_flops_mean + prefill_flops_mean: the whole prefill (vision tower, selector, LM)",
    "adapter_flops_mean": "of e2e_flops_mean, the LoRA adapter's (2 r (d_in + d_out) per token per adapted linear, "
                          "the tower's share in vision_flops_mean, the LM's in prefill_flops_mean); 0 where none ran",
    "cost": "e2e_flops_mean as a share of the none row's (null without a none row)",
    "agree": "share of items answered as the none row (every token) answers them",
    "vs_full": "paired 95% interval of the accuracy difference against the none row (normal approximation)",
    "latency_s_median": "per item: processor + vision tower + selection + rewrite + LM prefill; median "
                        "over batches. passes > 1: up to the final answer's first token (every earlier "
                        "look in full, its decoding included)",
    "passes_mean": "encode before with passes > 1: looks per item (1: no saccade); saccade_share: items "
                   "that looked more than once; each look's tower and LM prefill are in the FLOPs",
    "coverage": "share of the JSONL boxes' cells kept, mean over items with boxes; null for downscale and clips",
    "full_coverage": "share of the items with boxes whose box cells were all kept; null for downscale",
    "total_tokens_mean": "visual tokens of the ORIGINAL visual (downscale reports its smaller image's "
                         "tokens as kept; a clip counts every temporal group's)",
    "keep_all": "a budget that keeps every token of every item runs no selector: that row repeats none",
    "over_budget": "items that kept more visual tokens than the budget allows, and why (budget_notes): a clip's "
                   "budget below its minimum of one token per temporal group keeps that minimum",
    "status": "ok, or failed (strict mode: the selector raised or kept every token of an item; see error)",
}


def _report(run: _Run, items: list[Item], budgets: Sequence[Budget], seed: int, batch_size: int, fastv_layer: int,
            encode: EncodeConfig, seconds: float) -> dict[str, Any]:
    results = [summarise(method, budget, run.rows[(method, budget)], run.failed.get((method, budget)),
                         run.plans[method].encode_mode if budget != 1.0 else "after")
               for method, budget in run.configs]
    full = next((run.rows[c] for c in run.configs if c[0] == "none" and c not in run.failed), None)
    for r in results:
        compare_with_full(r, full)
    return {
        "n": len(items), "ids": [it.id for it in items], "kind": items[0].kind if items else "image",
        "types": [it.type for it in items], "results": results, "methods": list(run.plans), "budgets": list(budgets),
        "seed": seed, "batch_size": batch_size, "fastv_layer": fastv_layer, "strict": run.strict,
        "budget_mode": run.budget_mode, "encode": dataclasses.asdict(encode), "seconds": round(seconds, 2),
        "notes": NOTES,
    }


def compare_with_full(row: dict[str, Any], full: _Rows | None) -> None:
    """A row's cost, agreement and paired interval against the `none` row (every token), in place."""
    row["cost"] = row["agree"] = row["vs_full"] = None
    if full is None or row.get("status") != "ok" or len(row["correct"]) != len(full.correct):
        return
    full_e2e = _known_mean([None if p is None else p + v for p, v in zip(full.prefill_flops, full.vision_flops)])
    if full_e2e and row.get("e2e_flops_mean") is not None:
        row["cost"] = round(row["e2e_flops_mean"] / full_e2e, 4)
    row["agree"] = round(_mean([float(a == f) for a, f in zip(row["answers"], full.answers)]) or 0.0, 4)
    paired = paired_stats(row["correct"], full.correct)
    row["vs_full"] = [round(paired["low"], 4), round(paired["high"], 4)]


def run_one(run: _Run, plan: MethodPlan, batch: _Batch, budget: Budget) -> _Rows:
    """One (method, budget) on one batch: per-item measurements (or the failure, in strict mode)."""
    from ..pipeline.choose import SelectorFailed
    from .cost import item_flops

    rows = _Rows()
    t0 = time.perf_counter()
    job = plan.for_batch(run.vlm, batch.items, batch.visuals, batch.inputs, batch.build_s, budget,
                         run.budget_mode, run.strict, batch.cells)
    prep_s = job.prep_s if job.inputs is batch.inputs else time.perf_counter() - t0
    try:
        done = run.vlm.answer(job.inputs, job.pruning, max_new_tokens=run.max_new_tokens)
    except SelectorFailed as exc:
        rows.errors.append(str(exc))
        return rows
    traces = done.traces
    if run.strict and any(fb == "keep_all" for tr in traces for fb in tr.fallback):
        rows.errors.append(next(tr.error for tr in traces if "keep_all" in tr.fallback) or "kept every token")
        return rows
    rows.latency.append((prep_s + done.ttft_s) / len(batch.items))
    selector = job.counted.flops() if job.counted is not None else 0
    flops = item_flops(run.vlm.backend, done, selector, job.pruning.encode.gist, run.memo)
    answers = [run.vlm.backend.decode_text(row) for row in done.new_tokens.tolist()]
    for b, (item, tr) in enumerate(zip(batch.items, traces)):
        _record(rows, run.cell_px, plan, item, batch.visuals[b], tr, answers[b].strip(), flops[b], batch.cells[b])
    return rows


def _record(rows: _Rows, cell_px: int | None, plan: MethodPlan, item: Item, visual: Any, tr: Any, answer: str,
            flops: Any, cells: int) -> None:
    """One item's measurements into `rows` (cell_px: the processed picture's pixels per cell side; None: coverage
    unknown)."""
    from ..data import score_record
    from ..geometry import box_cell_set

    rows.looks.append(max(1, len(tr.looks)))
    rows.notes.append(list(tr.notes))
    rows.correct.append(score_record(answer, item.record))
    rows.answers.append(answer)
    rows.coverage.append(None)
    rows.types.append(item.type)
    rows.kept.append(int(tr.kept_tokens))
    rows.encoded.append(sum(int(c.numel()) for c in tr.encoded_cells) if tr.encoded_cells else int(tr.total_tokens))
    rows.total.append(int(cells))
    rows.fallback.append(next((fb for fb in tr.fallback if fb), None))
    rows.prefill_flops.append(None if flops.selector is None else flops.lm + flops.selector)
    rows.selector_flops.append(flops.selector)
    rows.vision_flops.append(flops.vision)
    rows.adapter_flops.append(flops.adapter)
    if plan.name != "downscale" and item.boxes and tr.grid_hw and cell_px is not None:
        h, w = tr.grid_hw[0]
        unit = cell_px
        box_cells = box_cell_set(item.boxes, (h, w), (w * unit, h * unit), visual.size)
        if box_cells:
            rows.coverage[-1] = len(set(int(i) for i in tr.kept_indices[0].tolist()) & box_cells) / len(box_cells)


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
                "accuracy": None, "vision_flops_mean": None, "adapter_flops_mean": None, "e2e_flops_mean": None,
                "coverage": None, "full_coverage": None, "kept_tokens_mean": None, "total_tokens_mean": None,
                "prefill_flops_mean": None, "latency_s_median": None, "per_type": {}, "kept_share": None,
                "selector_flops_mean": None, "n": 0, "n_with_boxes": 0, "fallbacks": {}, "correct": [],
                "answers": [], "item_coverage": [], "item_kept": [], "item_encoded": [], "item_total": [],
                "passes_mean": None, "saccade_share": None, "per_type_looks": {}, "item_looks": [],
                "over_budget": 0, "budget_notes": []}
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
        "adapter_flops_mean": _mean(r.adapter_flops),
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
        "over_budget": sum(1 for n in r.notes if n),
        "budget_notes": list(dict.fromkeys(x for n in r.notes for x in n))[:3],
    }
