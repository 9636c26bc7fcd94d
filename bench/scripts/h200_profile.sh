#!/bin/bash
# Nsight Compute over the MoE kernels of one K2.5 layer (one device call on the H200), e.g.
#   bash bench/scripts/h200_profile.sh pairs_32_s8:1 pairs_32_s8:4      (Triton candidates: bench/labs/moe_kernel_lab.py)
# Writes $OUT/ncu-profile.txt (the first two kernels of the first call).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
LAB=${LAB:-moe_kernel_lab}
mkdir -p "$OUT"
KERNELS=${KERNELS:-regex:moe_}  # the Triton kernels are named moe_*
for c in "$@"; do
  echo "=== $c"
  timeout "${PROFILE_TIMEOUT:-200}" ncu --clock-control none --kernel-name "$KERNELS" --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -m "bench.labs.$LAB" --profile "$c" 2>&1 | grep -v -i "warn"
done > "$OUT/ncu-profile.txt" 2>&1
tail -n 5 "$OUT/ncu-profile.txt"
