"""Stock vLLM, vLLM + ARR-COC before the tower, and the project's Hugging Face path, side by side in ONE run.

Run it ALONE on the machine (it times things), from the repository root; one command runs every row, one after
the other, each in its own process (vLLM rows in .venv-vllm, the Hugging Face rows in the project's .venv):

    flock /tmp/cpu.lock .venv/bin/python scripts/vllm_bench.py --out runs/vllm_bench/report.json \\
        --md runs/vllm_bench/report.md

Smoke (about 3.5 minutes on 2 shared cores): `--n-shapes 8 --ttft-k-shapes 2 --n-2b 2 --ttft-k-2b 1
--vision-layers 2 --lm-layers 2 --work runs/vllm_bench_smoke` (the 2B widths at 2 of 32 vision blocks and 2 of 28
LM layers, labelled so in the table). The full run, projected from the smoke on 2 shared cores: about 3 min for
the embedded model and 75-85 min for the 2B widths, most of it the two every-token rows (about 50 s an item through
stock vLLM, 80 s through the HF path: 12.4 TFLOPs each) and the first build of the 7.8 GB model folder.

Setups (`--setups shapes,2b`):
- shapes: the embedded model (checkpoints/shapes-qwen2vl) with the layer checkpoints/arr-coc-shapes-before, its
  LoRA adapter off (the plugin runs none), on `gen-data --split test --seed 0` items (448x448); accuracy is real.
- 2b: the `qwen2-vl-2b` bench preset (Qwen2-VL-2B widths, tiny byte vocabulary) at full depth unless
  --vision-layers / --lm-layers say otherwise, random weights (seed 0) saved ONCE as safetensors in a model folder
  (config, tokenizer, processor) that vLLM and the Hugging Face path both load; the untrained layer; items
  `gen-data --canvas 896x896` (1,024 merged visual tokens each). Accuracy means nothing there.

Rows per setup: stock vLLM; vLLM + the plugin (`ARRCOCQwen2VLForConditionalGeneration`, encode "before", adapter
off) at each --budgets share (one engine, each batch naming its budget in `mm_processor_kwargs`); the Hugging Face
path (`ARRCOC.from_pretrained(..., adapter=False)`, the front door) with every token
(method none, the stock model's path) and at each budget (`budget_mode="exact"`, `encode="before"`).

Items: `gen-data --n N+K+1`; the first N are the throughput set (and scored), the next K the time-to-first-token
set, the last one the warm-up item. No measured request repeats an image another measured request of its row used,
so vLLM's caches (prefix, encoder, processor; left at their defaults) never serve a measured request from an earlier
one.

Columns (the JSON's names):
- throughput_rps: N / the wall time of answering all N (greedy, --max-tokens); vLLM: the N requests submitted at
  once (`LLM.chat` on all of them: its scheduler batches them); HF: `ARRCOC.generate` on batches of
  --hf-batch-* items (the project's own batching: padded to the batch's longest prompt, decoding until every row
  stopped), one batch after the other.
- ttft_s: time to first token, defined as the wall time of one request sent ALONE with max_tokens=1 (vLLM:
  `LLM.chat([request])`; HF: `generate(image, question, max_new_tokens=1)`), from the call with a loaded PIL image
  to its return (processor, tower, choice, prefill, the first token's sampling); median over the K items, after
  one warm-up request. vLLM's own per-request `first_token_latency` (engine metrics) is in the JSON beside it.
- prompt_tokens / visual_tokens: means over the N items (vLLM: the prompt's ids and its image pads; HF: the trace's
  pruned prompt length and kept tokens).
- accuracy: `arr_coc.data.score_record` on the N answers (the embedded model only).
- arr_coc_time_share: time inside the choice over the wall time of the N-item run. vLLM: the plugin's
  `arr_coc_choose` (the pure choice), timed in vLLM's worker by $ARR_COC_VLLM_TIMING; HF: the pipeline's
  selection stage (`Trace.select_s`, once per batch). The same selector on the same inputs in both.
- arr_coc_flop_share: the selector's FLOPs over the whole prefill's (tower + selector + LM), the project's FLOP
  accounting (`arr_coc.evaluation.cost`, through `evaluate`) on the first --flop-items items of the HF rows, off the
  clock. The plugin keeps the HF path's cells (tests/test_vllm_plugin.py), so its tower and LM run the same FLOPs:
  the vLLM rows show the HF row of the same budget (stock vLLM: the every-token row).

Writes the JSON (--out: every number, each row's command, the host) and prints a Markdown table (--md FILE too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PY = ROOT / ".venv" / "bin" / "python"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
ARCH = "ARRCOCQwen2VLForConditionalGeneration"
SHAPES_MODEL, SHAPES_LAYER = "checkpoints/shapes-qwen2vl", "checkpoints/arr-coc-shapes-before"
PRESET = "qwen2-vl-2b"
MiB = 1 << 20


# -- what runs ----------------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """One model setup: its model folder, layer, items and sizes."""

    name: str                   # "shapes" | "2b"
    label: str                  # for the table
    model: str                  # model folder
    layer: str | None           # the layer's folder; None: the untrained layer
    items: str                  # test.jsonl: N throughput items, then K TTFT items, then 1 warm-up item
    n: int
    ttft_k: int
    hf_batch: int
    kv_cache_bytes: int         # vLLM's KV cache, sized to hold every request of the batch at once
    max_model_len: int
    trained: bool               # accuracy means something


@dataclass
class Job:
    """What a row's worker process runs (written as JSON, read by `--worker`)."""

    kind: str                   # "vllm" | "hf" | "build"
    setup: dict[str, Any]
    out: str
    budgets: list[str] = field(default_factory=list)
    stock: bool = False
    max_tokens: int = 16
    flop_items: int = 2
    build: dict[str, Any] = field(default_factory=dict)


