"""What the page and the trace download say about a request's runs: the tokens-and-cost table (baseline,
config A, config B side by side) and the JSON trace record.

Times come from each run's `Trace` (one instrumented `generate()`): the vision tower (the gist
included, and the gist on its own), ARR-COC's own work (the selection: texture, scorers, allocator; and
packing the chosen cells and the prompt), the language model's prefill, and the whole prefill = vision +
ARR-COC's own work + LM prefill, which is what selecting before the tower saves on; FLOPs come from
`arr_coc.evaluation.cost` when the server counts them.

A run that took more than one look (encode before, looks > 1: `Trace.looks`) adds one row per look, in
order ("look 1", "look 2", ...): the cells it added to what the LM reads, the cells the tower encoded on it,
the prompt it prefilled, the first answer token's uncertainty against the threshold, the gate's strength and
the decision (`look_decision`); the trace's `looks` holds the same per look.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from arr_coc.paths import shown_path

if TYPE_CHECKING:
    from arr_coc import Trace
    from arr_coc.budget import Budget
    from arr_coc_microscope.asked import Asked
    from arr_coc_microscope.scope import Microscope, Pruned, Run

STATS_HEADERS = ["", "baseline", "config A", "config B"]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{1000 * seconds:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b and math.isfinite(a) and math.isfinite(b) and b > 0 else "-"


def _gflops(flops: int | None) -> str:
    return "-" if flops is None else f"{flops / 1e9:.3g}"


def whole_prefill_s(t: Trace) -> float:
    """Vision tower (gist included) + ARR-COC's own work (selection + packing) + the language model's prefill,
    in seconds. The baseline's own work is packing its (unpruned) prompt."""
    return t.vision_s + t.arr_coc_s + t.prefill_s


def kept_per_budget(t: Trace) -> str:
    """1.00x, or how the trained layer scaled this question's budget (more cells relevant, more tokens)."""
    from arr_coc.budget import resolve_count

    if isinstance(t.budget, bool) or not isinstance(t.budget, (int, float)) or not t.total_tokens:
        return "-"  # adaptive: no budget to compare with
    kept = getattr(t, "kept_indices", None)   # the chosen cells (kept_tokens also counts periphery tokens)
    chosen = sum(int(k.numel()) for k in kept) if kept else t.kept_tokens
    return f"{chosen / resolve_count(t.budget, t.total_tokens):.2f}x"


def predicted_cells(t: Trace) -> str:
    """The cells the layer's extent head predicts the answer covers (what scaled the budget), or "-"."""
    out = t.arr_coc
    if out is None or getattr(out, "extent", None) is None:
        return "-"
    return ", ".join(f"{float(c):.1f}" for c in out.extent)


def _share(n: int, total: int) -> str:
    return f"{n} ({100 * n / max(1, total):.0f}%)"


def _encoded(t: Trace) -> int:
    return sum(int(c.numel()) for c in t.encoded_cells) if t.encoded_cells else t.total_tokens


def _margin(t: Trace) -> str:
    return str(sum(t.to_dict()["margin_per_image"])) if t.encode == "before" else "-"


def _periphery(t: Trace) -> str:
    return str(sum(int(c.numel()) for c in t.periphery_cells)) if t.periphery_cells else "-"


def execution_text(t: Any) -> str:
    """How a run executed: "eager", or "fast: 64 cells, 256-token prompt" (its fixed-shape bucket)."""
    if not t.bucket:
        return t.execution
    cells = "+".join(str(c) for c in t.bucket["filled"])
    return f"{t.execution}: {cells} cells, {t.bucket['prompt']}-token prompt"


