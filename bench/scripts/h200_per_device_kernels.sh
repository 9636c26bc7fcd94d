#!/bin/bash
# Issue 52: one device's program of the 8-way mesh, its kernels as the sharded engine dispatches them.
# STAGE=census: 4 layers less 3 (per-layer time and kernels), T = 1 and 4, each program's optimised HLO saved;
# STAGE=depth: 61 layers less 30, T = 1 and 4 and a K = 3 cycle (TOKENS), once per routed-experts kernel of
# MOE_KERNELS (bench.per_device --moe-kernel; default auto), back to back. Files under $OUT/<stage>[-<moe kernel>]/:
# per-device-gpu-<date>.json and .md (and *.hlo.txt.gz); $OUT/run-<stage>.log. The A/B of the sharded engine's kernels before and after it ran
# the MLA and router kernels per device (run 2336) was this script at commit 3cc3c02, whose ARMS were that bench's
# `--kernels sharded` (XLA's attention and routing) and `--kernels one-device` (the kernels, as the engine now).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
STAGE=${STAGE:-census}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  echo "== $STAGE $(date -u +%T)"
  if [ "$STAGE" = census ]; then
    timeout ${STAGE_TIMEOUT:-200} python -m bench.per_device --layers 4 --prefix-layers 3 --tokens 1 4 --cycle-k \
        --routing neighbour --iters 5 --hlo --out "$OUT/census"
  else
    for moe in ${MOE_KERNELS:-auto}; do
      echo "== --moe-kernel $moe $(date -u +%T)"
      timeout ${STAGE_TIMEOUT:-270} python -m bench.per_device --layers 61 --moe-layers repeated \
          --tokens ${TOKENS:-1 4} --cycle-k 3 --routing neighbour --moe-kernel "$moe" --out "$OUT/depth-$moe"
    done
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-$STAGE.log"