def read_items(path: str) -> list[Any]:
    """The split's items (`arr_coc.evaluation.items`): `.question`, `.load()`, `.record` for scoring."""
    from arr_coc.evaluation.items import read_items as read

    return read(path)


def item_sets(setup: Setup) -> tuple[list[Any], list[Any], Any]:
    """(throughput items, TTFT items, the warm-up item)."""
    items = read_items(setup.items)
    need = setup.n + setup.ttft_k + 1
    if len(items) < need:
        raise SystemExit(f"{setup.items} holds {len(items)} items; the run needs {need} (N + K + 1)")
    return items[:setup.n], items[setup.n:setup.n + setup.ttft_k], items[need - 1]


def median(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


# -- the vLLM worker (runs in .venv-vllm) ------------------------------------------------------------------------

def vllm_worker(job: Job) -> None:
    """Stock vLLM, or the plugin at each budget on one engine: warm-up, N at once, then K alone."""
    setup = Setup(**job.setup)
    timing = Path(job.out).with_suffix(".timing.jsonl")
    timing.write_text("")
    os.environ["ARR_COC_VLLM_TIMING"] = str(timing)     # before vLLM spawns its engine: the worker inherits it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm.auto import tqdm
    from vllm import LLM, SamplingParams

    main, ttft, warm = item_sets(setup)
    extra: dict[str, Any] = {"limit_mm_per_prompt": {"image": 1, "video": 0}}
    if not job.stock:
        extra = {"limit_mm_per_prompt": {"image": 1},
                 "hf_overrides": {"architectures": [ARCH],
                                  "arr_coc": {"layer": setup.layer, "encode": "before", "adapter": False}}}
    t0 = time.perf_counter()
    llm = LLM(model=setup.model, dtype="float32", max_model_len=setup.max_model_len, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=setup.kv_cache_bytes, disable_log_stats=False, **extra)
    load_s = time.perf_counter() - t0
    image_token = int(llm.llm_engine.model_config.hf_config.image_token_id)

    def ask(item: Any, image: Any) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": item.question}]}]

    pictures = {id(it): it.load() for it in [*main, *ttft, warm]}          # RGB PIL images, loaded before timing
    greedy, first = SamplingParams(temperature=0.0, max_tokens=job.max_tokens), SamplingParams(temperature=0.0,
                                                                                               max_tokens=1)
    rows = []
    for budget in ([None] if job.stock else job.budgets):
        kw = {} if budget is None else {"mm_processor_kwargs": {"arr_coc_budget": budget}}
        name = "stock vLLM" if budget is None else f"vLLM + ARR-COC before {pct(budget)}"
        llm.chat(ask(warm, pictures[id(warm)]), first, use_tqdm=False, **kw)          # warm-up
        mark = _lines(timing)
        messages = [ask(it, pictures[id(it)]) for it in main]
        t0 = time.perf_counter()
        outs = llm.chat(messages, greedy, use_tqdm=lambda *it, **a: tqdm(*it, **{**a, "desc": f"{setup.name}: {name}"}), **kw)
        wall = time.perf_counter() - t0
        calls = _timing_calls(timing, mark)
        alone, alone_engine, alone_calls = [], [], []
        for it in tqdm(ttft, desc=f"{setup.name}: {name}, first token alone", unit="req"):
            mark = _lines(timing)
            t0 = time.perf_counter()
            out = llm.chat(ask(it, pictures[id(it)]), first, use_tqdm=False, **kw)[0]
            alone.append(time.perf_counter() - t0)
            alone_engine.append(_first_token_latency(out))
            alone_calls.append(sum(c["choose_s"] for c in _timing_calls(timing, mark)))
        answers = [o.outputs[0].text.strip() for o in outs]
        rows.append({
            "row": name, "path": "vllm", "budget": budget, "n": len(main), "wall_s": wall,
            "throughput_rps": len(main) / wall, "per_item_s": wall / len(main),
            "ttft_s": median(alone), "ttft_s_all": alone,
            "ttft_engine_s": median([x for x in alone_engine if x is not None]),
            "batch_first_token_latency_s_median": median([x for x in map(_first_token_latency, outs)
                                                          if x is not None]),
            "prompt_tokens": mean([len(o.prompt_token_ids) for o in outs]),
            "visual_tokens": mean([list(o.prompt_token_ids).count(image_token) for o in outs]),
            "accuracy": _accuracy(answers, main) if setup.trained else None, "answers": answers,
            "choose_s": sum(c["choose_s"] for c in calls) if not job.stock else None,
            "tower_s": sum(c["tower_s"] for c in calls) if not job.stock else None,
            "encoder_calls": len(calls), "images_per_encoder_call": mean([c["images"] for c in calls]),
            "arr_coc_time_share": sum(c["choose_s"] for c in calls) / wall if not job.stock else None,
            "arr_coc_time_share_alone": (sum(alone_calls) / sum(alone)) if alone and not job.stock else None,
        })
    cfg = llm.llm_engine.vllm_config
    info = {"load_s": load_s, "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "prefix_caching": cfg.cache_config.enable_prefix_caching,
            "kv_cache_memory_bytes": setup.kv_cache_bytes, "threads_env": _thread_env()}
    Path(job.out).write_text(json.dumps({"rows": rows, "engine": info}))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _timing_calls(path: Path, start: int) -> list[dict[str, Any]]:
    """The plugin's timing lines written since line `start` (one per encoder call)."""
    return [json.loads(line) for line in path.read_text().splitlines()[start:] if line.strip()]


def _first_token_latency(out: Any) -> float | None:
    """vLLM's own per-request time to first token (engine metrics; None where it kept none)."""
    m = getattr(out, "metrics", None)
    x = getattr(m, "first_token_latency", None)
    return float(x) if x else None


def _thread_env() -> dict[str, str]:
    keys = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
    return {k: os.environ[k] for k in keys if k in os.environ}


def _accuracy(answers: list[str], items: list[Any]) -> float:
    from arr_coc.data import score_record

    return mean([float(score_record(a, it.record)) for a, it in zip(answers, items)])


def pct(budget: str | float) -> str:
    return f"{100 * float(budget):g}%"


# -- the Hugging Face worker (runs in .venv) ---------------------------------------------------------------------

def hf_worker(job: Job) -> None:
    """The project's path: every token, then each budget (before the tower, exact); then FLOPs off the clock."""
    import torch
    from tqdm.auto import tqdm

    from arr_coc import ARRCOC

    setup = Setup(**job.setup)
    main, ttft, warm = item_sets(setup)
    t0 = time.perf_counter()
    vlm = ARRCOC.from_pretrained(setup.model, arr_coc=setup.layer, adapter=False)
    _ = vlm.layer                                           # built now, not inside the first timed request
    load_s = time.perf_counter() - t0
    pictures = {id(it): it.load() for it in [*main, *ttft, warm]}
    rows = []
    for budget in [None, *job.budgets]:
        how = dict(method="none", encode="after") if budget is None else \
            dict(method="arr_coc", budget=float(budget), budget_mode="exact", encode="before")
        name = "HF, every token" if budget is None else f"HF + ARR-COC before {pct(budget)}"
        vlm.generate(pictures[id(warm)], warm.question, max_new_tokens=1, **how)      # warm-up
        answers, traces, select_s, vision_s = [], [], 0.0, 0.0
        batches = [main[i:i + setup.hf_batch] for i in range(0, len(main), setup.hf_batch)]
        t0 = time.perf_counter()
        for batch in tqdm(batches, desc=f"{setup.name}: {name} (batches of {setup.hf_batch})", unit="batch"):
            got, trs = vlm.generate([pictures[id(it)] for it in batch], [it.question for it in batch],
                                    max_new_tokens=job.max_tokens, **how)
            answers += [a.strip() for a in got]
            traces += trs
            select_s += trs[0].select_s                       # a trace's times are its batch's
            vision_s += trs[0].vision_s
        wall = time.perf_counter() - t0
        alone, alone_select = [], []
        for it in tqdm(ttft, desc=f"{setup.name}: {name}, first token alone", unit="req"):
            t0 = time.perf_counter()
            _, tr = vlm.generate(pictures[id(it)], it.question, max_new_tokens=1, **how)
            alone.append(time.perf_counter() - t0)
            alone_select.append(tr.select_s)
        rows.append({
            "row": name, "path": "hf", "budget": budget, "n": len(main), "wall_s": wall,
            "throughput_rps": len(main) / wall, "per_item_s": wall / len(main), "hf_batch": setup.hf_batch,
            "ttft_s": median(alone), "ttft_s_all": alone,
            "prompt_tokens": mean([tr.prompt_tokens for tr in traces]),
            "visual_tokens": mean([tr.kept_tokens for tr in traces]),
            "accuracy": _accuracy(answers, main) if setup.trained else None, "answers": answers,
            "choose_s": select_s if budget is not None else None, "tower_s": vision_s,
            "arr_coc_time_share": select_s / wall if budget is not None else None,
            "arr_coc_time_share_alone": sum(alone_select) / sum(alone) if alone and budget is not None else None,
        })
    flops = hf_flops(vlm, main[:job.flop_items], job.budgets)
    Path(job.out).write_text(json.dumps({"rows": rows, "flops": flops, "load_s": load_s,
                                         "torch_threads": torch.get_num_threads(), "torch": torch.__version__}))


def hf_flops(vlm: Any, items: list[Any], budgets: list[str]) -> dict[str, dict[str, float]]:
    """Per row ("none" or the budget): mean FLOPs per item of the tower, the selector and the LM prefill, counted by
    the evaluation (`arr_coc.evaluation.cost`) on `items`, off the clock."""
    from arr_coc.encode import EncodeConfig
    from arr_coc.evaluation.loop import evaluate

    got = evaluate(vlm, items, ["none", "arr_coc"], [float(b) for b in budgets], batch_size=len(items),
                   max_new_tokens=1, budget_mode="exact", encode=EncodeConfig("before"), progress=False)
    out = {}
    for r in got["results"]:
        selector = r["selector_flops_mean"] or 0.0
        key = "none" if r["method"] == "none" else str(r["budget"])
        out[key] = {"vision": r["vision_flops_mean"], "selector": selector,
                    "lm": r["prefill_flops_mean"] - selector, "e2e": r["e2e_flops_mean"],
                    "visual_tokens": r["kept_tokens_mean"], "items": r["n"]}
    return out


# -- the 2B-widths model folder (runs in .venv) -------------------------------------------------------------------

def build_worker(job: Job) -> None:
    """The preset's model with random weights (seed), saved once: config, safetensors, tokenizer, processor."""
    import torch

    from arr_coc.evaluation.bench_presets import build_model, get_preset, label, run_layers
    from arr_coc.runtime import Runtime

    b = job.build
    spec = get_preset(b["preset"])
    v, t = run_layers(spec, b["vision_layers"], b["lm_layers"])
    torch.manual_seed(b["seed"])
    model, processor, summary = build_model(spec, v, t, Runtime.resolve("cpu", "float32"), b["seed"])
    folder = Path(job.out)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    (folder / "bench_model.json").write_text(json.dumps({**b, "label": label(spec, v, t), "summary": summary}))


# -- the orchestrator ----------------------------------------------------------------------------------------------

VLLM_CORES = {"all": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}, "auto": {}}


