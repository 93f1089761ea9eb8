"""`python -m arr_coc bench`: what pruning saves in the prefill, on a Qwen2-VL-2B-shaped model.

    python -m arr_coc bench --preset qwen2-vl-2b --layers 4 --budgets 0.05,0.1,0.25,0.5,1.0 --out bench.json

The language model has Qwen2-VL-2B-Instruct's shape (hidden 1536, 12 heads, 2 KV
heads, MLP 8960, M-RoPE sections 16/24/24) with random weights and FEWER layers than
the real 28 (default 4, stated in the output): per-layer cost is what matters, and the
ratios below do not depend on depth except that ARR-COC's fixed overhead shrinks
relative to a deeper prefill. The vision tower is tiny (its cost is not what is
benchmarked); the image is a 896 x 896 ShapesVQA scene, 1024 merged visual tokens.
The vocabulary is the tiny byte-level one (264 tokens), so the LM head is negligible;
the prefill computes the last position's logits only, as `generate` does.

Per budget, all measured side by side in one run (each repetition runs every budget,
in a rotated order, so machine drift hits all budgets alike; medians over repetitions):
- visual_tokens / total_tokens: visual tokens kept and the whole prompt length;
- prefill_flops: FLOPs of the LM prefill (FlopCounterMode, counted once);
- prefill_s_median: wall time of that prefill;
- kv_cache_bytes: bytes of the KV cache the prefill leaves (all layers, K and V);
- arr_coc_s_median: ARR-COC's own time (everything `prepare` does after the vision
  tower: texture, scorers, allocation, positions, input rewrite), and arr_coc_flops;
- overhead_share = arr_coc_s_median / full-token prefill_s_median;
- speedup = full / pruned prefill time; ideal_speedup = full / pruned prefill FLOPs;
  speedup_vs_ideal = speedup / ideal_speedup (1.0: time falls exactly as FLOPs do).
The full-token row (budget 1.0) is the unpruned reference and runs no selector.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

from .flops import CountedSelector, count_flops
from .report import fmt_budget

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen2-VL-2B-Instruct's language model (28 layers in the real model).
    "qwen2-vl-2b": {
        "layers": 4, "canvas": "896x896", "repeats": 5, "max_pixels": 896 * 896,
        "text": {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
                 "num_key_value_heads": 2, "max_position_embeddings": 32768,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        "vision": {"depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2},
        "note": "LM shaped like Qwen2-VL-2B-Instruct (28 layers there), random weights; tiny vision tower "
                "(not benchmarked); byte-level vocabulary of 264 tokens",
    },
    # Seconds, for tests: the tiny test model on a 336 x 336 image (144 visual tokens).
    "tiny": {
        "layers": 2, "canvas": "336x336", "repeats": 2, "max_pixels": 448 * 448,
        "text": {}, "vision": {},
        "note": "tiny random Qwen2-VL (hidden 64) for tests; numbers mean nothing",
    },
}


def build_model(preset: str, layers: int | None = None, dtype: str = "float32", seed: int = 0):
    """(model, processor, config summary) of a preset with random weights."""
    import torch

    from ..qwen.tiny import build_tiny_qwen

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    spec = PRESETS[preset]
    n_layers = int(layers or spec["layers"])
    if n_layers < 1:
        raise ValueError(f"--layers must be at least 1, got {n_layers}")
    text = dict(spec["text"], num_hidden_layers=n_layers)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model, processor = build_tiny_qwen("qwen2_vl", seed=seed, dtype=torch_dtype, max_pixels=spec["max_pixels"],
                                       text_config=text, vision_config=dict(spec["vision"]))
    tc, vc = model.config.text_config, model.config.vision_config
    summary = {
        "lm": {"hidden_size": tc.hidden_size, "num_attention_heads": tc.num_attention_heads,
               "num_key_value_heads": tc.num_key_value_heads, "intermediate_size": tc.intermediate_size,
               "num_hidden_layers": tc.num_hidden_layers, "vocab_size": tc.vocab_size,
               "parameters": sum(p.numel() for p in model.model.language_model.parameters())},
        "vision": {"depth": vc.depth, "embed_dim": vc.embed_dim,
                   "parameters": sum(p.numel() for p in model.model.visual.parameters())},
        "note": spec["note"],
    }
    return model, processor, summary


def kv_cache_bytes(cache: Any) -> int:
    """Bytes held by a transformers KV cache (every layer's keys and values)."""
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "nbytes"):
                total += int(t.nbytes)
    if total == 0 and hasattr(cache, "key_cache"):
        total = sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(cache.key_cache, cache.value_cache))
    return total


