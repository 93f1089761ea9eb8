"""Requests as deployments send them, through the plugin offline (`LLM.chat` / `LLM.generate`), one engine.

Run in the vLLM environment (`make vllm-env`); tests/test_vllm_deployments.py writes the requests and runs it:
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python scripts/vllm_requests.py --requests reqs.json --out got.json \\
        --dtype bfloat16 --layer checkpoints/arr-coc-shapes-before --encode before

The requests file is a list of {"name", "images": [paths], optional "clips": [.npy files of uint8 frames
[N, H, W, 3], shown at 2 frames per second], "budget": a budget or null (the server's), and one of "messages" (a
chat: OpenAI's shape, an image part {"type": "image"} for each image path and a {"type": "video"} part for each clip,
in order; a chat with a clip is rendered with the checkpoint's chat template and sent as a prompt), "prompt" (a raw
prompt string), plus optional "mm_kwargs" (more processor kwargs: a hostile client's) and "alone" (send it by
itself, after the batches, and then a normal request: an error must be that request's only), "ttft" (send it by
itself after the batches with one new token, timed: its "ttft_s")}. Requests without
"alone" are sent together per budget, so the scheduler batches them as under load. Writes {"requests": [{"name",
"answer", "token_ids", "prompt_tokens", "margins", "kept": per image, then per clip, its kept cells (from the
plugin's trace; a clip's over its t * h * w cells) or null, "error": null or {"type", "message"}, "next_ok": whether the engine answered the next request}]}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from vllm_compare import architecture, one_process_engine


def image_keys(model: str, paths: list[str]) -> dict[str, tuple[float, tuple[int, int, int]]]:
    """Each picture's trace key (its float32 pixel rows' sum under the PIL processor) and its patch grid."""
    from PIL import Image
    from transformers import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(model, backend="pil")
    out = {}
    for p in sorted(set(paths)):
        got = ip(images=[Image.open(p).convert("RGB")], return_tensors="pt")
        out[p] = (round(float(got["pixel_values"].double().sum()), 3), tuple(got["image_grid_thw"][0].tolist()))
    return out


def clip_frames(path: str):
    import numpy as np

    return np.load(path)


def clip_item(frames, family: str):
    """A clip as vLLM takes it: its frames, with their metadata where the family's processor reads it (Qwen2.5-VL:
    `second_per_grid_ts` from the sampled fps; Qwen3-VL: each frame group's timestamp), as
    `arr_coc.video.load_clip(frames)` describes them (2 fps)."""
    if family == "qwen2_vl":
        return frames
    n = len(frames)
    return frames, {"fps": 2.0, "duration": n / 2.0, "total_num_frames": n, "frames_indices": list(range(n)),
                    "video_backend": "opencv", "do_sample_frames": False}


def clip_keys(model: str, paths: list[str]) -> dict[str, tuple[float, tuple[int, int, int]]]:
    """Each clip's trace key (its float32 patch rows' sum under the checkpoint's video processor) and grid."""
    from transformers import AutoVideoProcessor

    vp = AutoVideoProcessor.from_pretrained(model)
    out = {}
    for p in sorted(set(paths)):
        got = vp(videos=[clip_frames(p)], do_sample_frames=False, return_tensors="pt")
        out[p] = (round(float(got["pixel_values_videos"].double().sum()), 3), tuple(got["video_grid_thw"][0].tolist()))
    return out


def vllm_input(req: dict, model: str = "", family: str = "qwen2_vl") -> dict | list:
    from PIL import Image

    images = iter([Image.open(p).convert("RGB") for p in req["images"]])
    clips = [clip_item(clip_frames(p), family) for p in req.get("clips", [])]
    if "prompt" in req or clips:
        data: dict = {}
        pictures = list(images)
        if pictures:
            data["image"] = pictures[0] if len(pictures) == 1 else pictures
        if clips:
            data["video"] = clips[0] if len(clips) == 1 else clips
        return {"prompt": req["prompt"] if "prompt" in req else render(model, req["messages"]),
                "multi_modal_data": data}
    chat = []
    for m in req["messages"]:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image_pil", "image_pil": next(images)} if c["type"] == "image" else c
                       for c in content]
        chat.append({"role": m["role"], "content": content})
    return chat


