"""vLLM's side of the plugin's equality test (tests/test_vllm_plugin.py): answers and kept cells of generated items.

Run in the vLLM environment (`make vllm-env`):
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python scripts/vllm_compare.py --items DIR/test.jsonl --n 20 \\
        --budgets 0.05,0.1,0.25 --layer checkpoints/arr-coc-shapes --out vllm.json
One engine serves every budget (each batch of requests names its own in `mm_processor_kwargs`); `--stock` serves
the same items through stock vLLM (no plugin). The plugin's architecture is the checkpoint's family's
(`settings.FAMILY_ARCHITECTURES`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) unless `--arch` names another (a refusal test);
`--layer untrained` serves the untrained layer. Writes {"items": [{"id", "budget", "answer", "prompt_tokens",
"kept"}], "seconds": {...}}; kept cells come from the plugin's trace ($ARR_COC_VLLM_TRACE), matched to items by
the image's fingerprint, question and budget.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def fingerprints(model: str, paths: list[Path]) -> list[float]:
    """Each image's pixel rows' float64 sum under the plugin's (PIL) image processor: the trace's key."""
    from PIL import Image
    from transformers import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(model, backend="pil")
    rows = [ip(images=[Image.open(p).convert("RGB")], return_tensors="pt")["pixel_values"] for p in paths]
    return [round(float(r.double().sum()), 3) for r in rows]


def one_process_engine(one_process: bool) -> dict:
    """The engine core and its worker in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor):
    the same model and scheduler, without spawning two processes that import vLLM again (an engine starts in about
    2 s instead of 15 s here, which the tests' many engines add up). Set before vLLM is imported; tensor or data
    parallel engines need their processes. -> the LLM's extra kwargs."""
    if not one_process:
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}


def read_items(path: Path, n: int) -> list[dict]:
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    for it in items:
        it["path"] = path.parent / it["image"]
    return items


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=Path, required=True)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--budgets", default="0.1")
    ap.add_argument("--model", default="checkpoints/shapes-qwen2vl")
    ap.add_argument("--layer", default="checkpoints/arr-coc-shapes", help="a layer folder, or 'untrained'")
    ap.add_argument("--arch", default=None, help="the plugin's architecture (default: the checkpoint's family's)")
    ap.add_argument("--encode", default="after", choices=["after", "before"])
    ap.add_argument("--stock", action="store_true", help="stock vLLM, no plugin")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32", help="the dtype vLLM builds and serves the model in")
    ap.add_argument("--chunk", type=int, default=None,
                    help="max_num_batched_tokens: prefill in chunks this long (an image's pads split across steps)")
    ap.add_argument("--one-process", action="store_true",
                    help="the engine core and its worker in this process (no spawning: starts and stops faster)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (one NUMA node: VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="also ask the first K images a second question, in the same batch as their own (at 10%%)")
    ap.add_argument("--lora", default=None,
                    help="the layer's adapter folder (peft LoRA, tower + LM): served with it on, every request runs it "
                         "through vLLM's LoRA support (without: served with \"adapter\": false)")
    ap.add_argument("--margins", action="store_true",
                    help="record each answer token's logit margin over the runner-up (near-ties explain differences)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    trace = Path(tempfile.mkdtemp()) / "kept.jsonl"
    os.environ["ARR_COC_VLLM_TRACE"] = str(trace)       # before vLLM spawns its engine: the worker inherits it
    extra_engine = one_process_engine(args.one_process)
    from vllm import LLM, SamplingParams

    items = read_items(args.items, args.n)
    extra = {} if args.stock else {"hf_overrides": {"architectures": [args.arch or architecture(args.model)],
                                                    "arr_coc": {"layer": args.layer, "encode": args.encode,
                                                                "adapter": args.lora is not None}}}
    lora = {} if args.lora is None else {"enable_lora": True, "enable_tower_connector_lora": True,
                                         "max_lora_rank": 16, "max_loras": 1}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, enforce_eager=True, seed=0,
              tensor_parallel_size=args.tp, max_num_batched_tokens=args.chunk,
              kv_cache_memory_bytes=256 << 20, limit_mm_per_prompt={"image": 1}, **lora, **extra, **extra_engine)
    seconds = {"load": time.perf_counter() - t0}
    messages = [ask(it, it["question"]) for it in items]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2 if args.margins else None)
    rows = []
    for budget in ([None] if args.stock else args.budgets.split(",")):
        kw = {} if budget is None else {"mm_processor_kwargs": {"arr_coc_budget": budget}}
        if args.lora is not None:
            from vllm.lora.request import LoRARequest

            kw["lora_request"] = LoRARequest("arr-coc", 1, os.path.abspath(args.lora))
        t0 = time.perf_counter()
        outs = llm.chat(messages, greedy, use_tqdm=False, **kw)
        seconds[f"answer {budget}"] = time.perf_counter() - t0
        rows += [row(it, budget, it["question"], o) for it, o in zip(items, outs)]
    if args.pairs and not args.stock:      # two questions about one image in one batch: the cache must not leak
        pairs = [(it, q) for it in items[:args.pairs] for q in (it["question"], OTHER_QUESTION)]
        outs = llm.chat([ask(it, q) for it, q in pairs], greedy, use_tqdm=False,
                        mm_processor_kwargs={"arr_coc_budget": "0.1"})
        rows += [row(it, "0.1", q, o, kind="pair") for (it, q), o in zip(pairs, outs)]
    if not args.stock:
        match_kept(rows, items, trace, args.model)
    for r in rows:
        del r["prompt_token_ids"]
    args.out.write_text(json.dumps({"items": rows, "seconds": seconds}))
    print(json.dumps(seconds))


