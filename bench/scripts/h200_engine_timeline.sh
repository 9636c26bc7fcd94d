#!/bin/bash
# Issue 53: where the by-call engine's decode spends the time beyond the fixed-K engine's at the same K, phase by phase
# (bench.labs.engine_call_timeline: K = 3 on 'def fibonacci', K = 4 on 'x7#qP', ROUNDS interleaved rounds), then the
# prompt bench (REPEATS interleaved rounds, its paired columns), then the device's own text for the rule's replay on a
# CPU (bench.labs.adaptive_replay oracle, bfloat16 as the bench runs; `python -m bench.labs.calls_replay --oracle`).
# Files under $OUT/k3, $OUT/k4, $OUT/adaptive-prompts, $OUT/oracle-bf16.json and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  echo "== timeline $(date -u +%T)"
  timeout "${LAB_TIMEOUT:-120}" python -m bench.labs.engine_call_timeline --k 3 --prompt 0 --rounds "${ROUNDS:-41}" \
      --out "$OUT/k3"
  timeout "${LAB_TIMEOUT:-120}" python -m bench.labs.engine_call_timeline --k 4 --prompt 2 --rounds "${ROUNDS:-41}" \
      --out "$OUT/k4"
  if [ "${PROMPTS:-1}" = 1 ]; then
    echo "== prompts $(date -u +%T)"
    timeout "${PROMPTS_TIMEOUT:-300}" python -m bench.adaptive_prompts --repeats "${REPEATS:-31}" \
        --out "$OUT/adaptive-prompts"
  fi
  if [ "${ORACLE:-1}" = 1 ]; then
    echo "== oracle $(date -u +%T)"
    timeout "${ORACLE_TIMEOUT:-100}" python -m bench.labs.adaptive_replay oracle --dtype bfloat16 \
        --out "$OUT/oracle-bf16.json"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
