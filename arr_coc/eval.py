"""`python -m arr_coc eval`: accuracy vs. visual-token budget, ARR-COC beside the anchor methods.

    python -m arr_coc eval --data data/shapes/test.jsonl --methods all \
        --budgets 0.05,0.1,0.25,0.5,1.0 --limit 500 --out results.json --plot acc.png --markdown table.md

Every method runs on the same model, the same batches and the same code path
(`ARRCOCQwen.prepare` -> prefill -> greedy `generate`), one (method, budget) after the
other inside each batch, so machine drift hits all of them alike. Per (method, budget):

- accuracy: exact match after normalisation (`arr_coc.data.score`), overall and per type;
- coverage: share of the cells under the JSONL boxes (the objects the answer depends on)
  that the method kept, mean over items with boxes (None for `downscale`, which keeps
  every region at a lower resolution, and when no item has boxes);
- kept / total visual tokens, against the ORIGINAL image's token count (so `downscale`
  reports its smaller image's tokens out of the original's);
- prefill FLOPs, counted with `torch.utils.flop_counter.FlopCounterMode` (matmuls,
  attention; elementwise ops are not counted): the LM prefill of each item's pruned
  prompt (alone, no padding, logits of the last position only, as `generate` does), plus
  the selector's own work per item (FastV's partial prefill, VisionZip's attention
  weights, the ARR-COC layer, DivPrune's distances, ...). The vision tower is not
  included: it is the same for every method except `downscale`, whose smaller image
  also costs the vision tower less (its latency shows that);
- latency: wall time per item of processor + vision tower + selection + input rewrite +
  LM prefill (time to first token), the batch's time divided by its size; median over batches.

A budget that keeps every token of every image (1.0) prunes nothing, whatever the method:
such rows run no selector and repeat the `none` measurements of the same batch.

`results.json` = {"model", "data", "n", "results": [{"method", "budget", "accuracy",
"coverage", "kept_tokens_mean", "total_tokens_mean", "prefill_flops_mean",
"latency_s_median", "per_type", "kept_share", "selector_flops_mean"}], ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Sequence

logger = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "checkpoints", "shapes-qwen2vl")
DEFAULT_BUDGETS = "0.05,0.1,0.25,0.5,1.0"
REQUIRED_KEYS = ("method", "budget", "accuracy", "coverage", "kept_tokens_mean", "total_tokens_mean",
                 "prefill_flops_mean", "latency_s_median", "per_type")


# ----------------------------------------------------------------------------- FLOPs


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of the CPU flash SDPA kernel (torch has no formula for it): QK^T + AV, full matrix."""
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v


