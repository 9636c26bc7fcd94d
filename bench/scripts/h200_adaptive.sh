#!/bin/bash
# Adaptive speculation on the H200 in one device call: against acceptance on the K2.5-shaped model, then on the
# embedded pair's prompts. Files under $OUT: adaptive-acceptance/, adaptive-prompts/, run-adaptive.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== adaptive against acceptance"; timeout 230 python -m bench.adaptive_acceptance --layers 4 \
      --max-new-tokens 128 --repeats 3 --out "$OUT/adaptive-acceptance"
  echo "== adaptive on the embedded pair's prompts"; timeout 140 python -m bench.adaptive_prompts --repeats 5 \
      --out "$OUT/adaptive-prompts"
} 2>&1 | tee "$OUT/run-adaptive.log"
