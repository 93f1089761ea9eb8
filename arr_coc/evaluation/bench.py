"""`python -m arr_coc bench`: the whole prefill (vision tower, ARR-COC, language model), both encoding modes.

    python -m arr_coc bench --preset qwen2-vl-2b --encode after,before --budgets 0.1,0.2,0.3,1.0 --out bench.json

The model has a real Qwen-VL's widths (bench_presets.py says which, and where each number comes from)
with random weights and FEWER layers than the real one: "vision 2 of 32 layers, LM 2 of 28" by default,
said in the output. The image is an 896 x 896 ShapesVQA scene (1,024 merged visual tokens).

One row per (encode, gist, context, budget), all measured side by side in one run: a first, untimed pass
counts every row's FLOPs (and warms up); then each repetition runs every row, in a rotated order,
so machine drift hits all rows alike; times are medians over repetitions.

- encode "after": the tower encodes every patch, ARR-COC selects, the LM reads the kept tokens;
  "before": ARR-COC selects from the texture array and the question (plus the gist's tokens with
  `gist` > 0), the tower encodes only the chosen cells, the LM reads them. The 100% rows run no
  selector; ("after", 100%) is the reference every share divides by. `margin` > 0 / `windows` add
  "before" rows whose tower also encodes context cells the LM does not read: `margin` rings around
  the chosen cells, or the rest of every Qwen2.5-VL attention window holding one (both: the union);
  encoded_tokens counts them, and the tower's FLOPs include them.
- vision_s: the tower's own forward calls (timed by hooks on the tower; the gist's call excluded);
  gist_s: the whole gist (downscale, processor, tower); arr_coc_s: everything else `prepare` does
  (texture, scorers, allocator, positions, packing the chosen cells, input rewrite); prefill_s:
  the LM prefill (last position's logits, as `generate` does); total_s: prepare + prefill.
- *_flops: counted at the layers run (flops.flop_counter, attention included); *_flops_full: scaled
  to the real depth (bench_depth.py). e2e = vision + gist + arr_coc + prefill.
- e2e_flops_share: the row's full-depth e2e FLOPs over the reference's; e2e_flops_share_run: the
  same at the layers run; e2e_time_share: measured, at the layers run; time_over_flops: their ratio
  (1.0: time falls exactly as FLOPs do); arr_coc_time_share / gist_time_share: arr_coc_s / gist_s over
  the reference's total_s (ARR-COC's fixed cost weighs more against a few layers than against the
  real depth, so these are upper bounds for the real model).
- speedup / ideal_speedup / speedup_vs_ideal / overhead_share: the LM prefill alone, as before
  (reference prefill time over the row's; FLOP ratio; their ratio; arr_coc_s over the reference prefill).
- full_depth: per shape (the preset's and its family's 7B), the tower's share of the full prefill and
  every row's e2e share, counted, not timed.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from ..execution import read_fast_flag
from .bench_depth import (LMCount, TowerCount, full_lm_flops, full_tower_flops, lm_count, lm_layer_flops,
                          module_totals, subtract, tower_count)
from .bench_presets import SHAPES, build_backend, check_shape_encode, get_preset, label, run_layers
from .flops import flop_counter
from .report import fmt_budget

ENCODES = ("after", "before")


@dataclass(frozen=True)
class RowSpec:
    """One measured configuration."""

    encode: str          # "after" | "before"
    gist: float          # "before": the gist's share of the tokens (0: none)
    budget: Any          # a budget (arr_coc.budget); 1.0 runs no selector
    margin: int = 0      # "before": rings of context cells encoded, not read by the LM
    windows: bool = False  # "before", Qwen2.5-VL: every attention window holding a chosen cell encoded whole

    @property
    def name(self) -> str:
        return f"{variant(self.encode, self.gist, self.margin, self.windows)} {fmt_budget(self.budget)}"


REFERENCE = RowSpec("after", 0.0, 1.0)


def variant(encode: str, gist: float = 0.0, margin: int = 0, windows: bool = False) -> str:
    """A row's encoding in words, e.g. "before", "before, gist 0.25", "before, margin 1, whole windows"."""
    parts = [encode] + ([f"gist {gist:g}"] if gist else []) + ([f"margin {margin}"] if margin else []) \
        + (["whole windows"] if windows else [])
    return ", ".join(parts)


