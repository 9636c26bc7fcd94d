#!/bin/bash
# Issue 53: the K = 1 loop's plain tail (adaptive by call switches to plain decoding in the same call). STAGE=build
# (default): the 61-layer build of the fixed loop and of the by-call set without and with plain tails (TAILS,
# default "none 1"), each cold in a fresh process (`bench.labs.plain_tail_compile`), then the 4-layer K2.5-shaped
# model against acceptance 0 / 0.3 / 0.6 / 0.8 / 0.95 (7 repeats, a drafter's draw per repeat). STAGE=rows: the
# embedded pair's 10 prompts in PROMPT_REPEATS (default 21; PROMPTS_TIMEOUT, default 200 s) interleaved rounds, the
# 61-layer model against acceptance 0 / 0.7 / 0.95, and (MISMATCHED=1) a drafter that never matches at full width,
# 4 layers, as `generate --baseline` reports it.
# STAGE=deep: the 61-layer rows again, REPEATS (default 4) with a drafter's draw per repeat.
# Files under $OUT, and $OUT/run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
STAGE=${STAGE:-build}
mkdir -p "$OUT"
{
  echo "== $STAGE $(date -u +%T)"
  if [ "$STAGE" = build ]; then
    timeout 300 python -m bench.labs.plain_tail_compile --layers 61 --tails ${TAILS:-none 1} \
        --out "$OUT/plain-tail-compile"
    echo "== acceptance, 4 layers $(date -u +%T)"
    OUT=$OUT STAGE=acceptance REPEATS=7 VARY_SEED=1 ACCEPTANCE="0 0.3 0.6 0.8 0.95" MIN_CYCLES=4 \
        ACCEPTANCE_TIMEOUT=280 bash bench/scripts/h200_adaptive_rounds.sh
  elif [ "$STAGE" = deep ]; then
    timeout 540 python -m bench.adaptive_acceptance --layers 61 --moe-layers repeated --target chained \
        --max-new-tokens 128 --repeats "${REPEATS:-4}" --vary-seed --acceptance 0 0.7 0.95 \
        --out "$OUT/adaptive-acceptance-61"
  else
    OUT=$OUT STAGE=prompts REPEATS=${PROMPT_REPEATS:-21} PROMPTS_TIMEOUT=${PROMPTS_TIMEOUT:-200} \
        bash bench/scripts/h200_adaptive_rounds.sh
    echo "== acceptance, 61 layers $(date -u +%T)"
    OUT=$OUT STAGE=deep DEEP_ACCEPTANCE="0 0.7 0.95" DEEP_TIMEOUT=330 bash bench/scripts/h200_adaptive_depth.sh
    if [ "${MISMATCHED:-0}" = 1 ]; then
      echo "== a drafter that never matches, 4 layers $(date -u +%T)"
      timeout 150 python -m bench.mismatched_drafter --layers 4 --moe-layers distinct --rounds 5 \
          --out "$OUT/mismatched-drafter"
    fi
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run-$STAGE.log"
