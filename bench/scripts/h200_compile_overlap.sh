#!/bin/bash
# Issue 53: the by-call set's build at LAYERS (default 61) layers with compile_programs overlapping each program's XLA
# compile with the next one's lowering, against every program lowered first (bench.compile_adaptive
# --lower-all-first), each build in a fresh process, cold and with its autotuning kept; the two orders ROUNDS times
# (default 1), alternating (ORDERS="overlapped": the engine's order alone; TAILED=1: also the set with its plain
# tails, `bench.compile_adaptive --tailed`). With PROMPTS=1 first the prompt bench (bench.adaptive_prompts, REPEATS
# rounds). Only JSON files and run.log come back.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [ "${PROMPTS:-1}" = 1 ]; then
    echo "== prompts $(date -u +%T)"
    timeout "${PROMPTS_TIMEOUT:-150}" python -m bench.adaptive_prompts --repeats "${REPEATS:-21}" --out "$OUT/prompts"
  fi
  for round in $(seq 1 "${ROUNDS:-1}"); do
    for order in ${ORDERS:-overlapped lowered-first}; do
      echo "== $order, round $round $(date -u +%T)"
      extra=$([ "$order" = lowered-first ] && echo "--lower-all-first" || true)
      extra="$extra $([ "${TAILED:-0}" = 1 ] && echo "--tailed" || true)"
      # shellcheck disable=SC2086
      timeout "${BUILD_TIMEOUT:-240}" python -m bench.compile_adaptive --layers "${LAYERS:-61}" $extra \
          --label "$order-$round" --out "$OUT/compile"
    done
  done
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
find "$OUT" -name '*.md' -delete