def row_specs(encodes, budgets, gist: float = 0.0, margin: int = 0, windows: bool = False) -> list[RowSpec]:
    """Every (encode, budget) row; for "before", also the gist rows (gist > 0) and the context rows (margin > 0:
    margin rings; windows: whole windows; both: each alone and their union), each with and without the gist;
    the reference always first. Extra "before" rows skip 100% (every cell is encoded there anyway)."""
    budgets = list(budgets)
    if 1.0 not in budgets:
        budgets.append(1.0)
    contexts = [(0, False)] + ([(margin, False)] if margin else []) + ([(0, True)] if windows else []) \
        + ([(margin, True)] if margin and windows else [])
    rows = [REFERENCE]
    for enc in encodes:
        if enc not in ENCODES:
            raise ValueError(f"--encode takes {list(ENCODES)} (comma list), got {enc!r}")
        rows += [RowSpec(enc, 0.0, b) for b in budgets]
        if enc == "before":
            for g in [0.0] + ([float(gist)] if gist > 0 else []):
                rows += [RowSpec(enc, g, b, m, w) for m, w in contexts if (g, m, w) != (0.0, 0, False)
                         for b in budgets if b != 1.0]
    out: list[RowSpec] = []
    for r in rows:
        if r not in out:
            out.append(r)
    return out


class _Probe:
    """Times the vision tower's forward calls and the gist during `prepare`, on one model, reversibly.

    Hooks on the tower module time its calls (the gist's own tower call is left to the gist); the
    backend's gist (`VLMBackend.encode_gist`: downscale, processor, tower) is wrapped on this instance to time
    it whole and, when counting, to count it.
    """

    def __init__(self, vlm: Any, tower: Any, sync: Callable[[], None], count: bool):
        self.vlm, self.tower, self.sync, self.count = vlm, tower, sync, count
        self.tower_s = self.gist_s = 0.0
        self.gist_totals: dict[str, int] = {}
        self._in_gist = False
        self._t0 = 0.0

    def __enter__(self) -> _Probe:
        visual = self.tower
        self._hooks = [visual.register_forward_pre_hook(self._start), visual.register_forward_hook(self._stop)]
        gist = self.vlm.backend.encode_gist

        def timed_gist(*args: Any, **kwargs: Any):
            self.sync()
            t0 = time.perf_counter()
            self._in_gist = True
            try:
                with flop_counter() if self.count else nullcontext() as counter:
                    out = gist(*args, **kwargs)
                if counter is not None:
                    self.gist_totals = module_totals(counter)
                return out
            finally:
                self._in_gist = False
                self.sync()
                self.gist_s += time.perf_counter() - t0

        self.vlm.backend.encode_gist = timed_gist
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        del self.vlm.backend.encode_gist

    def _start(self, module: Any, args: Any) -> None:
        if not self._in_gist:
            self.sync()
            self._t0 = time.perf_counter()

    def _stop(self, module: Any, args: Any, output: Any) -> None:
        if not self._in_gist:
            self.sync()
            self.tower_s += time.perf_counter() - self._t0


def kv_cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers KV cache (every layer's keys and values)."""
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "nbytes"):
                total += int(t.nbytes)
    return total


def _layer(vlm: Any, arr_coc: str | None, device: Any) -> str:
    """Build the model's ARR-COC layer now, on the device; -> a description for the report."""
    try:
        layer = vlm.layer
    except ValueError as exc:
        raise ValueError(
            f"--arr-coc {arr_coc}: {exc}. The bench presets are random models at real widths (LM hidden "
            f"{vlm.backend.text_hidden_size}); a layer trained against another VLM cannot read them: leave --arr-coc "
            "out (or pass 'untrained') to bench the untrained layer built for this width") from None
    layer.to(device)
    width = layer.config.knowing.query_dim
    if arr_coc is None:
        return (f"untrained, built for query width {width} = the LM's hidden size; the shipped trained layer reads "
                "the embedded model's 192-d embeddings, so it cannot run on these widths")
    return f"trained, from {arr_coc}, query width {width}"


