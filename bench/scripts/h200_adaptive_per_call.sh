#!/bin/bash
# Adaptive speculation by call (the GPU default) on the H200 in one device call: the embedded pair's prompts, the
# K2.5-shaped model against acceptance, and a drafter that never matches at full width (default against fixed K).
# LAYERS (default 4) is the K2.5-shaped model's depth, MOE_LAYERS (distinct or repeated) how its MoE layers are drawn. Files under $OUT: adaptive-prompts/, adaptive-acceptance/,
# mismatched-drafter/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
LAYERS=${LAYERS:-4}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if [ "${PROMPTS:-1}" = 1 ]; then
    echo "== embedded pair's prompts $(date -u +%T)"; timeout ${PROMPTS_TIMEOUT:-200} \
        python -m bench.adaptive_prompts --repeats 5 --out "$OUT/adaptive-prompts"
  fi
  if [ "${ACCEPTANCE:-1}" = 1 ]; then
    echo "== against acceptance, $LAYERS layers $(date -u +%T)"; timeout ${ACCEPTANCE_TIMEOUT:-200} \
        python -m bench.adaptive_acceptance --layers "$LAYERS" --moe-layers "${MOE_LAYERS:-distinct}" --max-new-tokens 128 \
        --repeats 3 --out "$OUT/adaptive-acceptance"
  fi
  if [ "${MISMATCHED:-1}" = 1 ]; then
    echo "== a drafter that never matches, $LAYERS layers $(date -u +%T)"; timeout ${MISMATCHED_TIMEOUT:-150} \
        python -m bench.mismatched_drafter --layers "$LAYERS" --moe-layers "${MOE_LAYERS:-distinct}" --rounds 5 --out "$OUT/mismatched-drafter"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