@dataclass
class Runner:
    """Runs the workers one after the other, each in its own process, and keeps their commands for the report."""

    work: Path
    vllm_cores: str = "all"
    commands: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        """This checkout first on the path (both environments hold the project installed editable from elsewhere:
        the plugin's entry point resolves by import, so vLLM's processes load this checkout's plugin); vLLM's
        cores (`--vllm-cores`)."""
        env = dict(os.environ, HF_HUB_OFFLINE="1", **VLLM_CORES[self.vllm_cores])
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return env

    def job(self, job: Job, python: Path, what: str) -> dict[str, Any]:
        """One worker process (its output shown as it runs) -> its JSON."""
        spec = self.work / "jobs" / f"{Path(job.out).stem}.job.json"
        spec.parent.mkdir(exist_ok=True)
        spec.write_text(json.dumps(asdict(job)))
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", str(spec)]
        self.commands.append(shlex.join(cmd))
        print(f"\n== {what} ({python.parent.parent.name}) ==", flush=True)
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=self.env())
        if done.returncode != 0:
            raise SystemExit(f"{what}: the worker failed (exit {done.returncode}): {shlex.join(cmd)}")
        print(f"== {what}: {time.perf_counter() - t0:.0f} s ==", flush=True)
        return json.loads(Path(job.out).read_text()) if job.kind != "build" else {}

    def gen_data(self, out: Path, n: int, canvas: str | None) -> str:
        """`python -m arr_coc_shapes gen-data --split test --seed 0` (reused when already there with exactly n items:
        items are seeded by index, so the first N are `gen-data --n N`'s)."""
        items = out / "test.jsonl"
        if items.exists() and len(items.read_text().splitlines()) == n:
            return str(items)
        cmd = [str(PROJECT_PY), "-m", "arr_coc_shapes", "gen-data", "--out", str(out), "--split", "test", "--n", str(n),
               "--seed", "0"] + (["--canvas", canvas] if canvas else [])
        self.commands.append(shlex.join(cmd))
        subprocess.run(cmd, cwd=ROOT, env=self.env(), check=True)
        return str(items)

    def model_folder(self, vision_layers: int, lm_layers: int) -> tuple[str, str]:
        """(the 2B-widths folder, its depth label), built once per (preset, depth, seed) and reused."""
        b = {"preset": PRESET, "vision_layers": vision_layers, "lm_layers": lm_layers, "seed": 0}
        folder = self.work / f"{PRESET}-v{vision_layers}-l{lm_layers}-seed0"
        done = folder / "bench_model.json"
        if not done.exists():
            self.job(Job("build", {}, str(folder), build=b), PROJECT_PY, f"build {folder.name} (random weights, once)")
        return str(folder), json.loads(done.read_text())["label"]