# (row name, value for the baseline, value for a pruned run); pruned values get (run, its config, the baseline)
ROWS: list[tuple[str, Callable[[Run], str], Callable[[Run, Any, Run], str]]] = [
    ("model (answered)", lambda b: shown_path(b.trace.model), lambda r, c, b: shown_path(r.trace.model)),
    ("execution (bucket)", lambda b: execution_text(b.trace), lambda r, c, b: execution_text(r.trace)),
    ("adapter", lambda b: shown_path(b.trace.adapter), lambda r, c, b: shown_path(r.trace.adapter)),
    ("method", lambda b: "none (all tokens)", lambda r, c, b: str(r.trace.method)),
    ("ARR-COC layer", lambda b: "-", lambda r, c, b: c.layer if str(c.method).startswith("arr_coc") else "-"),
    ("encode", lambda b: "after", lambda r, c, b: c.encode_text()),
    ("budget", lambda b: "1.0", lambda r, c, b: str(r.trace.budget)),
    ("visual tokens (total)", lambda b: str(b.trace.total_tokens), lambda r, c, b: str(r.trace.total_tokens)),
    ("visual tokens (kept)", lambda b: str(b.trace.kept_tokens),
     lambda r, c, b: _share(r.trace.kept_tokens, r.trace.total_tokens)),
    ("kept / budget", lambda b: "-", lambda r, c, b: kept_per_budget(r.trace)),
    ("answer's cells (predicted)", lambda b: "-", lambda r, c, b: predicted_cells(r.trace)),
    ("cells encoded at full resolution", lambda b: str(_encoded(b.trace)),
     lambda r, c, b: _share(_encoded(r.trace), r.trace.total_tokens)),
    ("margin cells (encoded, not read)", lambda b: "-", lambda r, c, b: _margin(r.trace)),
    ("periphery tokens (gist, read)", lambda b: "-", lambda r, c, b: _periphery(r.trace)),
    ("prompt tokens", lambda b: str(b.trace.prompt_tokens), lambda r, c, b: str(r.trace.prompt_tokens)),
    ("vision tower, gist incl. (ms)", lambda b: _ms(b.trace.vision_s), lambda r, c, b: _ms(r.trace.vision_s)),
    ("gist (ms)", lambda b: "-", lambda r, c, b: _ms(r.trace.gist_s) if r.trace.gist_grid else "-"),
    ("ARR-COC's own work (ms)", lambda b: _ms(b.trace.arr_coc_s), lambda r, c, b: _ms(r.trace.arr_coc_s)),
    ("of which selection (ms)", lambda b: _ms(b.trace.select_s), lambda r, c, b: _ms(r.trace.select_s)),
    ("LM prefill (ms)", lambda b: _ms(b.trace.prefill_s), lambda r, c, b: _ms(r.trace.prefill_s)),
    ("whole prefill (ms)", lambda b: _ms(whole_prefill_s(b.trace)), lambda r, c, b: _ms(whole_prefill_s(r.trace))),
    ("whole prefill speedup", lambda b: "1.00x",
     lambda r, c, b: _ratio(whole_prefill_s(b.trace), whole_prefill_s(r.trace))),
    ("LM prefill speedup", lambda b: "1.00x", lambda r, c, b: _ratio(b.trace.prefill_s, r.trace.prefill_s)),
    ("total with decoding (ms)", lambda b: _ms(b.trace.total_s), lambda r, c, b: _ms(r.trace.total_s)),
    ("vision GFLOPs", lambda b: _gflops(b.flops.vision if b.flops else None),
     lambda r, c, b: _gflops(r.flops.vision if r.flops else None)),
    ("whole prefill GFLOPs", lambda b: _gflops(b.flops.whole if b.flops else None),
     lambda r, c, b: _gflops(r.flops.whole if r.flops else None)),
    ("whole prefill FLOPs vs. baseline", lambda b: "100%" if b.flops and b.flops.whole else "-",
     lambda r, c, b: f"{100 * r.flops.whole / b.flops.whole:.0f}%"
     if r.flops and b.flops and r.flops.whole is not None and b.flops.whole else "-"),
    ("new tokens", lambda b: str(b.trace.new_tokens), lambda r, c, b: str(r.trace.new_tokens)),
]
ROW_NAMES = [name for name, _, _ in ROWS]


def per_group(t: Trace) -> str:
    """A clip's tokens kept per temporal group, in time order ("12 3 0 5"); "-" for an image."""
    groups = t.kept_per_group
    return " ".join(str(k) for k in groups[0]) if groups else "-"


CLIP_ROWS = [("tokens per temporal group", lambda b: per_group(b.trace), lambda r, c, b: per_group(r.trace))]


def stats_rows(base: Run, pruned: list[Pruned]) -> list[list[str]]:
    """One row per ROWS entry (a clip's also per CLIP_ROWS entry, after the kept tokens): [name, baseline, config A,
    config B] ("-" for a config that did not run), then, when a config took more than one look, one row per look
    ("look 1", ...; `look_text`)."""
    columns = [p for p in pruned] + [None] * (2 - len(pruned))
    table = list(ROWS)
    if base.trace.kept_per_group:
        at = ROW_NAMES.index("visual tokens (kept)") + 1
        table[at:at] = CLIP_ROWS
    rows = [[name, of_base(base)] + ["-" if p is None or p.run is None else of_run(p.run, p.config, base)
                                   for p in columns]
            for name, of_base, of_run in table]
    tables = [looks_table(p.run.trace, p.config.encode.saccade.threshold) if p is not None and p.run is not None
              else [] for p in columns]
    for n in range(max(len(t) for t in tables)):
        rows.append([f"look {n + 1}", "-"] + [look_text(t[n]) if n < len(t) else "-" for t in tables])
    return rows


# ----------------------------------------------------------------------------- the looks (encode before, looks > 1)


LOOK_HEADERS = ["look", "cells added", "cells encoded", "prompt tokens", "uncertainty", "threshold", "strength",
                "decision", "gate"]


def look_decision(look: Any) -> str:
    """Why a look was the last or not: the gate said go and a look followed; it said stop; it said go, no looks left."""
    if look.saccade:
        return "looked again"
    return "stopped: no looks left" if look.go else "stopped: confident"


