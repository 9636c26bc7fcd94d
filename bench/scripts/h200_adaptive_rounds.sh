#!/bin/bash
# Issue 53, its two GPU misses measured so run-to-run noise cannot decide them. STAGE=serve: the embedded pair served
# with fixed K = 3, fixed K = 4 and adaptive K side by side in one process (bench.serve_load --rounds: every level
# ROUNDS times on every mode, the order rotated each round), at concurrency LEVELS (default 16,64; RPW requests a
# worker) and at each GIL switch interval of SWITCH_MS (default "5,0.5": Python's default and a short one; empty:
# the server's own; CLIENT_PROCESS=1: the load generator in its own process), with the
# adaptive policy's every timed loop in the JSON. Needs uvicorn and its peers on the path. STAGE=acceptance: the
# 4-layer K2.5-shaped model against acceptance ACCEPTANCE (default 0 0.6 0.95), adaptive by call with its first test
# after each of MIN_CYCLES (default "4 2") cycles (VARY_SEED=1: a drafter's draw per repeat). STAGE=prompts: the
# embedded pair's 10 prompts, plain, fixed K and adaptive in interleaved rounds (REPEATS, default 5). Files under $OUT/serve-rounds/, $OUT/adaptive-acceptance/ or
# $OUT/adaptive-prompts/, and $OUT/run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
STAGE=${STAGE:-serve}
mkdir -p "$OUT"
switch=()
[ -n "${SWITCH_MS-5,0.5}" ] && switch=(--switch-interval-ms "${SWITCH_MS-5,0.5}")
[ "${CLIENT_PROCESS:-0}" = 1 ] && switch+=(--client-process)
{
  echo "== $STAGE $(date -u +%T)"
  if [ "$STAGE" = serve ]; then
    timeout "${SERVE_TIMEOUT:-540}" python -m bench.serve_load --dtype bfloat16 --max-tokens 128 \
        --requests-per-worker "${RPW:-8}" --concurrency "${LEVELS:-16,64}" --max-context 512 --no-check \
        --modes "${MODES:-spec3,spec4,adaptive}" --speculative-num-steps 4 --rounds "${ROUNDS:-3}" \
        "${switch[@]}" --out "$OUT/serve-rounds"
  elif [ "$STAGE" = prompts ]; then
    timeout "${PROMPTS_TIMEOUT:-540}" python -m bench.adaptive_prompts --repeats "${REPEATS:-5}" \
        --out "$OUT/adaptive-prompts"
  else
    timeout "${ACCEPTANCE_TIMEOUT:-540}" python -m bench.adaptive_acceptance --layers 4 --target chained \
        --max-new-tokens 128 --repeats "${REPEATS:-3}" --acceptance ${ACCEPTANCE:-0 0.6 0.95} \
        --min-cycles ${MIN_CYCLES:-4 2} ${VARY_SEED:+--vary-seed} --out "$OUT/adaptive-acceptance"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run-$STAGE.log"
