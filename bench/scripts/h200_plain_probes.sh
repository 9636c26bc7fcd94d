#!/bin/bash
# Issue 53: plain calls that keep the draft current (PerCallPolicy.probe_every) on the device, in one call: a new
# engine's first generation on prompts the draft cannot follow at first, and a random draft's price of the probes
# (bench.adaptive_fresh); a drafter that never matches at full width (bench.mismatched_drafter, LAYERS layers); the
# prompt bench with the engine's pool shared across prompts (bench.adaptive_prompts, REPEATS rounds); the by-call
# set's build against the fixed loop, each build in a fresh process, cold and with its autotuning kept
# (bench.compile_adaptive, COMPILE_LAYERS). Only the JSON files and run.log are
# kept (the device returns few files; each .md is rendered from its JSON by the bench's `markdown`).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "== fresh $(date -u +%T)"
  timeout "${FRESH_TIMEOUT:-180}" python -m bench.adaptive_fresh --repeats "${FRESH_REPEATS:-11}" --out "$OUT/fresh"
  if [ "${MISMATCHED:-1}" = 1 ]; then
    echo "== never matches, ${LAYERS:-4} layers $(date -u +%T)"
    timeout "${MISMATCHED_TIMEOUT:-150}" python -m bench.mismatched_drafter --layers "${LAYERS:-4}" --rounds 5 \
        --out "$OUT/mismatched"
  fi
  if [ "${PROMPTS:-1}" = 1 ]; then
    echo "== prompts $(date -u +%T)"
    timeout "${PROMPTS_TIMEOUT:-150}" python -m bench.adaptive_prompts --repeats "${REPEATS:-21}" --out "$OUT/prompts"
  fi
  if [ -n "${COMPILE_LAYERS:-}" ]; then
    echo "== compile $(date -u +%T)"
    # shellcheck disable=SC2086
    timeout "${COMPILE_TIMEOUT:-280}" python -m bench.compile_adaptive --layers $COMPILE_LAYERS --out "$OUT/compile"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v -E "^[EWI][0-9]{4} |gpu_hlo_schedule" | tee "$OUT/run.log"
find "$OUT" -name '*.md' -delete
