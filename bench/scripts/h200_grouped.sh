#!/bin/bash
# Issue 36: moe_wgmma against moe_grouped (bench.moe_grouped) on one K2.5 layer's routed experts, at each routing
# regime, T and group threshold (MIN_MEMBERS). Files under $OUT: moe-grouped/*.json, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/moe-grouped"
{
  timeout ${LAB_TIMEOUT:-540} python -m bench.moe_grouped --tokens ${TOKENS:-2 4 5 8} \
      --routing ${ROUTINGS:-independent neighbour shared} --min-members ${MIN_MEMBERS:-2 3} --out "$OUT/moe-grouped"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/moe-grouped/run.log"
