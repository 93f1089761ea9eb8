#!/usr/bin/env bash
# One short GPU session (a lent H100/H200, no network) with OUR transformers: the trimmed successor of issue 36's
# gpu_stages.sh (removed: its run was never recorded; this one's is, docs/GPU.md section 7).
# The wheels in .whl (transformers 5.23.0, huggingface-hub 2.4.0, tokenizers 0.23.3 and the httpx2 chain that
# hub 2.x imports; the image has 5.17.0 / 1.33.0 / 0.23.2) go to $SITE, first on PYTHONPATH. Then, Qwen2-VL-2B
# widths at FULL depth (vision 32, LM 28), random weights, bf16:
#   (a) bench --stages: encode before, budget 10%, 448 and 896 px, batch 1 and 8;
#   (b) the whole-prefill bench (896 px): after and before at 5 / 10 / 100%;
#   (c) bench --stages with two looks (3% + a 5% saccade, every image looks again): ARR-COC's own work over both.
# Results under $OUT, at most 8 files (what the device tool brings back): gpu.txt, session.log (every command's
# stdout and stderr), stages.json/.md, bench.json/.md, saccades.json/.md.
#   GPU:      bash scripts/experiments/gpu_session.sh                      (the device tool sets OUT)
#   CPU smoke: DEVICE=cpu DTYPE=float32 SMOKE=1 SITE=/tmp/smoke_site OUT=/tmp/gpu_smoke bash scripts/experiments/gpu_session.sh
#   SMOKE=1: --vision-layers 2 --lm-layers 2 --sizes 448 --batches 1 --repeats 1 (seconds, not the measurement).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/gpu_session}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
SMOKE=${SMOKE:-0}
SITE=${SITE:-/tmp/site}
STEPS=${STEPS:-stages,bench,saccades}   # which steps run (a rerun names only the ones it needs)
STEP_TIMEOUT=${STEP_TIMEOUT:-150}   # seconds per bench command (each ~1 min expected on an H100), so one stuck
                                    # step leaves time for the next
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/session.log"
: > "$LOG"
T0=$(date +%s)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    2>&1 | tee -a "$LOG"   # (not `... && export`: a failed install must stop the script, not fall back to the image's)
export PYTHONPATH=$SITE:$PWD

{
  python3 -c 'import torch, transformers, huggingface_hub, tokenizers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__, huggingface_hub.__version__, tokenizers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")' \
      || echo "version check failed: rc $?"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "nvidia-smi failed: rc $?"
  else
    echo "nvidia-smi: not found"
  fi
} 2>&1 | tee "$OUT/gpu.txt" | tee -a "$LOG"
# Stop here unless the versions imported are requirements.txt's pins (the carried wheels), not the image's.
python3 - 2>&1 <<'PY' | tee -a "$LOG"
import re, huggingface_hub, tokenizers, transformers
pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", open("requirements.txt").read(), re.M))
got = {"transformers": transformers, "huggingface-hub": huggingface_hub, "tokenizers": tokenizers}
bad = {n: (m.__version__, pins[n], m.__file__) for n, m in got.items() if m.__version__ != pins[n]}
raise SystemExit(f"not the pinned versions: {bad}" if bad else 0)
PY

if [ "$SMOKE" = 1 ]; then
  LAYERS=(--vision-layers 2 --lm-layers 2); SIZES=448; BATCHES=1; REPEATS=1
else
  LAYERS=(--vision-layers 32 --lm-layers 28); SIZES=448,896; BATCHES=1,8; REPEATS=3
fi
COMMON=(--preset qwen2-vl-2b "${LAYERS[@]}" --device "$DEVICE" --dtype "$DTYPE" --repeats "$REPEATS")

FAILED=()
step() {   # step NAME ARGS...: one `python -m arr_coc` command, its output appended to session.log, timed
  local name=$1 t rc
  shift
  [[ ",$STEPS," == *",$name,"* ]] || return 0
  t=$(date +%s)
  echo "=== $name: python3 -m arr_coc $* ($(date -u +%H:%M:%S), +$((t - T0)) s)" | tee -a "$LOG"
  set +e
  timeout "$STEP_TIMEOUT" python3 -m arr_coc "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  set -e
  echo "=== $name: rc $rc, $(($(date +%s) - t)) s" | tee -a "$LOG"
  [ "$rc" = 0 ] || FAILED+=("$name")
}

# (a) ARR-COC's own work stage by stage beside the tower and the prefill
step stages bench --stages "${COMMON[@]}" --encode before --budgets 0.1 --sizes "$SIZES" --batches "$BATCHES" \
    --out "$OUT/stages.json" --markdown "$OUT/stages.md"
# (b) the whole prefill, both encoding modes
step bench bench "${COMMON[@]}" --encode after,before --budgets 0.05,0.1,1.0 \
    --out "$OUT/bench.json" --markdown "$OUT/bench.md"

# (c) saccades (issue 38): ARR-COC's own work over both looks (a 3% first look, then 5% more, the gate forced open
# so every image pays for both), stage by stage beside the reference's tower and prefill
step saccades bench --stages "${COMMON[@]}" --encode before --budgets 0.03 --passes 2 --saccade-budget 0.05 \
    --saccade-threshold -1 --sizes "$SIZES" --batches "$BATCHES" --out "$OUT/saccades.json" --markdown "$OUT/saccades.md"

# (d) the one-look baseline of (c): the same 3% first look, no saccade
step stages3 bench --stages "${COMMON[@]}" --encode before --budgets 0.03 --sizes "$SIZES" --batches "$BATCHES" \
    --out "$OUT/stages3.json" --markdown "$OUT/stages3.md"

echo "=== done in $(($(date +%s) - T0)) s; failed: ${FAILED[*]:-none}" | tee -a "$LOG"
[ ${#FAILED[@]} = 0 ]