def flop_counter():
    """A silent FlopCounterMode that also counts PyTorch's CPU flash-attention kernel."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mapping = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        mapping[op] = _cpu_sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


def count_flops(fn, *args, **kwargs) -> tuple[Any, int]:
    """(fn(*args, **kwargs), FLOPs it ran)."""
    with flop_counter() as counter:
        out = fn(*args, **kwargs)
    return out, int(counter.get_total_flops())


# ----------------------------------------------------------------------------- CLI


def _budget(text: str) -> float | int:
    try:
        value: float | int = int(text) if text.strip().isdigit() else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget {text!r} is neither a share like 0.1 nor a count like 64") from None
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"budget share {value} must be in (0, 1]; counts are whole numbers like 64")
    if isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError(f"budget count {value} must be at least 1")
    return value


def parse_budgets(text: str) -> list[float | int]:
    """'0.05,0.1,64' -> [0.05, 0.1, 64]; a bare '1' means the share 1.0 (all tokens)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part:
            out.append(1.0 if part == "1" else _budget(part))
    if not out:
        raise argparse.ArgumentTypeError("give at least one budget, e.g. --budgets 0.1,0.25")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="Qwen2-VL / Qwen2.5-VL / Qwen3-VL folder or hub id (default: checkpoints/shapes-qwen2vl)")
    parser.add_argument("--data", required=True,
                        help="VQA JSONL (e.g. the ShapesVQA test split from `python -m arr_coc gen-data`)")
    parser.add_argument("--methods", default="all",
                        help="'all' or a comma list of: none, random, grid, downscale, fastv, visionzip, divprune, "
                             "cdpruner, oracle, arr_coc, arr_coc_trained (or any registered selector)")
    parser.add_argument("--budgets", default=DEFAULT_BUDGETS, type=parse_budgets,
                        help=f"comma list of shares in (0, 1] or token counts (default: {DEFAULT_BUDGETS})")
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N items only")
    parser.add_argument("--batch-size", type=int, default=8, help="questions per forward pass (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of random selections (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="answer length limit (default: 8)")
    parser.add_argument("--fastv-layer", type=int, default=2, help="FastV's scoring layer K, 1-based (default: 2)")
    parser.add_argument("--arr-coc-weights", default=None,
                        help="folder of trained ARR-COC weights for arr_coc_trained (default: the layer shipped under "
                             "checkpoints/ when --model is the embedded model; otherwise skipped without it)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True, help="results JSON path")
    parser.add_argument("--plot", default=None, help="accuracy vs. kept-token share plot (PNG)")
    parser.add_argument("--markdown", default=None, help="Markdown table path")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace) -> int:
    from .paths import resolve_layer
    from .data import read_jsonl

    if args.arr_coc_weights is None:
        args.arr_coc_weights = resolve_layer(args.model, None)  # the shipped trained layer, embedded model only
    try:
        methods, skipped = resolve_methods(args.methods, args.arr_coc_weights)
        records = read_jsonl(args.data)
    except (ValueError, FileNotFoundError) as exc:
        print(f"eval: error: {exc}", file=sys.stderr)
        return 2
    if args.limit is not None:
        records = records[: max(0, args.limit)]
    if not records:
        print(f"eval: error: {args.data} holds no items (or --limit is 0)", file=sys.stderr)
        return 2
    for name, why in skipped.items():
        print(f"eval: skipping {name}: {why}", file=sys.stderr)
    wrapper = load_wrapper(args.model, args.device, args.seed)
    report = evaluate(
        wrapper, records, methods, args.budgets, batch_size=args.batch_size, seed=args.seed,
        max_new_tokens=args.max_new_tokens, fastv_layer=args.fastv_layer, arr_coc_weights=args.arr_coc_weights,
        progress=not args.quiet,
    )
    report = {"model": args.model, "data": args.data, "arr_coc_weights": args.arr_coc_weights, **report,
              "skipped": skipped}
    _write_json(report, args.out)
    print(f"wrote {args.out} ({len(report['results'])} rows, {report['n']} items)")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    table = markdown_table(report)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(table)
        print(f"wrote {args.markdown}")
    print(accuracy_table(report))
    return 0


def resolve_methods(spec: str, arr_coc_weights: str | None = None) -> tuple[list[str], dict[str, str]]:
    """'all' or 'a,b' -> (methods to run in order, {skipped method: why})."""
    from .methods import METHODS
    from .selection import available_methods

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


def load_wrapper(model: str, device: str = "cpu", seed: int = 0, attempts: int = 3):
    """ARRCOCQwen.from_pretrained with a clear error; retries a moment later if a checkpoint is mid-save."""
    from .qwen import ARRCOCQwen

    if os.path.sep in model or model.startswith("."):
        if not os.path.isdir(model):
            raise SystemExit(f"eval: no model folder at {model}; train the embedded model with "
                             "`python -m arr_coc train-vlm --out checkpoints/shapes-qwen2vl` or pass --model PATH")
    for attempt in range(attempts):
        try:
            wrapper = ARRCOCQwen.from_pretrained(model, device=device)
            break
        except Exception as exc:  # noqa: BLE001 - a training job may be rewriting the folder right now
            if attempt == attempts - 1:
                raise
            logger.warning("loading %s failed (%s); retrying in 5 s", model, exc)
            time.sleep(5)
    wrapper.seed = seed
    return wrapper


# ----------------------------------------------------------------------------- the evaluation


@dataclasses.dataclass
class _Rows:
    """Per-item measurements of one (method, budget)."""

    correct: list[float] = dataclasses.field(default_factory=list)
    answers: list[str] = dataclasses.field(default_factory=list)
    coverage: list[float | None] = dataclasses.field(default_factory=list)  # per item; None: no boxes (or downscale)
    types: list[str] = dataclasses.field(default_factory=list)
    kept: list[int] = dataclasses.field(default_factory=list)
    total: list[int] = dataclasses.field(default_factory=list)
    prefill_flops: list[int] = dataclasses.field(default_factory=list)
    selector_flops: list[float] = dataclasses.field(default_factory=list)
    latency: list[float] = dataclasses.field(default_factory=list)   # per item, one entry per batch

    def extend(self, other: "_Rows") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).extend(getattr(other, f.name))


