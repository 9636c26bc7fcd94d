#!/bin/bash
# Where a whole adaptive generation's time goes on the embedded pair (bench.labs.adaptive_call): decode-loop calls of
# plain decoding, fixed K = 3, adaptive forced to K = 3 and adaptive variants, timed and traced.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  timeout ${CALL_TIMEOUT:-400} python -m bench.labs.adaptive_call --prompts ${PROMPT_IDS:-6 8} --out "$OUT/adaptive-call" \
      ${VARIANTS:+--variants $VARIANTS}
} 2>&1 | tee "$OUT/run-adaptive-call.log"
