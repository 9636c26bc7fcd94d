#!/bin/bash
# Issue 51's "the 4-layer step no slower": bench.loop_rows at 4 layers, the tree before the glue change (BEFORE,
# as in h200_layer_glue_ab.sh) and this one alternating in fresh processes, then this tree's 4-layer step under the
# profiler with its optimised HLO (bench.labs.step_profile --hlo; read with bench.depth_gap_hlo).
# Files under $OUT: small-<tree>-<n>.json, profile/, run-small.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
BEFORE=${BEFORE:-.before}
mkdir -p "$OUT/profile"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-glue
rows() {  # tree, n
  local dir=$here; [ "$1" = before ] && dir=$here/$BEFORE
  (cd "$dir" && timeout 120 python -m bench.loop_rows --label "$1" --layers 4 --rows decode verify4 cycle3 \
      --iters 20 --out "$OUT/small-$1-$2.json") 2>&1 | grep -E "device loop|Error|error" | tail -4
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  for n in 1 2; do
    echo "== after $n $(date -u +%T)"; rows after $n
    echo "== before $n $(date -u +%T)"; rows before $n
  done
  echo "== profile $(date -u +%T)"
  timeout 150 python -m bench.labs.step_profile --layers 4 --tokens 1 --steps 10 --routing independent --hlo \
      --out "$OUT/profile" 2>&1 | grep -E "busy|Error|error" | tail -3
  gzip "$OUT"/profile/*.hlo.txt
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-small.log"
