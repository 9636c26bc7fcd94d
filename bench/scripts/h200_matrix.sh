#!/bin/bash
# The issue's whole matrix of `bench.step` (batch x context, every T and K) in one device call, one process per
# GPU: on an nvidia-h200-x2 machine two (batch, context) pairs run side by side, each alone on its GPU (the host's
# 32 cores hold both processes' dispatch threads). The first pair also times the MoE layer lab.
#   PAIRS="1:1024 1:32768" bash bench/scripts/h200_matrix.sh      (the default: batch 1, both contexts)
#   PAIRS="8:1024 8:32768" STEP_BUDGET=420 bash bench/scripts/h200_matrix.sh
# A pair's process stops starting configurations after STEP_BUDGET s (skipped ones are listed in its JSON) and is
# killed after STEP_TIMEOUT s. Files: env.txt, step-b<B>-<CTX>.log and b<B>-<CTX>/step-*.json / .md (a folder a pair:
# the processes start in the same minute, which names their files).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
PAIRS=${PAIRS:-"1:1024 1:32768"}
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
[ "$GPUS" -ge 1 ] || { echo "no GPU visible to nvidia-smi" >&2; exit 1; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/env.txt" 2>&1
nproc >> "$OUT/env.txt"

i=0
pids=()
for pair in $PAIRS; do
  batch=${pair%%:*}
  context=${pair##*:}
  case "$batch:$context" in
    *[!0-9:]*|:*|*:) echo "PAIRS entry '$pair' is not BATCH:CONTEXT" >&2; exit 2 ;;
  esac
  extra=""
  [ "$i" -gt 0 ] && extra="--skip-moe-layer"
  gpu=$((i % GPUS))
  (
    CUDA_VISIBLE_DEVICES=$gpu timeout "${STEP_TIMEOUT:-560}" python3 -m bench.step --layers "${LAYERS:-4}" \
      --batches "$batch" --contexts "$context" --iters "${ITERS:-10}" --budget-s "${STEP_BUDGET:-480}" \
      --out "$OUT/b$batch-$context" $extra ${STEP_ARGS:-} > "$OUT/step-b$batch-$context.log" 2>&1
    echo "pair $pair on GPU $gpu: exit $?" >> "$OUT/step-b$batch-$context.log"
  ) &
  pids+=($!)
  i=$((i + 1))
  # a second pair on the same GPU would share it: wait for the GPU's earlier pairs first
  if [ $((i % GPUS)) -eq 0 ]; then wait "${pids[@]}"; pids=(); fi
done
wait
tail -n 4 "$OUT"/step-b*.log