def bench(preset: str = "qwen2-vl-2b", layers: int | None = None, budgets=None, repeats: int | None = None,
          method: str = "arr_coc", dtype: str = "float32", seed: int = 0) -> dict[str, Any]:
    """Measure every budget side by side; returns the report dict (see the module docstring)."""
    import torch

    from ..shapes import make_item
    from ..qwen import ARRCOCQwen
    from ..selection import available_methods, get_selector

    spec = PRESETS.get(preset)
    if spec is None:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if method not in available_methods() or method == "none":
        raise ValueError(f"--method must be a registered selector other than none; choose from "
                         f"{[m for m in available_methods() if m != 'none']}")
    budgets = list(budgets or [0.05, 0.1, 0.25, 0.5, 1.0])
    if 1.0 not in budgets:
        budgets.append(1.0)
    repeats = int(repeats or spec["repeats"])
    torch.manual_seed(seed)
    model, processor, summary = build_model(preset, layers, dtype, seed)
    wrapper = ARRCOCQwen(model, processor, seed=seed)
    image, record, _ = make_item(seed, "bench", 0, canvas=spec["canvas"], hard_rate=0.0)
    inputs = wrapper.build_inputs([[image]], [record["question"]])

    def once(budget):
        """prepare + prefill at one budget -> (pruned, trace, prefill seconds, selector)."""
        sel = None if budget == 1.0 else CountedSelector(get_selector(method), method)
        pruned, traces = wrapper.prepare(inputs, budget=None if sel is None else budget, method=sel or "none")
        t0 = time.perf_counter()
        wrapper.prefill(pruned, logits_to_keep=1)
        return pruned, traces[0], time.perf_counter() - t0, sel

    static: dict[Any, dict[str, Any]] = {}
    for b in budgets:  # warm-up, FLOPs and KV cache (not timed)
        pruned, trace, _, sel = once(b)
        _, flops = count_flops(wrapper.prefill, pruned, logits_to_keep=1)
        out = wrapper.prefill(pruned, logits_to_keep=1, use_cache=True)
        static[b] = {"visual_tokens": int(trace.kept_tokens), "visual_tokens_full": int(trace.total_tokens),
                     "total_tokens": int(pruned.attention_mask.sum()), "prefill_flops": flops,
                     "kv_cache_bytes": kv_cache_bytes(out.past_key_values),
                     "arr_coc_flops": sel.flops() if sel is not None else 0}
    timings: dict[Any, dict[str, list[float]]] = {b: {"prefill": [], "arr_coc": [], "select": []} for b in budgets}
    for rep in range(repeats):
        order = budgets[rep % len(budgets):] + budgets[: rep % len(budgets)]
        for b in order:
            _, trace, prefill_s, sel = once(b)
            timings[b]["prefill"].append(prefill_s)
            timings[b]["arr_coc"].append(0.0 if sel is None else trace.total_s - trace.vision_s)
            timings[b]["select"].append(0.0 if sel is None else trace.select_s)
    full_t = statistics.median(timings[1.0]["prefill"])
    full_f = static[1.0]["prefill_flops"]
    results = []
    for b in sorted(budgets, key=lambda x: static[x]["visual_tokens"]):
        t = statistics.median(timings[b]["prefill"])
        ideal = full_f / static[b]["prefill_flops"]
        arr_s = statistics.median(timings[b]["arr_coc"])
        results.append({
            "budget": b, **static[b],
            "prefill_s_median": t, "prefill_s_all": timings[b]["prefill"],
            "arr_coc_s_median": arr_s, "arr_coc_select_s_median": statistics.median(timings[b]["select"]),
            "overhead_share": arr_s / full_t, "speedup": full_t / t, "ideal_speedup": ideal,
            "speedup_vs_ideal": (full_t / t) / ideal,
        })
    return {
        "preset": preset, "layers": summary["lm"]["num_hidden_layers"], "dtype": dtype, "method": method,
        "model": summary, "image": list(image.size), "question": record["question"],
        "visual_tokens_full": static[1.0]["visual_tokens"], "repeats": repeats,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "machine": platform.machine()},
        "results": results,
    }


def markdown_table(report: dict[str, Any]) -> str:
    lm = report["model"]["lm"]
    head = (f"Prefill on a {report['preset']} LM ({report['layers']} layers, hidden {lm['hidden_size']}, "
            f"{report['dtype']}, random weights), {report['image'][0]}x{report['image'][1]} image, "
            f"{report['visual_tokens_full']} visual tokens, method {report['method']}, median of "
            f"{report['repeats']} runs:\n")
    lines = [head, "| budget | visual / total tokens | prefill GFLOPs | prefill ms | KV cache MB | "
                   f"{report['method']} ms | {report['method']} MFLOPs | overhead share | speedup | ideal | "
                   "speedup / ideal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(
            f"| {fmt_budget(r['budget'])} | {r['visual_tokens']} / {r['total_tokens']} | "
            f"{r['prefill_flops'] / 1e9:.2f} | {r['prefill_s_median'] * 1e3:.1f} | {r['kv_cache_bytes'] / 2**20:.2f} | "
            f"{r['arr_coc_s_median'] * 1e3:.1f} | {r['arr_coc_flops'] / 1e6:.1f} | {r['overhead_share']:.3f} | "
            f"{r['speedup']:.2f} | {r['ideal_speedup']:.2f} | {r['speedup_vs_ideal']:.2f} |")
    return "\n".join(lines) + "\n"
