#!/bin/bash
# Issue 36's next device call, most important first (each step under its own timeout, all inside one 10-minute
# call): the committed moe_wgmma skip under expert parallelism (bench.labs.ep_slots), the unique-expert routed experts
# against the engine's (bench.labs.moe_grouped), then the independent-routing rows at depth. Files under $OUT:
# ep-slots/, moe-grouped/, step-routing/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/ep-slots"
{
  echo "== ep_slots $(date -u +%T)"
  timeout 90 python -m bench.labs.ep_slots --tokens 1 4 --out "$OUT/ep-slots"
  echo "== moe_grouped $(date -u +%T)"
  LAB_TIMEOUT=240 TOKENS="4 8" bash bench/scripts/h200_grouped.sh
  echo "== routing $(date -u +%T)"
  ROUTINGS=independent TOKENS="4 8" BUDGET_S=150 STEP_TIMEOUT=210 bash bench/scripts/h200_routing.sh
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
