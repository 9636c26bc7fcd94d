#!/bin/bash
# Issue 36: the lab's group kernels with one wgmma per token (bench/labs/moe_grouped_tokens.py) beside moe_wgmma's
# slots and moe_grouped's scale-pick group kernels, on one K2.5 layer's routed experts, shared and neighbour routing
# first (where groups form), then independent. Files under $OUT: moe-grouped-tokens/*.json, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/moe-grouped-tokens"
{
  timeout ${LAB_TIMEOUT:-540} python -m bench.labs.moe_grouped_tokens --tokens ${TOKENS:-4 8 2} \
      --routing ${ROUTINGS:-shared neighbour independent} --min-members 2 --out "$OUT/moe-grouped-tokens"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/moe-grouped-tokens/run.log"
