#!/bin/bash
# Issue 53: the by-call loop's leaving test as the engine runs it (`spec_loop`: both window columns read from the log
# after the cycle) against the lab's candidates, `loop_fresh` (the leaving column read as the cycle starts, the
# cycle's own column from what it accepted; it leaves where `spec_loop` does) and `loop_stale` (the test judged on
# the cycles before, a cycle later), and the fixed-K loop with its progress on the host (`loop_progress`):
# bench.labs.adaptive_calls_ab at K = 3 (traced loops, their optimised HLO in $OUT/k3/hlo/) and K = 4, ROUNDS
# interleaved rounds; then the prompt bench with the engine as built (REPEATS interleaved rounds, default 41) and,
# where the call's time allows, a drafter that never matches at full width, 4 layers. Files under $OUT/k3, $OUT/k4,
# $OUT/adaptive-prompts, $OUT/mismatched-drafter and $OUT/run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  echo "== loops $(date -u +%T)"
  timeout "${LAB_TIMEOUT:-150}" python -m bench.labs.adaptive_calls_ab --k 3 --prompt 3 --rounds "${ROUNDS:-31}" \
      --trace-loops --hlo --out "$OUT/k3"
  timeout "${LAB_TIMEOUT:-150}" python -m bench.labs.adaptive_calls_ab --k 4 --prompt 0 --rounds "${ROUNDS:-31}" \
      --out "$OUT/k4"
  echo "== prompts $(date -u +%T)"
  timeout "${PROMPTS_TIMEOUT:-300}" python -m bench.adaptive_prompts --repeats "${REPEATS:-41}" \
      --out "$OUT/adaptive-prompts"
  if [ "$SECONDS" -lt "${MISMATCHED_BEFORE_S:-440}" ]; then
    echo "== a drafter that never matches, 4 layers $(date -u +%T)"
    timeout 120 python -m bench.mismatched_drafter --layers 4 --moe-layers distinct --rounds 5 \
        --out "$OUT/mismatched-drafter"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