def render(model: str, messages: list[dict]) -> str:
    """A chat with clips as vLLM's chat endpoint renders it: the checkpoint's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    template = (Path(model) / "chat_template.jinja").read_text()
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Requests as deployments send them, through the plugin offline.")
    ap.add_argument("--requests", type=Path, default=None)
    ap.add_argument("--items", type=Path, default=None,
                    help="or a gen-data test.jsonl: its first --n items, one chat each at every --budgets")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--budgets", default="0.05,0.1,0.25")
    ap.add_argument("--model", default="checkpoints/shapes-qwen2vl")
    ap.add_argument("--layer", default="checkpoints/arr-coc-shapes-before")
    ap.add_argument("--encode", default="before", choices=["after", "before"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--server-budget", default=None, help="the operator's default (--mm-processor-kwargs)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-batched-tokens", type=int, default=None, help="chunked prefill: tokens per step")
    ap.add_argument("--stock", action="store_true", help="stock vLLM (the checkpoint's own architecture): no ARR-COC")
    ap.add_argument("--video-pruning-rate", type=float, default=None, help="stock vLLM's EVS on clips (with --stock)")
    ap.add_argument("--tp", type=int, default=1, help="--tensor-parallel-size (CPU: VLLM_CPU_OMP_THREADS_BIND=\"0|1\")")
    ap.add_argument("--one-process", action="store_true",
                    help="the engine core and its worker in this process (no spawning: starts and stops faster)")
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args()


def engine(args: argparse.Namespace, clips: bool):
    """One offline engine as the requests' server: the plugin (or stock vLLM, or its EVS), float32 unless told."""
    from vllm import LLM

    server_kw = {} if args.server_budget is None else {"mm_processor_kwargs": {"arr_coc_budget": args.server_budget}}
    evs = {} if args.video_pruning_rate is None else {"video_pruning_rate": args.video_pruning_rate}
    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True, seed=0,
               kv_cache_memory_bytes=256 << 20, limit_mm_per_prompt={"image": 4, **({"video": 2} if clips else {})},
               max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=args.prefix_caching,
               tensor_parallel_size=args.tp,
               **server_kw, **evs, **one_process_engine(args.one_process), hf_overrides={} if args.stock else {
                   "architectures": [architecture(args.model)],
                   "arr_coc": {"layer": args.layer, "encode": args.encode, "adapter": False}})


class Sender:
    """Sends requests to one engine and keeps each one's `output` by name."""

    def __init__(self, llm, args: argparse.Namespace):
        from vllm import SamplingParams

        self.llm, self.args = llm, args
        self.greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2)
        self.first = SamplingParams(temperature=0.0, max_tokens=1)
        config = json.loads((Path(args.model) / "config.json").read_text())
        self.family = config["model_type"]
        self.pads = {int(config["image_token_id"]), int(config["video_token_id"])}
        self.results: dict[str, dict] = {}

    def send(self, batch: list[dict], kwargs: dict, params=None) -> None:
        chats = [r for r in batch if "messages" in r and not r.get("clips")]
        raws = [r for r in batch if "prompt" in r or r.get("clips")]
        mm = {"mm_processor_kwargs": kwargs} if kwargs else {}
        model, params = self.args.model, params or self.greedy
        if chats:
            said = self.llm.chat([vllm_input(r, model, self.family) for r in chats], params, use_tqdm=False, **mm)
            self.results.update({r["name"]: output(o, self.pads) for r, o in zip(chats, said)})
        if raws:
            prompts = [{**vllm_input(r, model, self.family), **mm} for r in raws]
            said = self.llm.generate(prompts, params, use_tqdm=False)
            self.results.update({r["name"]: output(o, self.pads) for r, o in zip(raws, said)})

    def budget_kwargs(self, budget) -> dict:
        return {} if budget is None or self.args.stock else {"arr_coc_budget": budget}

    def together(self, reqs: list[dict], seconds: dict[str, float]) -> None:
        """Requests without "alone" or "ttft", all of a budget at once (the scheduler batches them), timed."""
        t0 = time.perf_counter()
        for budget in sorted({json.dumps(r.get("budget")) for r in reqs}):
            t1 = time.perf_counter()
            self.send([r for r in reqs if json.dumps(r.get("budget")) == budget], self.budget_kwargs(json.loads(budget)))
            seconds[f"batch {json.loads(budget)}"] = time.perf_counter() - t1
        seconds["together"] = time.perf_counter() - t0

    def ttft(self, reqs: list[dict]) -> None:
        """Each request alone with one new token: its wall time ("ttft_s")."""
        for r in reqs:
            t1 = time.perf_counter()
            self.send([r], self.budget_kwargs(r.get("budget")), self.first)
            self.results[r["name"]]["ttft_s"] = time.perf_counter() - t1

    def alone(self, reqs: list[dict], probe: dict | None) -> None:
        """Each request by itself, then a normal one (`probe`): an error must be that request's only."""
        for r in reqs:
            kwargs = dict(r.get("mm_kwargs", {}))
            if r.get("budget") is not None:
                kwargs["arr_coc_budget"] = r["budget"]
            try:
                self.send([r], kwargs)
            except Exception as exc:  # noqa: BLE001 - what the client sees is the point
                self.results[r["name"]] = {"error": {"type": type(exc).__name__,
                                                     "message": str(exc).splitlines()[0][:400]}}
            try:
                self.send([{**probe, "name": "__probe"}], {"arr_coc_budget": "10%"})
                self.results[r["name"]]["next_ok"] = bool(self.results["__probe"]["answer"])
            except Exception as exc:  # noqa: BLE001
                self.results[r["name"]]["next_ok"] = False
                self.results[r["name"]]["next_error"] = f"{type(exc).__name__}: {exc}"[:400]
                break
        self.results.pop("__probe", None)


