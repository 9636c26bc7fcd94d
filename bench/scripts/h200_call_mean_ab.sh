#!/bin/bash
# Issue 53: the by-call loop's leaving test computed in the predicate from the state (the mean since the call's
# start, the lab's `loop_call_mean`) against the window kept in the carry (`loop_leaving`, the engine's) and the
# fixed-K loop, on the embedded pair (bench.labs.adaptive_calls_ab at K = 3 and K = 4, ROUNDS interleaved rounds),
# then the prompt bench with the engine as built (bench.adaptive_prompts, REPEATS interleaved rounds). Files under
# $OUT/k3, $OUT/k4, $OUT/adaptive-prompts and $OUT/run.log. (Run 1659 ran it at commit 7ac485c, where the engine
# held the predicate test as `loop_leaving` and the lab the window as `loop_window`.)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  echo "== loops $(date -u +%T)"
  timeout "${LAB_TIMEOUT:-200}" python -m bench.labs.adaptive_calls_ab --k 3 --prompt 3 --rounds "${ROUNDS:-31}" \
      --out "$OUT/k3"
  timeout "${LAB_TIMEOUT:-200}" python -m bench.labs.adaptive_calls_ab --k 4 --prompt 0 --rounds "${ROUNDS:-31}" \
      --out "$OUT/k4"
  echo "== prompts $(date -u +%T)"
  timeout "${PROMPTS_TIMEOUT:-300}" python -m bench.adaptive_prompts --repeats "${REPEATS:-21}" \
      --out "$OUT/adaptive-prompts"
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
