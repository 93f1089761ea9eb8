"""Clips: stock vLLM, vLLM's EVS and vLLM + ARR-COC before the tower, side by side in ONE run (docs/SERVING.md,
"Clips, measured").

Run it ALONE on the machine (it times things), from the repository root:

    .venv/bin/python scripts/vllm_clip_bench.py --out runs/clip_bench/report.json --md runs/clip_bench/report.md

Every row is one engine (`scripts/vllm_requests.py` in .venv-vllm, one process each, one after the other) answering
the setup's N clips submitted at once (requests/s = N / that wall time), then K other clips sent alone with one new
token each (time to first token: the median of those K wall times); visual tokens are the prompt's pads. No measured
clip repeats one another request of its row used (vLLM's caches never answer a measured request).

Setups:
- shapes: the embedded clip model (checkpoints/shapes-qwen2vl-video, Qwen2-VL) and its shipped before-layer, on
  generated ShapesVQA-video test clips (448 px, the standard split's lengths); accuracy is real. vLLM's EVS serves
  Qwen2.5-VL and Qwen3-VL only (qwen2_vl.py has no video pruning), so here the project's own `evs` selector (vLLM's
  rule: what changed since the previous frame group, after the tower) answers through the Hugging Face path at the
  same kept counts as ARR-COC, beside the Hugging Face path's ARR-COC (accuracy only: the HF path's time is not
  vLLM's).
- wide: Qwen2.5-VL-3B widths (the `qwen2.5-vl-3b` bench preset), random weights (seed 0), at --vision-layers /
  --lm-layers of the full depth (labelled so), the untrained layer, clips of 8 and 16 frames at 448 px; vLLM's EVS
  (`--video-pruning-rate`) at the rates whose kept tokens come closest to ARR-COC's (EVS keeps at least one whole
  frame group: below that it keeps that floor). The tower's and the choice's shares of an ARR-COC row's wall time
  come from the plugin's $ARR_COC_VLLM_TIMING lines. Accuracy means nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROJECT_PY = ROOT / ".venv" / "bin" / "python"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
CLIP_MODEL, CLIP_LAYER = "checkpoints/shapes-qwen2vl-video", "checkpoints/arr-coc-shapes-before"
WIDE_PRESET = "qwen2.5-vl-3b"


def write_clips(folder: Path, first: int, n: int, canvas: str | None, lengths: tuple[int, ...] | None) -> list[dict]:
    """Test clips `first`..`first + n - 1` as .npy frames, with their question and record."""
    import numpy as np

    from arr_coc_shapes.video import make_clip_item
    from arr_coc_shapes.video.spec import options

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(first, first + n):
        frames, rec, _ = make_clip_item(0, "test", i, canvas or "448x448", options(lengths=lengths) if lengths else None)
        path = folder / f"{rec['id']}.npy"
        if not path.exists():
            np.save(path, frames)
        out.append({"path": str(path), "record": {k: rec[k] for k in ("id", "question", "answers", "qtype")}})
    return out


def requests(clips: list[dict], ttft: list[dict], budget: Any) -> list[dict]:
    def one(c: dict, name: str, **more: Any) -> dict:
        return {"name": name, "images": [], "clips": [c["path"]], "budget": budget, **more,
                "messages": [{"role": "user", "content": [{"type": "video"},
                                                          {"type": "text", "text": c["record"]["question"]}]}]}
    return [one(c, c["record"]["id"]) for c in clips] + [one(c, "ttft-" + c["record"]["id"], ttft=True) for c in ttft]


def run_row(name: str, model: str, reqs: list[dict], work: Path, *flags: str, commands: list[str]) -> dict[str, Any]:
    """One engine on the requests -> its row: requests/s, TTFT, visual tokens, answers, the plugin's timing."""
    rows = work / name
    rows.mkdir(parents=True, exist_ok=True)
    (rows / "reqs.json").write_text(json.dumps(reqs))
    timing = rows / "timing.jsonl"
    timing.unlink(missing_ok=True)
    cmd = [str(VLLM_PY), "scripts/vllm_requests.py", "--model", model, "--requests", str(rows / "reqs.json"),
           "--out", str(rows / "got.json"), "--max-model-len", "4096", *flags]
    commands.append(shlex.join(cmd))
    print(f"== {name} ==", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ARR_COC_VLLM_TIMING": str(timing),
           "PYTHONPATH": str(ROOT), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {done.stderr[-3000:]}")
    got = json.loads((rows / "got.json").read_text())
    answered = [r for r in got["requests"] if not r.get("ttft_s")]
    seconds = next(v for k, v in got["seconds"].items() if k.startswith("batch "))
    calls = [json.loads(line) for line in timing.read_text().splitlines()] if timing.exists() else []
    return {"row": name, "n": len(answered), "throughput_rps": len(answered) / seconds, "wall_s": seconds,
            "ttft_s": statistics.median([r["ttft_s"] for r in got["requests"] if r.get("ttft_s")]),
            "visual_tokens": statistics.mean(r["visual_tokens"] for r in answered),
            "answers": {r["name"]: r["answer"] for r in answered},
            "choose_s": sum(c["choose_s"] for c in calls), "tower_s": sum(c["tower_s"] for c in calls)}


def scores(row: dict[str, Any], clips: list[dict]) -> list[float]:
    """Per clip, in the clips' order, whether the row's answer is right (1.0 / 0.0)."""
    from arr_coc.data.metrics import score_record

    return [float(score_record(row["answers"][c["record"]["id"]], c["record"])) for c in clips]


def paired(rows: list[dict[str, Any]], budgets: list[str]) -> list[dict[str, Any]]:
    """The shapes setup's paired differences over the same clips (the project's one paired interval,
    `evaluation.report.paired_stats`): at each budget ARR-COC against the `evs` selector at equal kept counts (the
    Hugging Face path both), and vLLM + ARR-COC against stock vLLM's every token."""
    from arr_coc.evaluation.report import paired_stats

    by = {r["row"]: r["scores"] for r in rows}
    out = []
    for b in budgets:
        for a, ref in ((f"HF arr_coc {pct(b)}", f"HF evs {pct(b)}"), (f"arr_coc {pct(b)}", "stock")):
            out.append({"row": a, "against": ref, **paired_stats(by[a], by[ref])})
    return out


def hf_rows(clips: list[dict], budgets: list[str], work: Path, commands: list[str]) -> list[dict[str, Any]]:
    """The Hugging Face path on the shapes clips: `evs` after the tower and ARR-COC before it, each budget met
    exactly (equal kept counts): accuracy and kept tokens (its own process, the project's environment)."""
    spec = work / "hf.json"
    spec.write_text(json.dumps({"clips": clips, "budgets": budgets}))
    cmd = [str(PROJECT_PY), str(Path(__file__).resolve()), "--hf-worker", str(spec)]
    commands.append(shlex.join(cmd))
    print("== the Hugging Face path (evs, arr_coc) ==", flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
    return json.loads((work / "hf.out.json").read_text())


def hf_worker(spec: Path) -> None:
    import numpy as np

    from arr_coc import ARRCOC
    from arr_coc.budget import parse_budget
    from arr_coc.data.metrics import score_record
    from arr_coc.pipeline.request import Pruning
    from arr_coc.video import load_clip

    job = json.loads(spec.read_text())
    vlm = ARRCOC.from_pretrained(CLIP_MODEL, arr_coc=CLIP_LAYER, adapter=False)
    rows = []
    for method, encode in (("evs", "after"), ("arr_coc", "before")):
        for budget in job["budgets"]:
            right, kept = [], []
            for s in range(0, len(job["clips"]), 8):
                batch = job["clips"][s:s + 8]
                got = vlm.respond([[load_clip(np.load(c["path"]))] for c in batch],
                                  [c["record"]["question"] for c in batch],
                                  Pruning.of(method, parse_budget(budget), "exact", encode), max_new_tokens=16)
                right += [float(score_record(a, c["record"])) for a, c in zip(got.answers, batch)]
                kept += [sum(int(k.numel()) for k in tr.kept_indices) for tr in got.traces]
            rows.append({"row": f"HF {method} {pct(budget)}", "accuracy": statistics.mean(right),
                         "visual_tokens": statistics.mean(kept), "n": len(right), "scores": right})
    spec.with_name("hf.out.json").write_text(json.dumps(rows))


def pct(budget: str) -> str:
    return f"{float(budget) * 100:g}%"


def build_wide(folder: Path, vision_layers: int, lm_layers: int, commands: list[str]) -> str:
    """The wide model's folder (random weights, seed 0), built once: weights, config, tokenizer, processors."""
    if (folder / "config.json").exists():
        return json.loads((folder / "bench_model.json").read_text())["label"]
    code = ("import json, sys, torch; from arr_coc.evaluation.bench_presets import build_model, get_preset, label, "
            "run_layers; from arr_coc.runtime import Runtime; s = get_preset(sys.argv[1]); "
            "v, t = run_layers(s, int(sys.argv[2]), int(sys.argv[3])); torch.manual_seed(0); "
            "m, p, _ = build_model(s, v, t, Runtime.resolve('cpu', 'float32'), 0); m.save_pretrained(sys.argv[4]); "
            "p.save_pretrained(sys.argv[4]); open(sys.argv[4] + '/bench_model.json', 'w').write("
            "json.dumps({'label': label(s, v, t)}))")
    cmd = [str(PROJECT_PY), "-c", code, WIDE_PRESET, str(vision_layers), str(lm_layers), str(folder)]
    commands.append(shlex.join(cmd))
    subprocess.run(cmd, cwd=ROOT, check=True)
    return json.loads((folder / "bench_model.json").read_text())["label"]


def evs_rate(share: float, groups: int) -> float:
    """vLLM's pruning rate q whose kept tokens (max(one group, int(total * (1 - q))), evs.py:16-35) come closest to
    a share of the clip's tokens: 1 - share, EVS's floor of one whole group where the share asks for less."""
    return round(1.0 - max(share, 1.0 / groups), 6)


def shapes_setup(args: argparse.Namespace, work: Path, commands: list[str]) -> dict[str, Any]:
    clips = write_clips(work / "clips", 0, args.n_shapes, None, None)
    ttft = write_clips(work / "clips", args.n_shapes, args.ttft_k, None, None)
    rows = [run_row("stock", CLIP_MODEL, requests(clips, ttft, None), work / "shapes", "--stock", commands=commands)]
    for b in args.budgets.split(","):
        rows.append(run_row(f"arr_coc {pct(b)}", CLIP_MODEL, requests(clips, ttft, b), work / "shapes", "--layer",
                            CLIP_LAYER, "--encode", "before", commands=commands))
    for r in rows:
        r["scores"] = scores(r, clips)
        r["accuracy"] = statistics.mean(r["scores"])
        r.pop("answers")
    hf = hf_rows(clips, args.budgets.split(","), work / "shapes", commands)
    return {"setup": "shapes", "label": "embedded clip model (Qwen2-VL, 192-d)", "rows": rows + hf,
            "paired": paired(rows + hf, args.budgets.split(","))}


def wide_setup(args: argparse.Namespace, work: Path, frames: int, commands: list[str]) -> dict[str, Any]:
    model = work / f"{WIDE_PRESET}-v{args.vision_layers}-l{args.lm_layers}-seed0"
    label = build_wide(model, args.vision_layers, args.lm_layers, commands)
    clips = write_clips(work / f"clips{frames}", 0, args.n_wide, "448x448", (frames,))
    ttft = write_clips(work / f"clips{frames}", args.n_wide, args.ttft_k_wide, "448x448", (frames,))
    where = work / f"wide{frames}"
    rows = [run_row("stock", str(model), requests(clips, ttft, None), where, "--stock", commands=commands)]
    groups = frames // 2
    for b in args.budgets.split(","):
        q = evs_rate(float(b), groups)
        rows.append(run_row(f"EVS q={q:g} (~{pct(b)})", str(model), requests(clips, ttft, None), where, "--stock",
                            "--video-pruning-rate", str(q), commands=commands))
    for b in args.budgets.split(","):
        rows.append(run_row(f"arr_coc {pct(b)}", str(model), requests(clips, ttft, b), where, "--layer",
                            "untrained", "--encode", "before", commands=commands))
    for r in rows:
        r.pop("answers")
    return {"setup": f"wide-{frames}", "label": f"Qwen2.5-VL-3B widths, random weights: {label}, {frames} frames at 448 px",
            "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    out = []
    for s in report["setups"]:
        stock = next(r for r in s["rows"] if r["row"] == "stock")
        out += [f"**{s['label']}**", "", "| row | requests/s | x stock | TTFT s | visual tokens | accuracy | "
                "ARR-COC share | tower share |", "|---|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            rps = r.get("throughput_rps")
            shares = [f"{r[k] / r['wall_s']:.0%}" if r.get(k) and rps else "-" for k in ("choose_s", "tower_s")]
            out.append(f"| {r['row']} | {fmt(rps, '.2f')} | {fmt(rps and rps / stock['throughput_rps'], '.2f')} | "
                       f"{fmt(r.get('ttft_s'), '.3f')} | {r['visual_tokens']:.0f} | {fmt(r.get('accuracy'), '.3f')} | "
                       f"{shares[0]} | {shares[1]} |")
        out.append("")
        if s.get("paired"):
            out += ["Paired over the same clips (difference in accuracy, 95% interval, wins / losses):", "",
                    "| row | against | difference | 95% interval | wins / losses |", "|---|---|---|---|---|"]
            out += [f"| {p['row']} | {p['against']} | {p['diff']:+.3f} | [{p['low']:+.3f}, {p['high']:+.3f}] | "
                    f"{p['wins']} / {p['losses']} |" for p in s["paired"]]
            out.append("")
    return "\n".join(out)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--setups", default="shapes,wide", help="comma list of shapes, wide (default both)")
    ap.add_argument("--budgets", default="0.03,0.05,0.1", help="ARR-COC's shares of a clip (default 0.03,0.05,0.1)")
    ap.add_argument("--n-shapes", type=int, default=200, help="clips answered, embedded clip model (default 200)")
    ap.add_argument("--ttft-k", type=int, default=10, help="clips sent alone for TTFT, embedded (default 10)")
    ap.add_argument("--n-wide", type=int, default=8, help="clips answered per frame count, wide model (default 8)")
    ap.add_argument("--ttft-k-wide", type=int, default=3, help="clips sent alone for TTFT, wide (default 3)")
    ap.add_argument("--frames", default="8,16", help="wide model: frames per clip (default 8,16)")
    ap.add_argument("--vision-layers", type=int, default=4, help="wide: vision blocks of 32 (default 4)")
    ap.add_argument("--lm-layers", type=int, default=4, help="wide: LM layers of 36 (default 4)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "clip_bench")
    ap.add_argument("--out", type=Path, default=None, help="the report's JSON (default WORK/report.json)")
    ap.add_argument("--md", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    sys.path.insert(0, str(ROOT))
    commands: list[str] = []
    setups = []
    for name in args.setups.split(","):
        if name == "shapes":
            setups.append(shapes_setup(args, args.work, commands))
        elif name == "wide":
            setups += [wide_setup(args, args.work, int(f), commands) for f in args.frames.split(",")]
        else:
            raise SystemExit(f"unknown setup {name!r}: shapes, wide")
    report = {"setups": setups, "commands": commands, "argv": sys.argv}
    out = args.out or args.work / "report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    if args.md:
        args.md.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
