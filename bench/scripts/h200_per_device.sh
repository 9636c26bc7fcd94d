#!/bin/bash
# Issue 52, the first H200 call: one device's program of the 8-way mesh at 61 layers (bench.per_device), decode and
# verify T = 4 at 61 and at the prefix depth (the per-layer time and kernels by difference), a K = 3 cycle, under
# the neighbour regime and the model's own routing. BUDGET_S stops new timings (the report keeps what ran). Files
# under $OUT/per-device/: per-device-gpu-<date>.json and .md, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/per-device"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  timeout ${PER_DEVICE_TIMEOUT:-540} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens ${TOKENS:-1 4} --cycle-k ${CYCLE_K:-3} --routing neighbour model --budget-s ${BUDGET_S:-420} \
      --out "$OUT/per-device"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/per-device/run.log"
