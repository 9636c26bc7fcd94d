#!/bin/bash
# Issue 53: what reading a call's summary costs a by-call generation (bench.labs.call_price: calls_same against
# calls_wait and calls_exact with no read between calls; run 1829, at commit bfa3797, also had calls_host, the summary
# written to host memory, since the engine's own way), at 4 layers and at 61 (repeated MoE arrays). Files under $OUT/
# and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== 4 layers $(date -u +%T)"
  timeout 200 python -m bench.labs.call_price --layers 4 --rounds ${ROUNDS:-7} --out "$OUT/call-read-4"
  echo "== 61 layers $(date -u +%T)"
  timeout ${DEEP_TIMEOUT:-220} python -m bench.labs.call_price --layers 61 --moe-layers repeated --rounds 2 \
      --out "$OUT/call-read-61"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization\|cuda_timer.cc" | tee "$OUT/run.log"
