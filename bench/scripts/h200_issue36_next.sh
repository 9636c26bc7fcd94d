#!/bin/bash
# Issue 36's next device call, most important first (each step under its own timeout, all inside one 10-minute call):
# the whole step with moe_grouped held to the plain path (bench.kernel_agreement, variant experts_grouped), then
# where moe_grouped's extra time at independent routing goes, kernel by kernel, against the slot kernel's
# (bench.labs.step_profile, 4 layers: the per-layer kernels are what matter), then the depth rows not yet measured
# (T = 2 and 5, neighbour and shared, moe_grouped). Files under $OUT: kernel-agreement/, profile-grouped/,
# profile-auto/, step-routing/, run.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT/kernel-agreement" "$OUT/profile-grouped" "$OUT/profile-auto"
{
  echo "== kernel_agreement $(date -u +%T)"
  timeout 120 python -m bench.kernel_agreement --layers 4 --experts int4 --batches 1 --contexts 1024 --tokens 4 \
      --variants experts experts_grouped --out "$OUT/kernel-agreement"
  for kernel in grouped auto; do
    echo "== step_profile moe=$kernel $(date -u +%T)"
    timeout 110 python -m bench.labs.step_profile --layers 4 --tokens 4 --routing independent --moe-kernel $kernel \
        --out "$OUT/profile-$kernel"
  done
  echo "== routing $(date -u +%T)"
  MOE_KERNEL=grouped ROUTINGS="neighbour shared" TOKENS="2 5" BUDGET_S=120 STEP_TIMEOUT=200 \
      bash bench/scripts/h200_routing.sh
  echo "== end $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
