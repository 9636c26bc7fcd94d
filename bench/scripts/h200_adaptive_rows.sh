#!/bin/bash
# Issue 53's rows with bench.adaptive_acceptance's interleaved rounds (plain decoding, each fixed K and adaptive by
# call taking turns per a, a draw of the drafter's acceptances per round). STAGE=deep: the 61-layer model (repeated
# MoE arrays, chained target) at DEEP_ACCEPTANCE, DEEP_REPEATS rounds. STAGE=small (default): the 4-layer model at
# ACCEPTANCE, REPEATS rounds, then the embedded pair's 10 prompts (bench.adaptive_prompts, PROMPT_ROUNDS rounds).
# Only the JSON files and run.log come back (the tables render from the JSON: `markdown` of each bench).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [ "${STAGE:-small}" = deep ]; then
    echo "== against acceptance, 61 layers $(date -u +%T)"
    timeout "${DEEP_TIMEOUT:-540}" python -m bench.adaptive_acceptance --layers 61 --moe-layers repeated \
        --target chained --max-new-tokens 128 --repeats "${DEEP_REPEATS:-2}" --vary-seed \
        --acceptance ${DEEP_ACCEPTANCE:-0 0.15 0.4 0.7 0.95} --out "$OUT/acceptance-61"
  else
    echo "== against acceptance, 4 layers $(date -u +%T)"
    timeout "${ACCEPTANCE_TIMEOUT:-300}" python -m bench.adaptive_acceptance --layers 4 --target chained \
        --max-new-tokens 128 --repeats "${REPEATS:-7}" --vary-seed \
        --acceptance ${ACCEPTANCE:-0 0.2 0.4 0.6 0.8 0.95} --out "$OUT/acceptance-4"
    echo "== prompts $(date -u +%T)"
    timeout "${PROMPTS_TIMEOUT:-200}" python -m bench.adaptive_prompts --repeats "${PROMPT_ROUNDS:-31}" \
        --out "$OUT/prompts"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
find "$OUT" -name '*.md' -delete
find "$OUT" -name '*.png' -delete
