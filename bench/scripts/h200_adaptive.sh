#!/bin/bash
# Adaptive speculation on the H200 in one device call: against acceptance on the K2.5-shaped model, then on the
# embedded pair's prompts, then (LAB_TIMEOUT > 0) the loop calls of bench.labs.adaptive_call on one prompt.
# Files under $OUT: adaptive-acceptance/, adaptive-prompts/, adaptive-call/, run-adaptive.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== adaptive against acceptance $(date -u +%T)"; timeout ${ACCEPTANCE_TIMEOUT:-260} python -m bench.adaptive_acceptance \
      --layers 4 --max-new-tokens 128 --repeats 3 --out "$OUT/adaptive-acceptance"
  echo "== adaptive on the embedded pair's prompts $(date -u +%T)"; timeout ${PROMPTS_TIMEOUT:-200} \
      python -m bench.adaptive_prompts --repeats 5 --out "$OUT/adaptive-prompts"
  if [ "${LAB_TIMEOUT:-0}" -gt 0 ]; then
    echo "== loop calls $(date -u +%T)"; timeout "$LAB_TIMEOUT" python -m bench.labs.adaptive_call --prompts 8 \
        --variants fixed3 forced3 rule --out "$OUT/adaptive-call"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run-adaptive.log"
