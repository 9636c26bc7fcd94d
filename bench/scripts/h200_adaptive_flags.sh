#!/bin/bash
# The adaptive loop's whole-call overhead under XLA command-buffer settings (issue 37): bench.labs.adaptive_call's
# fixed K = 3, adaptive forced to K = 3 and the rule on one prompt, each flag set in its own process (XLA reads
# XLA_FLAGS once); then the embedded pair's prompts under PROMPTS_FLAGS. Files under $OUT.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for name in ${CONFIGS:-default exclusive-lock min-graph-20}; do
    flags=$(python3 -m bench.labs.xla_flag_sets "$name") || exit 2
    echo "== $name: $flags $(date -u +%T)"
    XLA_FLAGS="$flags" timeout "${LAB_TIMEOUT:-75}" python -m bench.labs.adaptive_call --prompts 8 \
        --variants fixed3 forced3 rule --out "$OUT/adaptive-call-$name" 2>&1 | grep -v "^ *host\|^ *gap"
  done
  if [ -n "${PROMPTS_FLAGS:-}" ]; then
    flags=$(python3 -m bench.labs.xla_flag_sets $PROMPTS_FLAGS) || exit 2
    echo "== prompts under $PROMPTS_FLAGS: $flags $(date -u +%T)"
    XLA_FLAGS="$flags" timeout "${PROMPTS_TIMEOUT:-160}" python -m bench.adaptive_prompts --repeats 5 \
        --out "$OUT/adaptive-prompts-$PROMPTS_FLAGS"
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run-adaptive-flags.log"
