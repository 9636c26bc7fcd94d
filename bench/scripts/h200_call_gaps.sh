#!/bin/bash
# Issue 53: where the device's idle time between two calls of a by-call generation goes. One calls_same generation
# of bench.labs.call_price traced (--trace-calls: the host's self time by event within the device's gaps), with the
# empty call traced beside it, at 4 layers and at 61 (repeated MoE arrays). Files under $OUT/ and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== 4 layers $(date -u +%T)"
  timeout 170 python -m bench.labs.call_price --layers 4 --rounds 3 --trace-empty 5 --trace-calls \
      --out "$OUT/call-gaps-4"
  echo "== 61 layers $(date -u +%T)"
  timeout ${DEEP_TIMEOUT:-200} python -m bench.labs.call_price --layers 61 --moe-layers repeated --rounds 1 \
      --trace-calls --out "$OUT/call-gaps-61"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization\|cuda_timer.cc" | tee "$OUT/run.log"
