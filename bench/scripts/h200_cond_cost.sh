#!/bin/bash
# What data-dependent control flow costs inside the device loop on the H200 (bench.labs.cond_cost): a conditional
# per layer, and the loop structures the adaptive program could take; under XLA's default command-buffer types
# and, with FLAG_SETS=all, with conditionals and while loops added to them. Files under $OUT: cond-cost/*.json,
# run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/cond-cost"
{
  python -m bench.labs.cond_cost --label default --out "$OUT/cond-cost" ${STRUCTURES:+--structures $STRUCTURES}
  if [ "${FLAG_SETS:-default}" = all ]; then
    for types in "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL"; do
      label=$(echo "$types" | tr ',' '-' | tr 'A-Z' 'a-z')
      XLA_FLAGS="--xla_gpu_enable_command_buffer=$types" timeout 200 python -m bench.labs.cond_cost --label "$label" \
          --out "$OUT/cond-cost" ${STRUCTURES:+--structures $STRUCTURES} 2>&1 | tail -8
    done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/cond-cost/run.log"
