#!/bin/bash
# Issue 53: the rows a plain tail built by the cost table touches (PerCallPolicy.built_tails: a fresh machine has
# no table, so a 4-layer engine builds its set untailed, measures, then builds K = 1's loop with its tail): a drafter
# that never matches at full width (bench.mismatched_drafter, LAYERS layers, generate's defaults), the K2.5-shaped
# model against acceptance at 4 layers (bench.adaptive_acceptance, its tails from its measured table), and the prompt
# bench (bench.adaptive_prompts, REPEATS rounds). Only the JSON files and run.log come back.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== never matches, ${LAYERS:-4} layers $(date -u +%T)"
  timeout "${MISMATCHED_TIMEOUT:-150}" python -m bench.mismatched_drafter --layers "${LAYERS:-4}" --rounds 5 \
      --out "$OUT/mismatched"
  echo "== against acceptance, 4 layers $(date -u +%T)"
  timeout "${ACCEPTANCE_TIMEOUT:-200}" python -m bench.adaptive_acceptance --layers 4 --target chained \
      --max-new-tokens 128 --repeats "${ACCEPTANCE_REPEATS:-3}" --out "$OUT/acceptance"
  echo "== prompts $(date -u +%T)"
  timeout "${PROMPTS_TIMEOUT:-150}" python -m bench.adaptive_prompts --repeats "${REPEATS:-21}" --out "$OUT/prompts"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
find "$OUT" -name '*.md' -delete