def main() -> None:
    args = parse_args()
    trace = Path(tempfile.mkdtemp()) / "kept.jsonl"
    os.environ["ARR_COC_VLLM_TRACE"] = str(trace)
    from arr_coc.budget import parse_budget
    from arr_coc.serving.vllm.settings import ServeSettings, clip_count, kept_count

    reqs = json.loads(args.requests.read_text()) if args.requests else item_requests(args.items, args.n, args.budgets)
    t0 = time.perf_counter()
    sender = Sender(engine(args, any(r.get("clips") for r in reqs)), args)
    seconds = {"load": time.perf_counter() - t0}
    together = [r for r in reqs if not r.get("alone") and not r.get("ttft")]
    sender.together(together, seconds)
    sender.ttft([r for r in reqs if r.get("ttft")])
    sender.alone([r for r in reqs if r.get("alone")], next((r for r in together if "messages" in r), None))
    results = sender.results
    keys = image_keys(args.model, [p for r in reqs for p in r["images"]])
    keys.update(clip_keys(args.model, [p for r in reqs for p in r.get("clips", [])]))
    floor = ServeSettings(layer=None if args.layer in ("", "untrained") else args.layer).min_per_group()
    match_kept(reqs, results, trace, keys, args.model, args.server_budget, parse_budget,
               lambda budget, grid, merge, clip: clip_count(budget, grid, merge, floor) if clip else
               kept_count(budget, grid, merge))
    args.out.write_text(json.dumps({"requests": [{"name": r["name"], **results.get(r["name"], {})} for r in reqs],
                                    "seconds": seconds}))
    print(json.dumps(seconds))


def item_requests(items: Path, n: int, budgets: str) -> list[dict]:
    """One single-turn chat per generated item and budget (the GPU script's check; `--requests` for the tests')."""
    listed = [json.loads(line) for line in items.read_text().splitlines() if line.strip()][:n]
    return [{"name": f"{it['id']}@{b}", "images": [str(items.parent / it["image"])], "budget": b,
             "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": it["question"]}]}]}
            for b in budgets.split(",") for it in listed]


def output(o, pads: set[int] = frozenset()) -> dict:
    step = o.outputs[0]
    margins = [round(float(a - b), 6) for a, b in
               (sorted((lp.logprob for lp in s.values()), reverse=True)[:2] for s in (step.logprobs or []))]
    return {"answer": step.text, "token_ids": list(step.token_ids), "prompt_token_ids": list(o.prompt_token_ids),
            "prompt_tokens": len(o.prompt_token_ids), "margins": margins, "error": None,
            "visual_tokens": sum(int(t) in pads for t in o.prompt_token_ids)}


def match_kept(reqs, results, trace, keys, model, server_budget, parse_budget, kept_count) -> None:
    """Per request, per image, its kept cells in the trace by (picture, the prompt's question as the plugin reads
    it, count); null where missing or ambiguous (a test then fails on it, by name)."""
    from transformers import AutoTokenizer

    from arr_coc.serving.vllm.settings import prompt_tokens

    cfg = json.loads((Path(model) / "config.json").read_text())
    tokens = prompt_tokens(AutoTokenizer.from_pretrained(model), cfg["image_token_id"], cfg["video_token_id"])
    seen: dict[tuple, list] = {}
    for line in trace.read_text().splitlines() if trace.exists() else []:
        t = json.loads(line)
        seen.setdefault((t["fingerprint"], tuple(t["question"]), t["count"]), []).append(t["kept"])
    default = parse_budget(server_budget or "0.25", wire=True)
    for r in reqs:
        got = results.get(r["name"])
        if not got or got.get("error"):
            continue
        question = tuple(tokens.question(got.pop("prompt_token_ids")))
        budget = default if r.get("budget") is None else parse_budget(r["budget"], wire=True)
        kept = []
        for p in r["images"] + r.get("clips", []):
            fp, grid = keys[p]
            found = seen.get((fp, question, kept_count(budget, grid, 2, p in r.get("clips", []))), [])
            kept.append(found[0] if found and all(k == found[0] for k in found) else None)
        got["kept"] = kept
    for got in results.values():
        got.pop("prompt_token_ids", None)


if __name__ == "__main__":
    main()
