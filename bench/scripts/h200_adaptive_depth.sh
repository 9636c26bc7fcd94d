#!/bin/bash
# Adaptive by call on the H200 after the loop's window moved into its carry and the first call's rule into the
# prefill's shadow (issue 53). STAGE=small (default): the lab's interleaved A/B, the embedded pair's 10 prompts, the
# 4-layer K2.5-shaped model against acceptance (chained target) and the build time of the by-call programs against
# the fixed loop at 4 and 61 layers. STAGE=deep: the 61-layer model (repeated MoE arrays, chained target) against
# acceptance (DEEP_TOKENS, DEEP_ACCEPTANCE; its programs compile side by side). STAGE=trace: the lab's A/B with one
# traced generate of each engine, the 10 prompts, and the build time at 61 layers alone. Files under $OUT: ab/,
# adaptive-prompts/, adaptive-acceptance*/, compile-adaptive/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if [ "${STAGE:-small}" = small ]; then
    echo "== lab A/B $(date -u +%T)"; timeout 110 python -m bench.labs.adaptive_calls_ab --out "$OUT/ab"
    echo "== embedded pair's prompts $(date -u +%T)"; timeout 150 \
        python -m bench.adaptive_prompts --repeats 5 --out "$OUT/adaptive-prompts"
    echo "== against acceptance, 4 layers $(date -u +%T)"; timeout 190 \
        python -m bench.adaptive_acceptance --layers 4 --target chained --max-new-tokens 128 --repeats 3 \
        --out "$OUT/adaptive-acceptance"
    echo "== build time $(date -u +%T)"; timeout 120 \
        python -m bench.compile_adaptive --layers 4 61 --alone --out "$OUT/compile-adaptive"
  elif [ "${STAGE}" = trace ]; then
    echo "== lab A/B, traced $(date -u +%T)"; timeout 120 python -m bench.labs.adaptive_calls_ab --trace --out "$OUT/ab"
    echo "== embedded pair's prompts $(date -u +%T)"; timeout 120 \
        python -m bench.adaptive_prompts --repeats 5 --out "$OUT/adaptive-prompts"
    echo "== build time, 61 layers $(date -u +%T)"; timeout ${BUILD_TIMEOUT:-200} \
        python -m bench.compile_adaptive --layers 61 --out "$OUT/compile-adaptive"
  else
    echo "== against acceptance, 61 layers $(date -u +%T)"; timeout ${DEEP_TIMEOUT:-560} \
        python -m bench.adaptive_acceptance --layers 61 --moe-layers repeated --target chained \
        --max-new-tokens ${DEEP_TOKENS:-128} --repeats 2 --acceptance ${DEEP_ACCEPTANCE:-0 0.4 0.7 0.95} \
        --out "$OUT/adaptive-acceptance-61"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