OTHER_QUESTION = "How many circles are there?"


def architecture(model: str) -> str:
    """The plugin's architecture for the checkpoint's family (its config.json's model_type)."""
    from arr_coc.serving.vllm.settings import FAMILY_ARCHITECTURES

    return FAMILY_ARCHITECTURES[json.loads((Path(model) / "config.json").read_text())["model_type"]]


def prompt_token_ids(model: str) -> tuple[int, int, int]:
    """(<|image_pad|>, <|vision_end|>, <|im_end|>) of the checkpoint: its config's image token, its tokenizer's."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model).get_vocab()
    image = json.loads((Path(model) / "config.json").read_text())["image_token_id"]
    return int(image), int(vocab["<|vision_end|>"]), int(vocab["<|im_end|>"])


def ask(item: dict, question: str) -> list[dict]:
    from PIL import Image

    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.open(item["path"]).convert("RGB")},
                                         {"type": "text", "text": question}]}]


def row(item: dict, budget: str | None, question: str, out, kind: str = "item") -> dict:
    got = {"id": item["id"], "kind": kind, "budget": budget, "question": question, "answer": out.outputs[0].text,
           "token_ids": list(out.outputs[0].token_ids), "prompt_tokens": len(out.prompt_token_ids),
           "prompt_token_ids": list(out.prompt_token_ids)}
    if out.outputs[0].logprobs:      # per answer token: log p(top 1) - log p(top 2) (greedy: top 1 is the token)
        got["margins"] = [round(float(a - b), 6) for a, b in
                          (sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in
                           out.outputs[0].logprobs)]
    return got


def match_kept(rows: list[dict], items: list[dict], trace: Path, model: str) -> None:
    """Each row's kept cells from the trace, by (fingerprint, question ids, kept count); an ambiguous or missing
    match leaves kept None (the test then fails on it, by name). The question's ids are read back from the prompt
    as the plugin reads them (the text after <|vision_end|> up to <|im_end|>)."""
    marks = dict(zip((it["id"] for it in items), fingerprints(model, [it["path"] for it in items])))
    image_pad, vision_end, im_end = prompt_token_ids(model)
    seen: dict[tuple, list] = {}
    for line in trace.read_text().splitlines():
        t = json.loads(line)
        seen.setdefault((t["fingerprint"], tuple(t["question"]), t["count"]), []).append(t["kept"])
    for row in rows:
        n_pads = row["prompt_token_ids"].count(image_pad)
        ids = row["prompt_token_ids"]
        after = ids[len(ids) - ids[::-1].index(vision_end):]
        question = tuple(after[:after.index(im_end)] if im_end in after else after)
        found = [k for (fp, q, c), ks in seen.items()
                 if fp == marks[row["id"]] and c == n_pads and tuple(t for t in question if t in q) == q for k in ks]
        row["kept"] = found[0] if found and all(k == found[0] for k in found) else None


if __name__ == "__main__":
    main()
