#!/usr/bin/env bash
# Issue 37 on a lent GPU: fine-tune the embedded model on ShapesVQA-video (train-vlm --video) for $SECONDS s,
# then pack the checkpoint into $OUT/video_ckpt.tgz (the device tool brings back at most 8 files; it has 9).
#   GPU:       bash scripts/experiments/gpu_video_tune.sh            (the device tool sets OUT)
#   CPU smoke: DEVICE=cpu SECONDS_=10 SITE=/tmp/smoke_site OUT=/tmp/vt_gpu_smoke bash scripts/experiments/gpu_video_tune.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_video}
DEVICE=${DEVICE:-cuda}
SECS=${SECONDS_:-200}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
export PYTHONPATH=$SITE:$PWD
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")'
python3 -m arr_coc train-vlm --video --device "$DEVICE" --seconds "$SECS" --video-steps 100000 --clips 8 \
    --video-images 8 --out /tmp/video_ckpt 2>&1 | tr '\r' '\n' | awk 'NR % 50 == 0 || /added|error|Error|Traceback/'
tar czf "$OUT/video_ckpt.tgz" -C /tmp/video_ckpt .
ls -la "$OUT"
