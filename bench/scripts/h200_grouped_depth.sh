#!/bin/bash
# Issue 36, moe_grouped on the H200: the routed experts alone (bench.moe_grouped: slots against group thresholds
# 2 and 3 at every routing and T), then one MoE layer at depth with Kernels(moe="grouped") at T = 4 under the three
# routing regimes (bench.step through h200_routing.sh). Files under $OUT: moe-grouped/, step-routing/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
{
  echo "== moe_grouped $(date -u +%T)"
  LAB_TIMEOUT=${LAB_TIMEOUT:-300} TOKENS="${LAB_TOKENS:-2 4 5 8}" bash bench/scripts/h200_grouped.sh
  echo "== routing, moe=grouped $(date -u +%T)"
  MOE_KERNEL=grouped ROUTINGS="${ROUTINGS:-shared neighbour independent}" TOKENS="${TOKENS:-4}" BUDGET_S=170 \
      STEP_TIMEOUT=240 bash bench/scripts/h200_routing.sh
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