def looks_table(t: Trace, threshold: float) -> list[list[str]]:
    """One row per look of `t` in order (LOOK_HEADERS), the last field the gate's hard decision ("go" or "stop");
    [] for a run with one look."""
    return [[str(n), str(sum(int(c.numel()) for c in look.cells)), str(sum(int(c.numel()) for c in look.encoded)),
             str(look.prompt_tokens), f"{look.uncertainty:.3f}", f"{threshold:.4g}", f"{look.strength:.3f}",
             look_decision(look), "go" if look.go else "stop"]
            for n, look in enumerate(getattr(t, "looks", None) or [], start=1)]


def look_text(row: list[str]) -> str:
    """A looks_table row as one cell of the stats table: what the look added and why it looked again or stopped."""
    _, added, encoded, prompt, u, threshold, strength, decision, gate = row
    above = ">" if gate == "go" else "<="            # the gate's decision: uncertainty above the threshold
    cells = "cell" if added == "1" else "cells"
    return (f"+{added} {cells} read, {encoded} encoded; {prompt} prompt tokens; uncertainty {u} {above} threshold "
            f"{threshold} (strength {strength}): {decision}")


def looks_record(t: Trace, threshold: float) -> list[dict[str, Any]]:
    """The trace's looks (`Look.to_dict`), each with its number, the threshold and the decision in words."""
    return [{"look": n, **look.to_dict(), "threshold": threshold, "decision": look_decision(look)}
            for n, look in enumerate(t.looks, start=1)]


# ----------------------------------------------------------------------------- the trace download


def _grid_list(t: Any, h: int, w: int) -> list[list[float]]:
    return [[round(float(x), 4) for x in row] for row in t[0, :h, :w].tolist()]


def cells_record(t: Trace) -> dict[str, Any]:
    """Which cells were encoded at which resolution, per image (raster indices; `resolution` cell by cell)."""
    from arr_coc.pipeline.trace import RESOLUTION_LEVELS, UNREAD

    codes = [t.resolution(j) for j in range(len(t.grid_hw))]
    return {
        "legend": list(RESOLUTION_LEVELS),
        "resolution": [c.reshape(h, w).tolist() for c, (h, w) in zip(codes, t.grid_hw)],
        "chosen": [k.tolist() for k in t.kept_indices],
        "encoded_not_read": [(c == UNREAD).nonzero().squeeze(1).tolist() for c in codes],
        "periphery_tokens": [p.tolist() for p in t.periphery_cells],
    }


def config_record(config: Any) -> dict[str, Any]:
    e = config.encode
    looks = {"looks": e.passes, "threshold": e.saccade.threshold} if e.passes > 1 else {}
    return {"label": config.label, "layer": config.layer, "method": config.method,
            "encode": {"mode": e.mode, "gist": e.gist, "margin": e.margin, "periphery": e.periphery, **looks}}


def run_record(p: Pruned, base: Run) -> dict[str, Any]:
    """A pruned run's entry: its config, its Trace, cells by resolution, FLOPs and (ARR-COC) the layer's maps."""
    if p.run is None:
        return {"config": config_record(p.config), "failed": p.failed, "answer": base.answer,
                "fell_back_to": "baseline"}
    t = p.run.trace
    entry = {"config": config_record(p.config), "answer": p.run.answer, **t.to_dict(),
             "kept_indices": [k.tolist() for k in t.kept_indices], "cells": cells_record(t),
             "flops": p.run.flops.to_dict() if p.run.flops else None,
             "looks": looks_record(t, p.config.encode.saccade.threshold)}
    out = t.arr_coc
    if out is not None and getattr(out, "relevance", None) is not None:
        from arr_coc import viz

        out = out.cpu()
        h, w = out.grid_hw[0]
        maps = {name: _grid_list(getattr(out, name), h, w)
                for name in ("relevance", "information", "perspectival", "participatory")
                if getattr(out, name, None) is not None}
        entry["layer"] = {"grid_hw": [h, w], "weights": viz.balancer_weights(out),
                          "channel_names": list(out.channel_names or []), "fallback": out.fallback[0],
                          "error": out.errors[0], "maps": maps}
    return entry


def trace_record(scope: Microscope, question: str, asked: Asked, method: str, budget: Budget, adaptive: bool,
                 arr_on: bool, base: Run, pruned: list[Pruned], notes: list[str]) -> dict:
    """The downloadable trace: request, what was asked about (`image` or `video`), the baseline, config A
    (`arr_coc`) and B (`compare`)."""
    record: dict[str, Any] = {
        "model": scope.model_name,
        "answered_by": base.trace.model or scope.model_name,
        "arr_coc_layer": scope.layer_name,
        "question": question,
        "request": {"arr_coc": arr_on, "method": method, "budget": budget, "adaptive": adaptive,
                    "configs": [config_record(p.config) for p in pruned]},
        **asked.describe(),
        "notes": notes,
        "baseline": {"answer": base.answer, **base.trace.to_dict(), "cells": cells_record(base.trace),
                     "flops": base.flops.to_dict() if base.flops else None},
        "arr_coc": run_record(pruned[0], base) if pruned else None,
        "compare": run_record(pruned[1], base) if len(pruned) > 1 else None,
    }
    return record
