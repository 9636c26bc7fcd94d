#!/bin/bash
# Warp stall reasons (cycles a warp waits per issued instruction, by reason) of the Mosaic GPU MoE kernels of one
# K2.5 layer, one call of each variant: LAB variants as in bench/scripts/h200_profile.sh, e.g.
#   bash bench/scripts/ncu_stalls.sh f:4:4:1:2:1 2:7:8:0:p:b:2:o:2:1
# Writes $OUT/ncu-stalls.txt.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
for c in "$@"; do
  echo "=== $c"
  timeout "${PROFILE_TIMEOUT:-90}" ncu --clock-control none --kernel-name "regex:mosaic_gpu|fused" --launch-count 3 \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum,dram__bytes_read.sum.per_second,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.per_cycle_active" \
    python3 -m bench.labs.moe_wgmma_lab --profile "$c" 2>&1 | grep -v -i "warn"
done > "$OUT/ncu-stalls.txt" 2>&1
tail -n 5 "$OUT/ncu-stalls.txt"