def _check_args(shape: Any, encodes, method: str, gist: float, margin: int, windows: bool) -> None:
    """Reject a selector, gist share, margin or window choice the bench cannot run (the CLI's words)."""
    from ..encode import EncodeConfig
    from ..pipeline.selection import available_methods, get_selector, selects_before_encoding
    if method not in available_methods() or method == "none":
        raise ValueError(f"--method must be a registered selector other than none; choose from "
                         f"{[m for m in available_methods() if m != 'none']}")
    if "before" in encodes and not selects_before_encoding(get_selector(method)):
        raise ValueError(f"method {method!r} reads the encoded tokens, so it cannot choose before the tower; "
                         "bench it with --encode after")
    if not 0.0 <= gist < 1.0:
        raise ValueError(f"--gist {gist} must be a share of the tokens in [0, 1) (0: no gist rows)")
    if margin < 0:
        raise ValueError(f"--margin {margin} must be >= 0 rings of cells (0: no margin rows)")
    if (margin or windows) and "before" not in encodes:
        raise ValueError("--margin / --whole-windows add 'before' rows (context cells the tower encodes): pass "
                         "--encode before (or after,before)")
    check_shape_encode(shape, EncodeConfig("before", windows=windows))   # whole windows: Qwen2.5-VL only


def _check_repeats(repeats: int | None, spec: Any) -> int:
    """The repetitions to time (the preset's default when not given); at least 1."""
    repeats = int(repeats or spec.repeats)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    return repeats


@dataclass
class _Rig:
    """What every row runs on: the model, ARR-COC around its backend, the bench item's inputs and the run's
    settings."""

    model: Any
    summary: Any
    vlm: Any
    layer_note: str
    image: Any
    question: str
    inputs: Any
    sync: Callable[[], None]
    tower_type: str
    n_vision: int
    n_lm: int
    runtime: Any
    method: str
    budget_mode: str | None


def _build_rig(spec: Any, n_vision: int, n_lm: int, runtime: Any, seed: int, arr_coc: str | None, method: str,
               budget_mode: str | None, fast: str | bool = "off") -> _Rig:
    """Seed, build the model at the preset's widths, wrap it with ARR-COC and build the bench item's inputs."""
    import torch

    from ..front import ARRCOC
    from .scenes import bench_scene

    torch.manual_seed(seed)
    backend, model, summary = build_backend(spec, n_vision, n_lm, runtime, seed)
    vlm = ARRCOC(backend, arr_coc=arr_coc, seed=seed, execution=read_fast_flag(fast, runtime.device),
                 name=str(getattr(model.config, "_name_or_path", "") or ""))
    layer_note = _layer(vlm, arr_coc, runtime.device)
    image, question = bench_scene(seed, 0, spec.size)
    inputs = backend.build_inputs([[image]], [question])
    sync = torch.cuda.synchronize if runtime.device.type == "cuda" else (lambda: None)
    tower_type = type(model.model.visual).__name__
    return _Rig(model, summary, vlm, layer_note, image, question, inputs, sync, tower_type, n_vision, n_lm,
                runtime, method, budget_mode)


def _run_row(rig: _Rig, row: RowSpec, count: bool) -> dict[str, Any]:
    """prepare + prefill for one row -> its times (and, when counting, FLOPs and sizes)."""
    from ..encode import EncodeConfig

    name = "none" if row.budget == 1.0 else rig.method
    encode = EncodeConfig(mode=row.encode, gist=row.gist, margin=row.margin, windows=row.windows)
    sync, vlm = rig.sync, rig.vlm   # counted: the compiled stages run eagerly (`Execution.compile`)
    tower = rig.model.model.visual
    with _Probe(vlm, tower, sync, count) as probe, flop_counter() if count else nullcontext() as prep_counter:
        sync()
        t0 = time.perf_counter()
        pruned, traces = vlm.prepare(rig.inputs, budget=None if name == "none" else row.budget, method=name,
                                     budget_mode=rig.budget_mode, encode=encode).outputs
        sync()
        t1 = time.perf_counter()
    with flop_counter() if count else nullcontext() as lm_counter:
        sync()
        t2 = time.perf_counter()
        out = vlm.backend.prefill(pruned, logits_to_keep=1)
        sync()
        t3 = time.perf_counter()
    prep_s = t1 - t0
    got = {"vision_s": probe.tower_s, "gist_s": probe.gist_s, "arr_coc_s": prep_s - probe.tower_s - probe.gist_s,
           "prefill_s": t3 - t2, "total_s": prep_s + (t3 - t2)}
    if count:
        got.update(_row_counts(rig, name, traces[0], probe, prep_counter, lm_counter, pruned, out))
    return got


