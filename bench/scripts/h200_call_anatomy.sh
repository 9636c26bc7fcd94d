#!/bin/bash
# Issue 53: where one device call's fixed price goes. The host's price per argument array (bench.labs.call_leaves),
# an empty program over the model's weights at 4 and 61 layers (bench.labs.dispatch_args, traced), and the K loop's
# call that runs no cycle, traced on the host and the device, with the program's work outside its loop
# (bench.labs.call_price --trace-empty). Files under $OUT/ and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== call_leaves $(date -u +%T)"
  timeout 120 python -m bench.labs.call_leaves --leaves 0 100 400 1500 3000 --out "$OUT/call-leaves"
  for layers in 4 61; do
    echo "== dispatch_args, $layers layers $(date -u +%T)"
    timeout 120 python -m bench.labs.dispatch_args --layers $layers --calls 200 --trace 5
  done
  echo "== call_price, 4 layers, empty call traced $(date -u +%T)"
  timeout 150 python -m bench.labs.call_price --layers 4 --rounds 2 --trace-empty 5 --out "$OUT/call-price-4"
  echo "== call_price, 61 layers, empty call traced $(date -u +%T)"
  timeout ${DEEP_TIMEOUT:-200} python -m bench.labs.call_price --layers 61 --moe-layers repeated --rounds 1 \
      --trace-empty 5 --out "$OUT/call-price-61"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run.log"
