#!/usr/bin/env bash
# The device check issue 36 asks for, prepared for a session that is lent a GPU (about 8-10 minutes on an H100):
# ARR-COC's own work stage by stage beside the tower and the prefill at Qwen2-VL-2B and Qwen2.5-VL-3B widths,
# FULL depth, bf16, before the tower at 10%, batch 1 and 8 at 448 and 896 px; then the whole-prefill rows at
# 5 / 10 / 20 / 100% in both modes. Random weights at the real widths (no download). Results under $OUT.
#   OUT=runs/gpu bash scripts/gpu_stages.sh
set -euo pipefail
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for preset in qwen2-vl-2b qwen2.5-vl-3b; do
  case $preset in qwen2-vl-2b) lm=28;; qwen2.5-vl-3b) lm=36;; esac
  python -m arr_coc bench --stages --preset $preset --vision-layers 32 --lm-layers $lm --device cuda \
      --dtype bfloat16 --encode before --budgets 0.1 --sizes 448,896 --batches 1,8 --repeats 5 \
      --out "$OUT/stages_$preset.json" --markdown "$OUT/stages_$preset.md"
  python -m arr_coc bench --preset $preset --vision-layers 32 --lm-layers $lm --device cuda --dtype bfloat16 \
      --encode after,before --budgets 0.05,0.1,0.2,1.0 --repeats 5 \
      --out "$OUT/bench_$preset.json" --markdown "$OUT/bench_$preset.md"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
