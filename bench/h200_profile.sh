#!/bin/bash
# Nsight Compute over the MoE kernels of one K2.5 layer (one device call on the H200), e.g.
#   bash bench/h200_profile.sh pairs_32_s8:1 pairs_32_s8:4      (candidate names: bench/moe_kernel_lab.py)
# Writes $OUT/ncu-profile.txt; bench/results/ncu/ncu-1325-pairs-t1.txt came from the first argument above.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
for c in "$@"; do
  echo "=== $c"
  timeout "${PROFILE_TIMEOUT:-140}" ncu --clock-control none --kernel-name regex:moe_ --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 -m bench.moe_kernel_lab --profile "$c" 2>&1 | grep -v -i "warn"
done > "$OUT/ncu-profile.txt" 2>&1
