#!/bin/bash
# One MoE layer at depth under the three routing regimes of bench.routes (issue 36), today's kernels: the 10-layer
# step minus its 5-layer prefix, device loop, at 1k; B = 1 and T = 1 / 4 / 8 unless BATCHES / TOKENS say otherwise;
# MOE_LAYERS=repeated draws one MoE layer for all (bench.step --moe-layers).
# Files under $OUT: step-routing/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/step-routing"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== $(date -u +%T)"
  timeout ${STEP_TIMEOUT:-480} python -m bench.step --layers 10 --prefix-layers 5 --batches ${BATCHES:-1} --contexts 1024 \
      --tokens ${TOKENS:-1 4 8} --cycle-k --skip-moe-layer --skip-reference --iters 10 --routing ${ROUTINGS:-neighbour shared independent} \
      --moe-kernel ${MOE_KERNEL:-auto} --moe-layers ${MOE_LAYERS:-distinct} --budget-s ${BUDGET_S:-380} \
      --out "$OUT/step-routing"
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/step-routing/run.log"
