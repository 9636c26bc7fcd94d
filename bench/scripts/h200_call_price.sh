#!/bin/bash
# Issue 53: the price of one more call of a fixed-K loop (bench.labs.call_price) at 4 layers, the same with XLA's
# command buffers off (is the price theirs?), and at 61 layers (repeated MoE arrays). Files under $OUT/call-price*/
# and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== 4 layers $(date -u +%T)"
  timeout 100 python -m bench.labs.call_price --layers 4 --out "$OUT/call-price-4"
  echo "== 4 layers, command buffers off $(date -u +%T)"
  XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 100 python -m bench.labs.call_price --layers 4 \
      --out "$OUT/call-price-4-no-command-buffers"
  echo "== 61 layers $(date -u +%T)"
  timeout ${DEEP_TIMEOUT:-200} python -m bench.labs.call_price --layers 61 --moe-layers repeated --rounds 3 \
      --out "$OUT/call-price-61"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run.log"
