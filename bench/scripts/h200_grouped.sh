#!/bin/bash
# Issue 36's unique-expert routed experts (bench.labs.moe_grouped: moe_wgmma's kernels over the slots whose expert
# no other slot chose, the group kernels over the shared experts) against the engine's, one K2.5 layer, at each
# routing regime and T. Files under $OUT: moe-grouped/*.json, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/moe-grouped"
{
  timeout ${LAB_TIMEOUT:-540} python -m bench.labs.moe_grouped --tokens ${TOKENS:-2 4 8} \
      --routing ${ROUTINGS:-independent neighbour shared} --out "$OUT/moe-grouped"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/moe-grouped/run.log"
