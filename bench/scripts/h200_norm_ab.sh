#!/bin/bash
# Issue 36: the fused RMSNorm kernel against XLA's norms in one call: a 4-layer decode step traced kernel by kernel
# with each (bench.labs.step_profile, with the optimized HLO that names what each fusion computes), then one MoE
# layer at depth (bench.step: the 10-layer step minus its 5-layer prefix, device loop, T = 1) with each.
# Files under $OUT: profile-norm-{auto,off}/, step-depth-{auto,off}/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for norm in off auto; do
    echo "== step_profile norm=$norm $(date -u +%T)"
    mkdir -p "$OUT/profile-norm-$norm"
    timeout ${PROFILE_TIMEOUT:-100} python -m bench.labs.step_profile --layers 4 --tokens 1 --norm-kernel $norm \
        --hlo --out "$OUT/profile-norm-$norm"
  done
  for norm in off auto; do
    echo "== depth norm=$norm $(date -u +%T)"
    mkdir -p "$OUT/step-depth-$norm"
    timeout ${STEP_TIMEOUT:-200} python -m bench.step --layers 10 --prefix-layers 5 --batches 1 --contexts 1024 \
        --tokens 1 --cycle-k --skip-moe-layer --skip-reference --iters 10 --routing independent \
        --norm-kernel $norm --out "$OUT/step-depth-$norm"
  done
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
