#!/bin/bash
# Issue 52: one device's program of the 8-way mesh with the kernels the sharded engine dispatches against those one
# device holding the whole model would (the MLA decode and router kernels), back to back in one call.
# STAGE=census: 4 layers less 3 (per-layer time and kernels), T = 1 and 4, each program's optimised HLO saved;
# STAGE=depth: 61 layers less 30, T = 1 and 4 and a K = 3 cycle. ARMS: the --kernels values in the order run.
# Files under $OUT/<stage>-<arm>/: per-device-gpu-<date>.json and .md (and *.hlo.txt.gz); $OUT/run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
STAGE=${STAGE:-census}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for arm in ${ARMS:-sharded one-device}; do
    echo "== $STAGE --kernels $arm $(date -u +%T)"
    if [ "$STAGE" = census ]; then
      timeout ${ARM_TIMEOUT:-200} python -m bench.per_device --layers 4 --prefix-layers 3 --tokens 1 4 --cycle-k \
          --routing neighbour --iters 5 --kernels "$arm" --hlo --out "$OUT/census-$arm"
    else
      timeout ${ARM_TIMEOUT:-270} python -m bench.per_device --layers 61 --moe-layers repeated --tokens 1 4 \
          --cycle-k 3 --routing neighbour --kernels "$arm" --out "$OUT/depth-$arm"
    fi
  done
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-$STAGE.log"
