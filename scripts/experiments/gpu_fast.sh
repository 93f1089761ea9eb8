#!/usr/bin/env bash
# The device check issue 46 asks for, prepared for a session that is lent a GPU (about 8-9 minutes on an H100 or
# H200; run it once on the CPU first with DEVICE=cpu PRESET=tiny to see it through):
#   - whether vllm and sglang are installed on the machine, and their versions (pip show);
#   - Qwen2-VL-2B widths at FULL depth, bf16, 896 px, one look before the tower at 10%, batch 1 and 8: ARR-COC's own
#     work, the tower and the prefill stage by stage, the every-token reference beside it, eager (--fast off)
#     and the fixed-shape compiled path (--fast on: buckets, torch.compile mode="reduce-overhead", static cache);
#     the first pass of each row compiles and is not timed (its time is in the JSON as compile time).
#   OUT=runs/gpu_fast bash scripts/experiments/gpu_fast.sh
set -euo pipefail
OUT=${OUT:-runs/gpu_fast}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-qwen2-vl-2b}
DTYPE=${DTYPE:-bfloat16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ pip show vllm 2>&1 || true; pip show sglang 2>&1 || true; } > "$OUT/serving_engines.txt"
# First (issue 61): the vLLM plugin's requests on the card in bf16, under vLLM's second model runner (the CUDA
# default) and the first, where vLLM is installed: kept cells per item in the JSON, to compare with the Hugging
# Face path in bf16 (tests/test_vllm_deployments.py does it on the CPU runner).
if [ "$DEVICE" = cuda ] && python -c "import vllm" 2>/dev/null; then
  python -m arr_coc gen-data --out "$OUT/items" --split test --n 40 --seed 0
  for v2 in 1 0; do
    VLLM_USE_V2_MODEL_RUNNER=$v2 timeout 300 python scripts/vllm_requests.py --items "$OUT/items/test.jsonl" \
        --n 40 --dtype bfloat16 --out "$OUT/vllm_runner_v2_$v2.json" || echo "runner v2=$v2 failed" >> "$OUT/vllm.txt"
  done
fi
case $PRESET in qwen2-vl-2b) depth="--vision-layers 32 --lm-layers 28";; *) depth="";; esac
for fast in off on; do
  python -m arr_coc bench --stages --preset "$PRESET" $depth --device "$DEVICE" --dtype "$DTYPE" --fast $fast \
      --encode before --budgets 0.1 --sizes 896 --batches 1,8 --repeats 5 \
      --out "$OUT/stages_fast_$fast.json" --markdown "$OUT/stages_fast_$fast.md"
done
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
fi
