"""Stock vLLM on the embedded model: does it load and answer the example? (issue 54, step 1)

Run in the vLLM environment (`make vllm-env`), never the project's:
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python scripts/vllm_smoke.py
Prints the answer, the prompt's token count and the load and answer times. vLLM spawns its engine in a new
process, so the engine is created under `if __name__ == "__main__":`.
"""

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/shapes-qwen2vl")
    ap.add_argument("--image", default="assets/examples/shapes_color.png")
    ap.add_argument("--question", default="What color is the circle?")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--arr-coc", default=None, metavar="LAYER",
                    help="serve through the ARR-COC plugin with this layer folder ('untrained' for the default layer)")
    ap.add_argument("--budget", default=None, help="the server's default budget (a share or a count)")
    ap.add_argument("--request-budget", default=None, help="this request's budget (mm_processor_kwargs)")
    args = ap.parse_args()

    from PIL import Image
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    extra = {}
    if args.arr_coc is not None:
        settings = {"layer": args.arr_coc} | ({"budget": args.budget} if args.budget else {})
        extra["hf_overrides"] = {"architectures": [architecture(args.model)], "arr_coc": settings}
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, enforce_eager=True,
              tensor_parallel_size=args.tp, kv_cache_memory_bytes=256 << 20,
              limit_mm_per_prompt={"image": 1} if args.arr_coc else {"image": 1, "video": 0}, **extra)
    t_load = time.perf_counter() - t0
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.open(args.image).convert("RGB")},
                                             {"type": "text", "text": args.question}]}]
    t0 = time.perf_counter()
    kw = {"mm_processor_kwargs": {"arr_coc_budget": args.request_budget}} if args.request_budget else {}
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16), **kw)[0]
    t_ask = time.perf_counter() - t0
    print(f"ANSWER {out.outputs[0].text!r} prompt_tokens={len(out.prompt_token_ids)} "
          f"load_s={t_load:.1f} answer_s={t_ask:.2f}")


def architecture(model: str) -> str:
    """The plugin's architecture for the checkpoint's family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    import json
    import os

    from arr_coc.serving.vllm.settings import FAMILY_ARCHITECTURES

    with open(os.path.join(model, "config.json")) as f:
        return FAMILY_ARCHITECTURES[json.load(f)["model_type"]]


if __name__ == "__main__":
    main()