class _CountedSelector:
    """Wraps a selector: runs it normally, keeps the context to count its FLOPs afterwards (off the clock)."""

    def __init__(self, fn, name: str):
        self.fn = fn
        self.__name__ = name
        self.ctx = None

    def __call__(self, ctx):
        self.ctx = ctx
        return self.fn(ctx)

    def flops(self) -> int:
        if self.ctx is None:
            return 0
        try:
            return count_flops(self.fn, self.ctx)[1]
        except Exception as exc:  # noqa: BLE001 - the selector already failed in prepare and fell back
            logger.warning("could not count the FLOPs of %s (%s)", self.__name__, exc)
            return 0


def configs_for(methods: Sequence[str], budgets: Sequence[float | int]) -> list[tuple[str, float | int]]:
    """(method, budget) pairs: `none` once at 1.0, every other method at every budget."""
    out = []
    for m in methods:
        if m == "none":
            out.append((m, 1.0))
        else:
            out.extend((m, b) for b in budgets)
    return out


def evaluate(wrapper: Any, records: Sequence[Any], methods: Sequence[str], budgets: Sequence[float | int],
             batch_size: int = 8, seed: int = 0, max_new_tokens: int = 8, fastv_layer: int = 2,
             arr_coc_weights: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run every (method, budget) on `records` (VQARecord list); returns {"n", "results", ...}."""
    import torch

    from .methods import arrcoc, fastv

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    torch.manual_seed(seed)
    wrapper.seed = seed
    selectors: dict[str, Any] = {}
    for m in methods:
        if m == "fastv":
            selectors[m] = fastv.make_selector(fastv_layer)
        elif m == "arr_coc_trained":
            if not arr_coc_weights:
                raise ValueError("arr_coc_trained needs arr_coc_weights (a folder of trained ARR-COC weights)")
            selectors[m] = arrcoc.trained_selector(wrapper, arr_coc_weights)
    configs = configs_for(methods, budgets)
    rows: dict[tuple[str, Any], _Rows] = {c: _Rows() for c in configs}
    batches = [list(records[i:i + batch_size]) for i in range(0, len(records), batch_size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches) * len(configs), desc="eval", unit="run", dynamic_ncols=True)
    flops_memo: dict[int, int] = {}   # LM prefill FLOPs depend only on the prompt length
    merge = int(getattr(wrapper.processor, "image_processor", wrapper.processor).merge_size)
    t_start = time.perf_counter()
    for batch in batches:
        images = [rec.load_image() for rec in batch]
        questions = [rec.question for rec in batch]
        t0 = time.perf_counter()
        inputs = wrapper.build_inputs([[im] for im in images], questions)
        build_s = time.perf_counter() - t0
        n_tokens = [int(h) * int(w) // merge**2 for _, h, w in inputs["image_grid_thw"].tolist()]
        everything: _Rows | None = None  # a budget that keeps every token IS `none`: run once, shared
        for method, budget in configs:
            if bar is not None:
                bar.set_postfix_str(f"{method} @ {budget}")
            if all(_count(budget, n) >= n for n in n_tokens):
                if everything is None:
                    everything = _run_one(wrapper, batch, images, questions, inputs, build_s, "none", 1.0,
                                          selectors, max_new_tokens, flops_memo)
                got = everything
            else:
                got = _run_one(wrapper, batch, images, questions, inputs, build_s, method, budget, selectors,
                               max_new_tokens, flops_memo)
            rows[(method, budget)].extend(got)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    results = [_summarise(method, budget, rows[(method, budget)]) for method, budget in configs]
    return {
        "n": len(records), "ids": [rec.id for rec in records], "results": results,
        "methods": list(methods), "budgets": list(budgets),
        "seed": seed, "batch_size": batch_size, "fastv_layer": fastv_layer,
        "seconds": round(time.perf_counter() - t_start, 2),
        "notes": {
            "prefill_flops_mean": "FlopCounterMode: LM prefill of the item's pruned prompt (no padding, last-position "
                                  "logits) + the selector's own FLOPs per item; vision tower excluded",
            "latency_s_median": "per item: processor + vision tower + selection + rewrite + LM prefill; median "
                                "over batches",
            "coverage": "share of the JSONL boxes' cells kept, mean over items with boxes; null for downscale",
            "full_coverage": "share of the items with boxes whose box cells were all kept; null for downscale",
            "total_tokens_mean": "visual tokens of the ORIGINAL image (downscale reports its smaller image's "
                                 "tokens as kept)",
            "keep_all": "a budget that keeps every token of every image runs no selector: that row repeats none",
        },
    }


def _run_one(wrapper, batch, images, questions, inputs, build_s, method, budget, selectors,
             max_new_tokens: int, flops_memo: dict[int, int]) -> _Rows:
    """One (method, budget) on one batch: per-item measurements."""
    import contextlib

    import torch

    from .data import score
    from .methods import downscale, oracle, visionzip
    from .selection import get_selector

    ip = getattr(wrapper.processor, "image_processor", wrapper.processor)
    merge = int(ip.merge_size)
    grids = [(int(h) // merge, int(w) // merge) for _, h, w in inputs["image_grid_thw"].tolist()]
    original = [h * w for h, w in grids]
    recorder = contextlib.nullcontext()
    counted = None
    t0 = time.perf_counter()
    if method == "downscale":
        if all(downscale.downscale_grid(h, w, _count(budget, h * w), downscale.min_tokens(ip)) == (h, w)
               for h, w in grids):
            run_inputs, prep_s = inputs, build_s
        else:
            run_inputs, _ = downscale.downscale_inputs(wrapper, images, questions, budget, grids)
            prep_s = time.perf_counter() - t0
        chosen: Any = "none"
    else:
        run_inputs, prep_s = inputs, build_s
        if method == "none":
            chosen = "none"
        else:
            if method == "oracle":
                fn = oracle.make_selector([rec.boxes for rec in batch], [im.size for im in images])
            elif method == "visionzip":
                recorder = visionzip.LastBlockRecorder(wrapper.model)
                fn = visionzip.make_selector(recorder)
            elif method in selectors:
                fn = selectors[method]
            else:
                fn = get_selector(method)
            chosen = counted = _CountedSelector(fn, method)
    t1 = time.perf_counter()
    with recorder, torch.no_grad():
        pruned, traces = wrapper.prepare(run_inputs, budget=None if chosen == "none" else budget, method=chosen)
    t2 = time.perf_counter()
    wrapper.prefill(pruned, logits_to_keep=1)
    t3 = time.perf_counter()
    rows = _Rows()
    rows.latency.append((prep_s + (t2 - t1) + (t3 - t2)) / len(batch))

    select_flops = counted.flops() if counted is not None else 0
    with torch.no_grad():
        kw = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": wrapper.pad_token_id}
        sequences = wrapper.model.generate(**pruned.model_kwargs(), **kw)
    answers = wrapper.tokenizer.batch_decode(sequences[:, pruned.input_ids.shape[1]:], skip_special_tokens=True)
    unit = downscale.pixel_unit(ip)
    for b, (rec, tr) in enumerate(zip(batch, traces)):
        rows.correct.append(score(answers[b].strip(), rec.answers))
        rows.answers.append(answers[b].strip())
        rows.coverage.append(None)
        rows.types.append(rec.type or "other")
        rows.kept.append(int(tr.kept_tokens))
        rows.total.append(int(original[b]))
        length = int(pruned.attention_mask[b].sum())
        if length not in flops_memo:
            flops_memo[length] = count_flops(wrapper.prefill, _row_inputs(pruned, b), logits_to_keep=1)[1]
        flops = flops_memo[length]
        rows.prefill_flops.append(flops + select_flops / len(batch))
        rows.selector_flops.append(select_flops / len(batch))
        if method != "downscale" and rec.boxes:
            h, w = grids[b]
            cells = {c for box in oracle.box_cells(rec.boxes, (h, w), (h * unit, w * unit), images[b].size)
                     for c in box}
            if cells:
                kept = set(int(i) for i in tr.kept_indices[0].tolist())
                rows.coverage[-1] = len(kept & cells) / len(cells)
    return rows


def _count(budget: float | int, n: int) -> int:
    from .budget import resolve_count

    return resolve_count(budget, n)


def _row_inputs(pruned: Any, b: int) -> Any:
    """Row b of a left-padded PrunedInputs on its own (no padding), for per-item FLOPs."""
    m = pruned.attention_mask[b].bool()
    imgs = [i for i, r in enumerate(pruned.item_of_image) if r == b]
    deep = pruned.deepstack_features
    return dataclasses.replace(
        pruned,
        input_ids=pruned.input_ids[b:b + 1, m], attention_mask=pruned.attention_mask[b:b + 1, m],
        position_ids=pruned.position_ids[:, b:b + 1, m], orig_index=pruned.orig_index[b:b + 1, m],
        image_features=tuple(pruned.image_features[i] for i in imgs),
        deepstack_features=[tuple(layer[i] for i in imgs) for layer in deep] if deep is not None else None,
        kept_indices=[pruned.kept_indices[i] for i in imgs], item_of_image=[0] * len(imgs),
        grid_hw=[pruned.grid_hw[i] for i in imgs],
    )


def _mean(xs: Sequence[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _summarise(method: str, budget: float | int, r: _Rows) -> dict[str, Any]:
    by_type: dict[str, list[float]] = defaultdict(list)
    for t, c in zip(r.types, r.correct):
        by_type[t].append(c)
    kept, total = _mean(r.kept), _mean(r.total)
    covered = [c for c in r.coverage if c is not None]  # the items with boxes
    return {
        "method": method,
        "budget": budget,
        "accuracy": _mean(r.correct),
        "coverage": _mean(covered) if method != "downscale" else None,
        # share of items with boxes whose answer cells were ALL kept
        "full_coverage": _mean([float(c == 1.0) for c in covered]) if method != "downscale" else None,
        "kept_tokens_mean": kept,
        "total_tokens_mean": total,
        "prefill_flops_mean": _mean(r.prefill_flops),
        "latency_s_median": float(statistics.median(r.latency)) if r.latency else None,
        "per_type": {t: _mean(v) for t, v in sorted(by_type.items())},
        "kept_share": kept / total if kept is not None and total else None,
        "selector_flops_mean": _mean(r.selector_flops),
        "n": len(r.correct),
        "n_with_boxes": len(covered),
        # per item, in the report's `ids` order: what paired comparisons between methods need
        "correct": [int(c) for c in r.correct],
        "answers": list(r.answers),              # what the VLM generated (stripped), as scored
        "item_coverage": list(r.coverage),  # share of the item's box cells kept; null without boxes
    }


def _write_json(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- reports


def _fmt_budget(b: float | int) -> str:
    return f"{b * 100:g}%" if isinstance(b, float) else f"{b} tok"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _row(by: dict[tuple[str, Any], dict[str, Any]], method: str, budget: float | int) -> dict[str, Any] | None:
    """The (method, budget) result; `none` runs once, at 1.0, and stands for every budget."""
    return by.get((method, budget)) or (by.get((method, 1.0)) if method == "none" else None)


def accuracy_table(report: dict[str, Any]) -> str:
    """Markdown pivot: one row per method, one column per budget, accuracy (coverage).

    Where a row kept a mean share of tokens more than 3% away from its budget (the trained
    layer, whose budget follows the question; downscale's rounded image sizes), the cell says so.
    """
    budgets = report.get("budgets") or sorted({r["budget"] for r in report["results"]}, key=float)
    cols = list(budgets)
    if 1.0 not in cols and any(r["budget"] == 1.0 for r in report["results"]):
        cols.append(1.0)
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    methods = list(dict.fromkeys(r["method"] for r in report["results"]))
    lines = ["| method | " + " | ".join(_fmt_budget(b) for b in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for m in methods:
        cells = []
        for b in cols:
            r = _row(by, m, b)
            if r is None or (m == "none" and b != 1.0):
                cells.append("" if m == "none" else "–")
                continue
            notes = [_fmt(r["coverage"], 2)] if r.get("coverage") is not None else []
            kept = r.get("kept_share")
            if isinstance(b, float) and b < 1.0 and kept is not None and abs(kept - b) > 0.03 * b:
                notes.append(f"{100 * kept:.1f}% kept")  # a budget met on average, or downscale's rounding
            cells.append(_fmt(r["accuracy"]) + (f" ({'; '.join(notes)})" if notes else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_difference(report: dict[str, Any], a: str, b: str, budget: float | int) -> dict[str, float] | None:
    """Accuracy of method `a` minus method `b` at `budget` on the same items, with a 95% interval.

    Paired over items (both methods answered the same questions), so the interval is much
    tighter than two independent ones: diff +- 1.96 * sd(d_i) / sqrt(n), d_i = correct_a - correct_b.
    Also counts the items only `a` got right (`wins`) and only `b` got right (`losses`).
    """
    by = {(r["method"], r["budget"]): r for r in report["results"]}
    ra, rb = _row(by, a, budget), _row(by, b, budget)
    if not ra or not rb or not ra.get("correct") or len(ra["correct"]) != len(rb.get("correct") or []):
        return None
    d = [x - y for x, y in zip(ra["correct"], rb["correct"])]
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {"diff": mean, "low": mean - half, "high": mean + half, "wins": sum(x > 0 for x in d),
            "losses": sum(x < 0 for x in d), "n": n}


def paired_table(report: dict[str, Any], method: str) -> str:
    """Markdown: `method` minus every other method, per pruned budget (paired 95% intervals)."""
    budgets = [b for b in report.get("budgets", []) if b != 1.0]
    others = [m for m in dict.fromkeys(r["method"] for r in report["results"]) if m not in (method, "none")]
    if not budgets or not others or not any(r["method"] == method for r in report["results"]):
        return ""
    lines = [f"Accuracy of `{method}` minus each method on the same items (paired 95% interval; "
             "items only it / only the other got right):", "",
             "| vs. | " + " | ".join(_fmt_budget(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for other in others:
        cells = []
        for b in budgets:
            p = paired_difference(report, method, other, b)
            cells.append("–" if p is None else
                         f"{p['diff']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] {p['wins']}/{p['losses']}")
        lines.append(f"| {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_table(report: dict[str, Any]) -> str:
    """The README's tables: accuracy by budget, then every measured column."""
    out = [f"Accuracy (coverage of the answer's box cells) on {report['n']} items of `{report.get('data', '')}`, "
           f"model `{report.get('model', '')}`:", "", accuracy_table(report),
           "| method | budget | kept / total tokens | accuracy | coverage | prefill GFLOPs | selector GFLOPs | "
           "latency ms |", "|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        out.append(
            f"| {r['method']} | {_fmt_budget(r['budget'])} | {_fmt(r['kept_tokens_mean'], 1)} / "
            f"{_fmt(r['total_tokens_mean'], 1)} | {_fmt(r['accuracy'])} | {_fmt(r['coverage'], 2)} | "
            f"{_fmt((r['prefill_flops_mean'] or 0) / 1e9, 3)} | {_fmt((r.get('selector_flops_mean') or 0) / 1e9, 3)} | "
            f"{_fmt((r['latency_s_median'] or 0) * 1e3, 1)} |")
    best = "arr_coc_trained" if any(r["method"] == "arr_coc_trained" for r in report["results"]) else "arr_coc"
    paired = paired_table(report, best)
    if paired:
        out += ["", paired]
    if report.get("skipped"):
        out += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(out) + "\n"


def write_plot(report: dict[str, Any], path: str) -> None:
    """Three panels, one line per method: accuracy and coverage of the answer's cells against the
    share of visual tokens kept, and accuracy against prefill FLOPs (the method's own work included,
    as a share of the full-token prefill), where a selector that pays for its choice shows it.

    The oracle is drawn as the ceiling (dashed black), all tokens as a dotted line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next((r["prefill_flops_mean"] for r in report["results"] if r["method"] == "none"), None) or next(
        (r["prefill_flops_mean"] for r in report["results"] if r["budget"] == 1.0), None)
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in report["results"]:
        if r["accuracy"] is not None and r.get("kept_share") is not None:
            flops_share = r["prefill_flops_mean"] / full if full and r.get("prefill_flops_mean") else None
            by_method[r["method"]].append({**r, "flops_share": flops_share})
    panels = [("kept_share", "accuracy", "accuracy")]
    if any(r.get("coverage") is not None for rs in by_method.values() for r in rs):
        panels.append(("kept_share", "coverage", "coverage of the answer's box cells"))
    if full:
        panels.append(("flops_share", "accuracy", "accuracy"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.8), dpi=120, squeeze=False)
    styles = {"oracle": dict(color="black", linestyle="--", linewidth=2.2, marker="^", label="oracle (ceiling)"),
              "arr_coc": dict(color="tab:red", linewidth=2.4, marker="o", label="arr_coc"),
              "arr_coc_trained": dict(color="darkred", linewidth=2.4, marker="o", label="arr_coc_trained")}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan", "tab:gray", "gold", "navy", "teal"]
    colours = {m: palette[i % len(palette)] for i, m in enumerate(m for m in by_method if m not in styles)}
    ticks = sorted({float(b) for b in report.get("budgets", []) if isinstance(b, float)}
                   | {0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0})
    for ax, (xkey, key, label) in zip(axes[0], panels):
        top, xs = 0.0, []
        for method, rs in by_method.items():
            rs = sorted((r for r in rs if r.get(key) is not None and r.get(xkey)), key=lambda r: r[xkey])
            if not rs:
                continue
            top = max([top] + [r[key] for r in rs])
            if method == "none":
                ax.axhline(rs[0][key], color="grey", linestyle=":", linewidth=1.5, label="none (all tokens)")
                continue
            xs += [r[xkey] for r in rs]
            style = styles.get(method) or dict(marker=".", linewidth=1.3, label=method, color=colours[method])
            ax.plot([r[xkey] for r in rs], [r[key] for r in rs], **style)
        ax.set_xscale("log")
        # The axis spans the points drawn (not always up to 100%: a 5% / 10% run would leave most of it empty).
        lo, hi = (min(xs) / 1.25, min(1.05, max(xs) * 1.25)) if xs else (0.01, 1.05)
        shown = [t for t in ticks if lo <= t <= hi]
        ax.set_xlim(lo, hi)
        ax.set_xticks(shown)
        ax.set_xticklabels([f"{t * 100:g}%" for t in shown])
        ax.minorticks_off()
        ax.set_ylim(0.0, min(1.02, top + 0.08) if top > 0 else 1.0)
        if xkey == "kept_share":
            ax.set_xlabel("visual tokens kept (share of the original image's tokens)")
            ax.set_title(f"{label} vs. visual-token budget ({report['n']} items)", fontsize=10)
        else:
            ax.set_xlabel("prefill FLOPs incl. the method's own (share of the full-token prefill)")
            ax.set_title(f"{label} vs. compute ({report['n']} items)", fontsize=10)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