def _row_counts(rig: _Rig, name: str, tr: Any, probe: _Probe, prep_counter: Any, lm_counter: Any, pruned: Any,
                out: Any) -> dict[str, Any]:
    """A counted run's FLOPs (tower, gist, ARR-COC, LM) and sizes (tokens, KV cache), from its counters."""
    prep = module_totals(prep_counter)
    gist_tower = tower_count(probe.gist_totals, rig.tower_type, rig.n_vision)
    cells_tower = tower_count(subtract(prep, probe.gist_totals), rig.tower_type, rig.n_vision)
    tokens = int(pruned.attention_mask.sum())
    return {
        "method": name, "visual_tokens": int(tr.kept_tokens), "visual_tokens_full": int(tr.total_tokens),
        "encoded_tokens": sum(int(c.numel()) for c in tr.encoded_cells), "total_tokens": tokens,
        "fallback": tr.fallback[0] if tr.fallback else None, "error": tr.error,
        "kv_cache_bytes": kv_cache_bytes(out.past_key_values),
        "_tower": cells_tower, "_gist": gist_tower, "_lm": lm_count(module_totals(lm_counter), rig.n_lm, tokens),
        "vision_flops": cells_tower.total, "gist_flops": gist_tower.total,
        "arr_coc_flops": prep["Global"] - cells_tower.total - gist_tower.total,
        "prefill_flops": int(lm_counter.get_total_flops()),
    }


def _measure(rig: _Rig, rows: list[RowSpec], repeats: int) -> tuple[dict, dict]:
    """A counted pass over every row (FLOPs, sizes; also the warm-up), then `repeats` timed passes in rotated order."""
    static = {row: _run_row(rig, row, count=True) for row in rows}      # FLOPs, sizes; also the warm-up
    if rig.vlm.execution.compiled:   # counted passes run eagerly: each row's graphs compile here, timed
        for row in rows:
            static[row]["compile_seconds"] = _run_row(rig, row, count=False)["total_s"]
    times: dict[RowSpec, dict[str, list[float]]] = {row: {} for row in rows}
    for rep in range(repeats):
        for row in rows[rep % len(rows):] + rows[: rep % len(rows)]:
            for k, v in _run_row(rig, row, count=False).items():
                times[row].setdefault(k, []).append(v)
    return static, times


def _report(preset: str, spec: Any, shape: Any, rig: _Rig, rows: list[RowSpec], static: dict, times: dict,
            repeats: int, load_start: tuple, t_start: float) -> dict[str, Any]:
    """The report dict: the run's settings, the host, the rows and the full-depth shares."""
    import torch

    targets = [shape] + [SHAPES[s] for s in spec.also]
    results = _rows(rows, static, times, shape, targets, rig.model, rig.n_vision)
    runtime = rig.runtime
    return {
        "preset": preset, "shape": shape.name, "label": label(spec, rig.n_vision, rig.n_lm),
        "layers": rig.n_lm, "vision_layers": rig.n_vision, "runtime": runtime.describe(),
        "execution": rig.vlm.execution.label,
        "dtype": str(runtime.dtype).removeprefix("torch."), "method": rig.method, "arr_coc_layer": rig.layer_note,
        "budget_mode": rig.budget_mode, "model": rig.summary, "image": list(rig.image.size),
        "question": rig.question,
        "visual_tokens_full": static[REFERENCE]["visual_tokens"], "repeats": repeats,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "machine": platform.machine(), "load_average_start": list(load_start),
                 "load_average_end": list(os.getloadavg()), "wall_s": time.perf_counter() - t_start},
        "results": results,
        "full_depth": _full_depth(results, targets),
    }