def kv_bytes(n: int, tokens: int, layers: int, kv_heads: int, head_dim: int) -> int:
    """float32 K and V of `n` requests of `tokens` each (+25%), at least 256 MiB."""
    need = int(1.25 * n * tokens * layers * 2 * kv_heads * head_dim * 4)
    return max(256 * MiB, -(-need // MiB) * MiB)


def setups(args: argparse.Namespace, runner: Runner) -> list[Setup]:
    out = []
    for name in args.setups.split(","):
        if name == "shapes":
            n, k = args.n_shapes, args.ttft_k_shapes
            items = runner.gen_data(runner.work / "data-shapes", n + k + 1, None)
            out.append(Setup("shapes", "embedded model (shapes-qwen2vl, 448x448, 256 visual tokens), layer "
                             "arr-coc-shapes-before, adapter off", SHAPES_MODEL, SHAPES_LAYER, items, n, k,
                             args.hf_batch_shapes, kv_bytes(n, 320, 4, 2, 32), 2048, True))
        elif name == "2b":
            n, k = args.n_2b, args.ttft_k_2b
            items = runner.gen_data(runner.work / "data-896", n + k + 1, "896x896")
            folder, depth = runner.model_folder(args.vision_layers, args.lm_layers)
            out.append(Setup("2b", f"Qwen2-VL-2B widths ({depth}), random weights, 896x896 (1,024 visual tokens), "
                             "untrained layer", folder, None, items, n, k, args.hf_batch_2b,
                             kv_bytes(n, 1100, args.lm_layers, 2, 128), 2048, False))
        else:
            raise SystemExit(f"--setups takes shapes and/or 2b, got {name!r}")
    return out


def run_setup(setup: Setup, args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    """Stock vLLM, the plugin, then the HF path: one process each, one after the other."""
    budgets = args.budgets.split(",")
    base = dict(setup=asdict(setup), max_tokens=args.max_tokens)
    out = runner.work / setup.name
    stock = runner.job(Job("vllm", out=f"{out}-stock.json", stock=True, **base), VLLM_PY, f"{setup.name}: stock vLLM")
    plugin = runner.job(Job("vllm", out=f"{out}-plugin.json", budgets=budgets, **base), VLLM_PY,
                        f"{setup.name}: vLLM + ARR-COC before the tower at {args.budgets}")
    hf = runner.job(Job("hf", out=f"{out}-hf.json", budgets=budgets, flop_items=args.flop_items, **base),
                    PROJECT_PY if args.hf_env == "project" else VLLM_PY,
                    f"{setup.name}: the Hugging Face path, every token and {args.budgets}")
    rows = stock["rows"] + plugin["rows"] + hf["rows"]
    for r in rows:
        f = hf["flops"].get("none" if r["budget"] is None else str(float(r["budget"])))
        r["flops"] = f
        r["arr_coc_flop_share"] = None if f is None or r["budget"] is None else f["selector"] / f["e2e"]
    return {"setup": asdict(setup), "rows": rows, "ratios": ratios(rows, budgets),
            "engines": {"stock": stock["engine"], "plugin": plugin["engine"]},
            "hf": {k: hf[k] for k in ("load_s", "torch_threads", "torch")}}


def ratios(rows: list[dict[str, Any]], budgets: list[str]) -> dict[str, Any]:
    """ARR-COC at the largest budget over stock (vLLM) and over every token (HF): throughput and TTFT."""
    top = max(budgets, key=float)
    by = {(r["path"], r["budget"]): r for r in rows}
    out = {"budget": top}
    for path in ("vllm", "hf"):
        a, s = by.get((path, top)), by.get((path, None))
        if a and s:
            out[path] = {"throughput": a["throughput_rps"] / s["throughput_rps"], "ttft": a["ttft_s"] / s["ttft_s"]}
    v, h = by.get(("vllm", None)), by.get(("hf", None))
    if v and h:
        out["stock_vllm_over_hf_every_token"] = {"throughput": v["throughput_rps"] / h["throughput_rps"],
                                                 "ttft": v["ttft_s"] / h["ttft_s"]}
    return out


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def gflops(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}" if x < 1e11 else f"{x / 1e9:.0f}"


def markdown(report: dict[str, Any]) -> str:
    """One table per setup, its ratios, and how the engines ran."""
    a = report["args"]
    lines = [f"`{report['command']}`", ""]
    for s in report["setups"]:
        st, r0, eng = s["setup"], s["ratios"], s["engines"]
        calls = [r["images_per_encoder_call"] for r in s["rows"] if r.get("images_per_encoder_call")]
        lines += [f"### {st['label']}", "",
                  f"N = {st['n']} items answered (requests/s, accuracy; greedy, {a['max_tokens']} new tokens at "
                  f"most): vLLM all at once, HF in batches of {st['hf_batch']}. TTFT: {st['ttft_k']} other items, "
                  "each sent alone with max_tokens=1, median wall time of the call. ARR-COC time share: seconds "
                  "inside the choice over the N-item run's wall time. FLOPs: the project's accounting (HF path, "
                  f"{a['flop_items']} item(s); the vLLM rows keep the same cells).", "",
                  "| row | requests/s | TTFT ms | prompt tokens | visual tokens | accuracy | ARR-COC time share | "
                  "ARR-COC FLOP share | GFLOPs / item |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            f = r.get("flops") or {}
            lines.append(
                f"| {r['row']} | {r['throughput_rps']:.2f} | {fmt(r['ttft_s'] and 1e3 * r['ttft_s'], '.0f')} | "
                f"{r['prompt_tokens']:.0f} | {r['visual_tokens']:.0f} | {fmt(r['accuracy'], '.3f')} | "
                f"{share(r['arr_coc_time_share'], '.1f')} | {share(r['arr_coc_flop_share'], '.2f')} | "
                f"{gflops(f.get('e2e'))} |")
        top = pct(r0["budget"])
        parts = [f"vLLM: ARR-COC {top} / stock: throughput x{r0['vllm']['throughput']:.2f}, TTFT "
                 f"x{r0['vllm']['ttft']:.2f}" if "vllm" in r0 else "",
                 f"HF: ARR-COC {top} / every token: throughput x{r0['hf']['throughput']:.2f}, TTFT "
                 f"x{r0['hf']['ttft']:.2f}" if "hf" in r0 else "",
                 "stock vLLM / HF every token: throughput x{throughput:.2f}, TTFT x{ttft:.2f}".format(
                     **r0["stock_vllm_over_hf_every_token"]) if "stock_vllm_over_hf_every_token" in r0 else "",
                 f"vLLM: model on {'every core' if a['vllm_cores'] == 'all' else 'vLLM default cores'} "
                 f"({eng['plugin']['threads_env'] or 'no overrides'}), max_num_batched_tokens "
                 f"{eng['plugin']['max_num_batched_tokens']}, prefix caching {eng['plugin']['prefix_caching']}, "
                 f"load {eng['stock']['load_s']:.0f} s (stock) / {eng['plugin']['load_s']:.0f} s (plugin); the "
                 f"plugin's choice ran on {fmt(mean(calls), '.2f')} image(s) per encoder call in the N-item runs; "
                 f"HF: torch {s['hf']['torch']}, {s['hf']['torch_threads']} threads, load {s['hf']['load_s']:.0f} s"]
        lines += [""] + [f"- {p}" for p in parts if p] + [""]
    h = report["host"]
    lines.append(f"Host: {h['cpus']} CPUs, load average {[round(x, 2) for x in h['load_average_start']]} at start, "
                 f"{[round(x, 2) for x in h['load_average_end']]} at end; {h['wall_s']:.0f} s in all.")
    return "\n".join(lines) + "\n"


def share(x: float | None, spec: str) -> str:
    return "-" if x is None else f"{100 * x:{spec}}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--setups", default="shapes,2b", help="comma list of shapes, 2b (default both)")
    ap.add_argument("--budgets", default="0.03,0.05,0.1", help="ARR-COC's shares (default 0.03,0.05,0.1)")
    ap.add_argument("--n-shapes", type=int, default=200, help="items answered, embedded model (default 200)")
    ap.add_argument("--n-2b", type=int, default=20, help="items answered, 2B widths (default 20; at least 20 for "
                                                         "the report, fewer for a smoke)")
    ap.add_argument("--ttft-k-shapes", type=int, default=20, help="items sent alone for time to first token, "
                                                                  "embedded model (default 20)")
    ap.add_argument("--ttft-k-2b", type=int, default=3, help="items sent alone for time to first token, 2B widths "
                                                             "(default 3)")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens at most per answer (default 16)")
    ap.add_argument("--hf-batch-shapes", type=int, default=8, help="HF batch size, embedded model (default 8)")
    ap.add_argument("--hf-batch-2b", type=int, default=4, help="HF batch size, 2B widths (default 4)")
    ap.add_argument("--hf-env", choices=["project", "vllm"], default="project",
                    help="where the HF rows run: the project's .venv (default) or .venv-vllm")
    ap.add_argument("--vllm-cores", choices=list(VLLM_CORES), default="all",
                    help="all (default): vLLM's worker runs the model on every core, as the HF path's torch does "
                         "(VLLM_CPU_NUM_OF_RESERVED_CPU=0); auto: vLLM's default, which on x86 keeps one core for "
                         "its scheduler process (on 2 cores: the model on 1)")
    ap.add_argument("--flop-items", type=int, default=1,
                    help="items the FLOPs are counted on (default 1: a setup's items share one grid, so only the "
                         "question's few tokens differ)")
    ap.add_argument("--vision-layers", type=int, default=32, help="2B widths: vision blocks (default 32: full)")
    ap.add_argument("--lm-layers", type=int, default=28, help="2B widths: LM layers (default 28: full)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "vllm_bench",
                    help="items, the 2B model folder, the rows' JSON (default runs/vllm_bench)")
    ap.add_argument("--out", type=Path, default=None, help="the report's JSON (default WORK/report.json)")
    ap.add_argument("--md", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    if args.worker:
        job = Job(**json.loads(Path(args.worker).read_text()))
        {"vllm": vllm_worker, "hf": hf_worker, "build": build_worker}[job.kind](job)
        return
    for py in (PROJECT_PY, VLLM_PY):
        if not py.exists():
            raise SystemExit(f"no {py}: the run needs the project's .venv and .venv-vllm (make vllm-env)")
    runner = Runner(args.work.resolve(), args.vllm_cores)
    runner.work.mkdir(parents=True, exist_ok=True)
    for path in (args.out, args.md):   # made now: a missing folder must not lose a finished run at its end
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    load_start, t_start = os.getloadavg(), time.perf_counter()
    results = [run_setup(s, args, runner) for s in setups(args, runner)]
    report = {"command": shlex.join([sys.executable, *sys.argv]), "worker_commands": runner.commands,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "setups": results,
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_average_start": load_start,
                       "load_average_end": os.getloadavg(), "wall_s": time.perf_counter() - t_start}}
    out = args.out or runner.work / "report.json"
    out.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    if args.md:
        args.md.write_text(table)
    print(table)
    print(f"wrote {out}" + (f" and {args.md}" if args.md else ""))


if __name__ == "__main__":
    main()
