#!/bin/bash
# Nsight Compute over the Mosaic GPU MoE kernels (model/kernels/moe_wgmma.py) of one K2.5 layer, one device call:
#   bash bench/h200_profile_wgmma.sh 2:2:4:0:p:4      (STAGES:GATE_UP_SPLITS:DOWN_SPLITS:OVERLAP:CONVERT:TOKENS)
# Writes $OUT/ncu-wgmma.txt (the gate_up and down kernels of the first call).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
for c in "$@"; do
  echo "=== $c"
  timeout "${PROFILE_TIMEOUT:-200}" ncu --clock-control none --kernel-name regex:mosaic_gpu --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 -m bench.moe_wgmma_lab --profile "$c" 2>&1 | grep -v -i "warn"
done > "$OUT/ncu-wgmma.txt" 2>&1
tail -n 5 "$OUT/ncu-wgmma.txt"