def bench(preset: str = "qwen2-vl-2b", vision_layers: int | None = None, lm_layers: int | None = None,
          budgets=None, encodes=ENCODES, gist: float = 0.0, repeats: int | None = None, method: str = "arr_coc",
          arr_coc: str | None = None, budget_mode: str | None = None, runtime: Any = None,
          seed: int = 0, margin: int = 0, windows: bool = False, fast: str | bool = "off") -> dict[str, Any]:
    """Measure every row side by side; returns the report dict (see the module docstring). fast: every row,
    the every-token reference included, on the fixed-shape compiled execution (`arr_coc.execution`)."""
    from ..runtime import Runtime

    spec = get_preset(preset)
    shape = SHAPES[spec.shape]
    n_vision, n_lm = run_layers(spec, vision_layers, lm_layers)
    _check_args(shape, encodes, method, gist, margin, windows)
    rows = row_specs(encodes, budgets or [0.1, 0.2, 0.3, 1.0], gist, margin, windows)
    repeats = _check_repeats(repeats, spec)
    runtime = runtime or Runtime.resolve("cpu", "float32")
    arr_coc = None if arr_coc in (None, "untrained") else arr_coc
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    rig = _build_rig(spec, n_vision, n_lm, runtime, seed, arr_coc, method, budget_mode, fast)
    static, times = _measure(rig, rows, repeats)
    return _report(preset, spec, shape, rig, rows, static, times, repeats, load_start, t_start)


def _rows(rows: list[RowSpec], static: dict, times: dict, shape: Any, targets: list, model: Any,
          n_vision: int) -> list[dict[str, Any]]:
    """The report's rows: medians, FLOPs at the layers run and at full depth, shares of the reference."""
    kinds_run = shape.block_kinds(n_vision)
    med = {row: {k: statistics.median(v) for k, v in times[row].items()} for row in rows}
    layer_cache: dict[tuple[str, int], int] = {}

    def full(row: RowSpec, target: Any) -> dict[str, int]:
        s = static[row]
        scale = 1.0 if target is shape else target.tower_out / shape.tower_out
        lm: LMCount = s["_lm"]
        layer = None
        if target is not shape:
            key = (target.name, lm.seq_len)
            if key not in layer_cache:
                layer_cache[key] = lm_layer_flops(model, target.text, lm.seq_len)
            layer = layer_cache[key]
        tower: TowerCount = s["_tower"]
        gist: TowerCount = s["_gist"]
        out = {"vision_flops_full": full_tower_flops(tower, kinds_run, target.block_kinds(), scale),
               "gist_flops_full": full_tower_flops(gist, kinds_run, target.block_kinds(), scale),
               "prefill_flops_full": full_lm_flops(lm, target.lm_depth, layer)}
        out["e2e_flops_full"] = sum(out.values()) + s["arr_coc_flops"]
        return out

    ref_full = {t.name: full(REFERENCE, t) for t in targets}
    ref, ref_s = static[REFERENCE], med[REFERENCE]
    ref_e2e = ref["vision_flops"] + ref["gist_flops"] + ref["arr_coc_flops"] + ref["prefill_flops"]
    results = []
    for row in sorted(rows, key=lambda r: (r.encode != "after", r.gist, r.margin, r.windows,
                                           static[r]["visual_tokens"])):
        s, m = static[row], med[row]
        e2e = s["vision_flops"] + s["gist_flops"] + s["arr_coc_flops"] + s["prefill_flops"]
        mine = full(row, shape)
        flops_share_run = e2e / ref_e2e
        time_share = m["total_s"] / ref_s["total_s"]
        results.append({
            "encode": row.encode, "gist": row.gist, "budget": row.budget, "margin": row.margin,
            "windows": row.windows, **{k: v for k, v in s.items() if not k.startswith("_") and not k.endswith("_s")},
            "e2e_flops": e2e, **mine,
            **{f"{k}_median": v for k, v in m.items()},
            "total_s_all": times[row]["total_s"],
            "e2e_flops_share": mine["e2e_flops_full"] / ref_full[shape.name]["e2e_flops_full"],
            "e2e_flops_share_run": flops_share_run,
            "e2e_time_share": time_share,
            "time_over_flops": time_share / flops_share_run,
            "arr_coc_time_share": m["arr_coc_s"] / ref_s["total_s"],
            "gist_time_share": m["gist_s"] / ref_s["total_s"],
            "speedup": ref_s["prefill_s"] / m["prefill_s"],
            "ideal_speedup": ref["prefill_flops"] / s["prefill_flops"],
            "speedup_vs_ideal": (ref_s["prefill_s"] / m["prefill_s"]) / (ref["prefill_flops"] / s["prefill_flops"]),
            "overhead_share": m["arr_coc_s"] / ref_s["prefill_s"],
            "_full": {t.name: (full(row, t)["e2e_flops_full"], ref_full[t.name]) for t in targets},
        })
    return results


