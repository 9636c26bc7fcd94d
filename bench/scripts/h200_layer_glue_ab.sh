#!/bin/bash
# Issues 51/52: a layer's glue kernels before and after (the batch-1 cache write as one in-place update, the q_a and
# kv_a norms' sums from one reduction), in one device call per stage, the two trees alternating in fresh processes
# (the 61-layer step moves ~3% between processes, docs/performance.md "Building the programs at depth").
#   rm -rf .before && mkdir .before
#   git archive <commit> model jaxspec convert bench ':!bench/results' | tar -x -C .before
#   STAGE=one bash bench/scripts/h200_layer_glue_ab.sh   # one device holding the model: bench.loop_rows at 61 layers
#   STAGE=per bash bench/scripts/h200_layer_glue_ab.sh   # one device of eight: bench.per_device at 61 (and 4 less 3)
#   STAGE=verify bash bench/scripts/h200_layer_glue_ab.sh   # one device, verify T = 4 only, before/after twice more
#   STAGE=small bash bench/scripts/h200_layer_glue_ab.sh    # 4 layers (no slower?), then this tree's 4-layer step
#       under the profiler with its optimised HLO (bench.labs.step_profile --hlo; read with bench.depth_gap_hlo)
# Files under $OUT: one-<tree>-<n>.json, small-<tree>-<n>.json, per-<tree>/ (per-device-gpu-*.json, .md), census/,
# profile/, run-<stage>.log.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/bench-out}
BEFORE=${BEFORE:-.before}
STAGE=${STAGE:-one}
mkdir -p "$OUT"
here=$(pwd)
export JAXSPEC_AUTOTUNE_CACHE=/tmp/autotune-glue  # both trees pick from the same GEMM autotuning
rows() {  # tree, n, rows... (LAYERS, default 61; files one-* at 61 layers, small-* below)
  local tree=$1 n=$2 layers=${LAYERS:-61} name=one; shift 2
  [ "$layers" != 61 ] && name=small
  local dir=$here; [ "$tree" = before ] && dir=$here/$BEFORE
  (cd "$dir" && timeout ${ROWS_TIMEOUT:-170} python -m bench.loop_rows --label "$tree" --layers "$layers" \
      --rows "$@" --iters ${ITERS:-10} --out "$OUT/$name-$tree-$n.json") 2>&1 \
      | grep -E "device loop|compile|Error|error" | tail -6
}
per() {  # tree
  local dir=$here; [ "$1" = before ] && dir=$here/$BEFORE
  (cd "$dir" && timeout ${PER_TIMEOUT:-200} python -m bench.per_device --layers 61 --moe-layers repeated \
      --tokens 1 4 --cycle-k 3 --routing neighbour --out "$OUT/per-$1") 2>&1 | grep -E "^\||Error|error" | tail -12
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  if [ "$STAGE" = verify ]; then
    for n in 3 4; do
      echo "== before $n $(date -u +%T)"; rows before $n verify4
      echo "== after $n $(date -u +%T)"; rows after $n verify4
    done
  elif [ "$STAGE" = small ]; then
    for n in 1 2; do
      echo "== after $n $(date -u +%T)"; LAYERS=4 ITERS=20 rows after $n decode verify4 cycle3
      echo "== before $n $(date -u +%T)"; LAYERS=4 ITERS=20 rows before $n decode verify4 cycle3
    done
    echo "== profile $(date -u +%T)"
    mkdir -p "$OUT/profile"
    timeout 150 python -m bench.labs.step_profile --layers 4 --tokens 1 --steps 10 --routing independent --hlo \
        --out "$OUT/profile" 2>&1 | grep -E "busy|Error|error" | tail -3
    gzip "$OUT"/profile/*.hlo.txt
  elif [ "$STAGE" = one ]; then
    echo "== after 1 $(date -u +%T)"; rows after 1 decode verify4 cycle3
    echo "== before 1 $(date -u +%T)"; rows before 1 decode verify4 cycle3
    echo "== after 2 $(date -u +%T)"; rows after 2 decode
    echo "== before 2 $(date -u +%T)"; rows before 2 decode
  else
    echo "== census after $(date -u +%T)"
    timeout ${CENSUS_TIMEOUT:-150} python -m bench.per_device --layers 4 --prefix-layers 3 --tokens 1 4 --cycle-k \
        --routing neighbour --iters 5 --out "$OUT/census" 2>&1 | grep -E "^\||Error|error" | tail -8
    echo "== per-device after $(date -u +%T)"; per after
    echo "== per-device before $(date -u +%T)"; per before
  fi
  echo "== end $(date -u +%T)"
} 2>&1 | grep -v "gpu_hlo_schedule\|hlo_rematerialization" | tee "$OUT/run-$STAGE.log"
