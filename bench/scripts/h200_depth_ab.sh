#!/bin/bash
# Issue 36: an A/B of one bench.step flag on one MoE layer at depth (the 10-layer step minus its 5-layer prefix,
# device loop) at T = 1 and 4 under independent routing, the arms back to back in one call. FLAG names the flag and
# ARMS its values: by default q_a and kv_a as two weights against one (--attention-input separate / fused); e.g.
# FLAG=--moe-layers ARMS="distinct repeated" checks that one drawn MoE layer measures what distinct layers do.
# Files under $OUT: step-depth-<arm>/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
FLAG=${FLAG:---attention-input}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for arm in ${ARMS:-separate fused}; do
    echo "== depth $FLAG $arm $(date -u +%T)"
    mkdir -p "$OUT/step-depth-$arm"
    timeout ${STEP_TIMEOUT:-270} python -m bench.step --layers 10 --prefix-layers 5 --batches 1 --contexts 1024 \
        --tokens ${TOKENS:-1 4} --cycle-k --skip-moe-layer --skip-reference --iters 10 --routing independent \
        $FLAG $arm --out "$OUT/step-depth-$arm"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
