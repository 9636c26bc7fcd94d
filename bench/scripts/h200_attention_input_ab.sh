#!/bin/bash
# Issue 36: q_a and kv_a as one weight (the engines' run layout, jaxspec.sharded.weights_to_run) against the two
# weights checkpoints store, one MoE layer at depth (bench.step: the 10-layer step minus its 5-layer prefix, device
# loop) at T = 1 and 4 under independent routing, the two arms back to back in one call.
# Files under $OUT: step-depth-{separate,fused}/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for arm in ${ARMS:-separate fused}; do
    echo "== depth attention input $arm $(date -u +%T)"
    mkdir -p "$OUT/step-depth-$arm"
    timeout ${STEP_TIMEOUT:-270} python -m bench.step --layers 10 --prefix-layers 5 --batches 1 --contexts 1024 \
        --tokens ${TOKENS:-1 4} --cycle-k --skip-moe-layer --skip-reference --iters 10 --routing independent \
        --attention-input $arm --out "$OUT/step-depth-$arm"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