def _full_depth(results: list[dict[str, Any]], targets: list) -> dict[str, Any]:
    """Per shape: the tower's share of the full prefill and each row's e2e share (counted, full depth)."""
    out = {}
    for t in targets:
        ref = results[0]["_full"][t.name][1]
        out[t.name] = {
            "vision_share": (ref["vision_flops_full"] + ref["gist_flops_full"]) / ref["e2e_flops_full"],
            "full_prefill_flops": ref["e2e_flops_full"], "source": t.source,
            "rows": [{"encode": r["encode"], "gist": r["gist"], "budget": r["budget"], "margin": r["margin"],
                      "windows": r["windows"], "e2e_flops_share": r["_full"][t.name][0] / ref["e2e_flops_full"]}
                     for r in results],
        }
    for r in results:
        del r["_full"]
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown_table(report: dict[str, Any]) -> str:
    """The measured rows, the gist lines, and the full-depth FLOP shares per shape."""
    lm = report["model"]["lm"]
    lines = [
        f"bench: {report['shape']} widths (LM hidden {lm['hidden_size']}), random weights, {report['label']}; "
        f"{report['runtime']}; {report['image'][0]}x{report['image'][1]} image, {report['visual_tokens_full']} "
        f"visual tokens; selector {report['method']}, ARR-COC layer {report['arr_coc_layer']}; medians of "
        f"{report['repeats']} runs, every row in each, rotated. Shares are of the (after, 100%) row.\n",
        "| encode | budget | LM / encoded tokens | vision ms | ARR-COC ms | LM ms | total ms | GFLOPs vision / "
        "ARR-COC / LM (run) | e2e time share | e2e FLOP share (run) | time / FLOPs | ARR-COC time share | "
        "e2e FLOP share, full depth |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gist_lines = []
    for r in report["results"]:
        enc = variant(r["encode"], r["gist"], r["margin"], r["windows"])
        lines.append(
            f"| {enc} | {fmt_budget(r['budget'])} | {r['visual_tokens']} / {r['encoded_tokens']} | "
            f"{r['vision_s_median'] * 1e3:.0f} | {r['arr_coc_s_median'] * 1e3:.0f} | "
            f"{r['prefill_s_median'] * 1e3:.0f} | "
            f"{r['total_s_median'] * 1e3:.0f} | {r['vision_flops'] / 1e9:.1f} / {r['arr_coc_flops'] / 1e9:.2f} / "
            f"{r['prefill_flops'] / 1e9:.1f} | {r['e2e_time_share']:.3f} | {r['e2e_flops_share_run']:.3f} | "
            f"{r['time_over_flops']:.2f} | {_pct(r['arr_coc_time_share'])} | {r['e2e_flops_share']:.3f} |")
        if r["gist"]:
            gist_lines.append(
                f"- gist ({enc}, {fmt_budget(r['budget'])}): {r['gist_s_median'] * 1e3:.0f} ms, "
                f"{_pct(r['gist_time_share'])} of the reference's time; {r['gist_flops'] / 1e9:.2f} GFLOPs run, "
                f"{r['gist_flops_full'] / 1e9:.1f} at full depth (included in the row's total and e2e shares)")
        if r.get("fallback") or r.get("error"):
            gist_lines.append(f"- {enc} {fmt_budget(r['budget'])}: fallback {r['fallback']} ({r['error']})")
    lines += [""] + gist_lines if gist_lines else []
    full = report["full_depth"]
    rows = report["results"]
    heads = [f"{variant(r['encode'], r['gist'], r['margin'], r['windows'])} {fmt_budget(r['budget'])}" for r in rows]
    lines += ["", "Full depth, counted, not timed (each layer run counted with its attention, scaled to the real "
                  "depth); e2e share of the full model's prefill FLOPs:\n",
              "| shape | tower share of the full prefill | full prefill TFLOPs | " + " | ".join(heads) + " |",
              "|---|---|---|" + "---|" * len(heads)]
    for name, f in full.items():
        lines.append(f"| {name} | {f['vision_share']:.3f} | {f['full_prefill_flops'] / 1e12:.2f} | "
                     + " | ".join(f"{x['e2e_flops_share']:.3f}" for x in f["rows"]) + " |")
    return "\n".join(lines) + "\n"
